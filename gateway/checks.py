"""Checks of what a request carries: ids, lengths, sequences, tool names, the size of
its body, and the path of the bad field in msgspec's validation messages. Each failure
is a 422 (or, for :func:`field_of`, the ``field`` of a 400) that names the field, and a
413 for a body over the limit."""

from __future__ import annotations

import re

from starlette.requests import Request

from schemas import is_token

from .errors import PayloadTooLarge, Unprocessable

#: A tool in a turn's allowlist: ``server.tool`` or a bare ``tool``.
TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}(\.[A-Za-z0-9_-]{1,64})?$")


def check_id(value: str | None, field: str) -> str:
    if value is None or not is_token(value):
        shown = repr(value[:80]) if value is not None else "none"
        raise Unprocessable(
            f"invalid {field}: {shown} must be 1-64 characters from A-Z a-z 0-9 _ -", field=field
        )
    return value


def check_length(value: str, limit: int, field: str) -> None:
    if len(value) > limit:
        raise Unprocessable(
            f"`{field}` is {len(value)} characters, over the limit of {limit}", field=field
        )


def check_sequence(value: str | None, field: str) -> int | None:
    if value is None:
        return None
    if not value.isascii() or not value.isdigit() or len(value) > 19:
        raise Unprocessable(f"`{field}` must be a non-negative integer", field=field)
    return int(value)


_AT = re.compile(r" - at `\$\.?(.*)`$")
_NAMED = re.compile(r"field `([^`]*)`")


def field_of(message: str) -> str | None:
    """The path msgspec names in a validation error (``$.tools[1]`` → ``tools[1]``)."""
    at = _AT.search(message)
    named = _NAMED.search(message)
    if at and named:
        return f"{at.group(1)}.{named.group(1)}" if at.group(1) else named.group(1)
    if at:
        return at.group(1) or None
    if named:
        return named.group(1)
    return None


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, refused (413) past ``limit`` bytes: by its declared length
    before reading, or as soon as what arrives is over it."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"body of {declared} bytes is over the limit of {limit} bytes")
    chunks = bytearray()
    async for chunk in request.stream():
        chunks += chunk
        if len(chunks) > limit:
            raise PayloadTooLarge(f"body is over the limit of {limit} bytes")
    return bytes(chunks)
