"""The replies a :class:`loopmesh.testing.fake_llm.FakeLLM` can be scripted with, and ``auto`` mode.

Each builder returns a frozen dataclass; ``loopmesh.testing.fake_stream`` turns it into HTTP.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Text:
    content: str
    chunk_size: int = 8
    usage: bool = True
    delay_s: float = 0.0


@dataclass(frozen=True)
class ToolCalls:
    calls: tuple[tuple[str, str], ...]  # (name, arguments as JSON text)
    content: str = ""
    omit_index: bool = False
    omit_id: bool = False
    fragment_size: int = 7
    usage: bool = True
    chunk_size: int = 8  # characters of content per chunk
    delay_s: float = 0.0  # between content chunks (the calls follow at once)


@dataclass(frozen=True)
class Error:
    status: int
    message: str = ""
    retry_after: float | None = None


@dataclass(frozen=True)
class Hang:
    seconds: float


@dataclass(frozen=True)
class Cut:
    content: str
    after_chunks: int
    chunk_size: int = 8


@dataclass(frozen=True)
class Empty:
    usage: bool = True


@dataclass(frozen=True)
class Auto:
    """Decide from the request: see :func:`resolve_auto`."""


Reply = Text | ToolCalls | Error | Hang | Cut | Empty | Auto


def text(content: str, *, chunk_size: int = 8, usage: bool = True, delay_s: float = 0) -> Text:
    """Stream ``content`` in fragments of ``chunk_size`` characters, ``delay_s`` apart."""
    return Text(content, chunk_size=chunk_size, usage=usage, delay_s=delay_s)


def tool_calls(
    *calls: tuple[str, dict[str, Any] | str],
    content: str = "",
    omit_index: bool = False,
    omit_id: bool = False,
    fragment_size: int = 7,
    usage: bool = True,
    chunk_size: int = 8,
    delay_s: float = 0,
) -> ToolCalls:
    """Call tools, arguments streamed in ``fragment_size`` pieces per call index.

    ``omit_index`` / ``omit_id`` leave those fields out of every tool-call delta, the
    way some OpenAI-compatible servers do. A ``str`` argument is sent verbatim.
    ``content`` streams first, ``chunk_size`` characters a chunk, ``delay_s`` apart.
    """
    encoded = tuple((name, a if isinstance(a, str) else json.dumps(a)) for name, a in calls)
    return ToolCalls(
        encoded,
        content=content,
        omit_index=omit_index,
        omit_id=omit_id,
        fragment_size=fragment_size,
        usage=usage,
        chunk_size=chunk_size,
        delay_s=delay_s,
    )


def error(status: int, message: str = "", retry_after: float | None = None) -> Error:
    """Answer with an HTTP error in OpenAI's ``{"error": {...}}`` shape."""
    return Error(status, message or f"fake error {status}", retry_after)


def hang(seconds: float) -> Hang:
    """Accept the request and send nothing for ``seconds`` (then a 504)."""
    return Hang(seconds)


def cut(content: str, after_chunks: int, *, chunk_size: int = 8) -> Cut:
    """Stream the first ``after_chunks`` chunks of ``content`` (``chunk_size``
    characters each), then drop the connection."""
    return Cut(content, after_chunks, chunk_size)


def empty(*, usage: bool = True) -> Empty:
    """A finished completion with no content and no tool calls."""
    return Empty(usage=usage)


def auto() -> Auto:
    """Answer like a diligent agent; see :func:`resolve_auto`."""
    return Auto()


_CALL = re.compile(r"\bcall\s+([A-Za-z0-9_.\-]+)\s*(\{.*\})", re.DOTALL)


def resolve_auto(body: dict[str, Any]) -> Reply:
    """The reply ``auto`` mode gives to a request.

    With a tool whose name ends in ``task_completion`` offered: once a tool result
    follows the last user message (the loop's own reminders are not the user's), call
    it with ``{"result": <summary>}``; else if the last user message says
    ``call <tool> {json}``, call that tool; else call it. With no such tool offered,
    reply with text.
    """
    messages: list[dict[str, Any]] = body.get("messages") or []
    names = [(t.get("function") or {}).get("name", "") for t in body.get("tools") or [] if t]
    done = next((n for n in names if n.endswith("task_completion")), None)
    # the user's last message: not one the loop added (a reminder, a warning: its name)
    last_user = max(
        (
            i
            for i, m in enumerate(messages)
            if m.get("role") == "user" and m.get("name") != "loopmesh"
        ),
        default=-1,
    )
    results = [m for m in messages[last_user + 1 :] if m.get("role") == "tool"]
    user_text = _text(messages[last_user]) if last_user >= 0 else ""
    if results:
        summary = f"done: {_text(results[-1])[:200]}"
        if done:
            return tool_calls((done, {"result": summary}))
        return text(summary, chunk_size=64)
    match = _CALL.search(user_text)
    if match and names:
        wanted = match.group(1)
        name = next((n for n in names if n == wanted or n.endswith(wanted)), wanted)
        return tool_calls((name, match.group(2)), fragment_size=32)
    if done:
        return tool_calls((done, {"result": f"done: {user_text[:200]}"}))
    return text(f"ok: {user_text[:200]}", chunk_size=64)


def _text(message: dict[str, Any]) -> str:
    content = message.get("content") or ""
    if isinstance(content, list):  # content parts
        return " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)
