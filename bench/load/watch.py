"""The SSE clients of ``python -m bench.load``: a sample of sessions, each watched by one
event stream of the gateway from before its first turn to its last turn's ``loop_end``.
Every token a ``content_delta`` (or ``thinking_delta``) brings carries the time the model
emitted it (``bench/llm_stream.py``): its added latency is the receipt time minus that.
However the worker groups the tokens into deltas, each counts once."""

from __future__ import annotations

import asyncio
import contextlib
from array import array
from collections import Counter
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import httpx
import msgspec

from bench.llm_stream import STAMP
from bench.sse_clients import read_sse

OPEN_S = 30.0  # an event stream's head, at most
END_S = 30.0  # a turn's loop_end on the stream after the load generator had it, at most


class _Event(msgspec.Struct):
    type: str = ""
    turn_id: str = ""
    text: str = ""


class Watch:
    """Every watched session's tokens: their added latency, and tokens and characters
    per turn."""

    def __init__(self, gateway: str, http: httpx.AsyncClient) -> None:
        url = urlsplit(gateway)
        self.host, self.port = url.hostname or "127.0.0.1", url.port or 80
        self.http = http
        self.latency_ms = array("d")
        self.tokens: Counter[str] = Counter()  # per turn
        self.chars: Counter[str] = Counter()
        self.retracts = 0
        self.sessions = 0
        self._ends: dict[str, asyncio.Event] = {}
        self._decode = msgspec.json.Decoder(_Event).decode

    def ended(self, turn_id: str) -> asyncio.Event:
        """Set once the turn's ``loop_end`` came over its session's stream."""
        return self._ends.setdefault(turn_id, asyncio.Event())

    def message(self, block: bytes, now: float) -> None:
        data = block[block.find(b"data: ") + 6 :] if b"data: " in block else b""
        if not data.startswith(b"{"):
            return  # a keep-alive, or a notice without an event
        event = self._decode(data.split(b"\r\n", 1)[0])
        if event.type in ("content_delta", "thinking_delta"):
            stamps = STAMP.findall(event.text)
            for emitted in stamps:
                self.latency_ms.append((now - float(emitted)) * 1000)
            self.tokens[event.turn_id] += len(stamps)
            self.chars[event.turn_id] += len(event.text)
        elif event.type == "retract":
            self.retracts += 1
        elif event.type == "loop_end":
            self.ended(event.turn_id).set()

    @contextlib.asynccontextmanager
    async def session(self, session: str) -> AsyncIterator[list[str]]:
        """Create ``session`` through the gateway and watch it while the block runs its
        turns, whose ids it appends to the list it is given; on the way out, wait for
        the last one's ``loop_end`` on the stream."""
        r = await self.http.post("/v1/sessions", json={"session": session})
        if r.status_code != 201:
            raise RuntimeError(f"the gateway did not create session {session}: {r.text}")
        path = f"/v1/sessions/{session}/events"
        opened = asyncio.Event()
        async with asyncio.TaskGroup() as tg:  # the reader's failure ends the block
            reader = tg.create_task(read_sse(self.host, self.port, path, self.message, opened.set))
            async with asyncio.timeout(OPEN_S):
                await opened.wait()
            self.sessions += 1
            last: list[str] = []
            yield last
            if last:
                try:
                    async with asyncio.timeout(END_S):
                        await self.ended(last[-1]).wait()
                except TimeoutError:
                    raise RuntimeError(
                        f"turn {last[-1]}'s loop_end did not reach its SSE client within "
                        f"{END_S:g} s of the load generator's"
                    ) from None
            reader.cancel()
