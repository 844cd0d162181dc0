"""A small SSE reader over an httpx streaming response, for the tests."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class Message:
    event: str = "message"
    id: str | None = None
    data: str = ""
    comments: list[str] = field(default_factory=list)

    def json(self) -> Any:
        return json.loads(self.data)


async def messages(
    response: httpx.Response, *, comments: bool = False, caught_up: bool = False
) -> AsyncIterator[Message]:
    """The SSE messages of ``response``; with ``comments``, comment-only blocks too; with
    ``caught_up``, the gateway's ``caught_up`` notice too (most tests read events only)."""
    current = Message()
    data: list[str] = []
    async for line in response.aiter_lines():
        if line == "":
            if data or (current.comments and comments):
                current.data = "\n".join(data)
                if (data or comments) and (caught_up or current.event != "caught_up"):
                    yield current
            current, data = Message(), []
            continue
        if line.startswith(":"):
            current.comments.append(line[1:].strip())
            continue
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "event":
            current.event = value
        elif name == "id":
            current.id = value
        elif name == "data":
            data.append(value)
