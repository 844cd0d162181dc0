"""A turn's memory across sessions (``[loop.memory]``): the ``memory.*`` tools and, in
``auto`` mode, the memories recalled into the prompt.

The turn's namespaces are its user's (``Turn.user``) when it names one, and its agent's.
``memory.save`` stores in the first of them (the model may say ``about: "agent"``);
``memory.search`` and ``memory.forget`` look in both. A save's id comes from its call's
id, so a call run again after a crash stores the same memory again, not a second one.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from schemas import MEMORY_SERVER, Passage, ToolCallRequest, ToolResult, ToolSpec, Turn, WireError
from schemas.memory import MAX_MEMORY_CHARS, Memory, MemorySource

from .protocols import Memories
from .settings import MemorySettings

_SEARCH_MAX = 20

SPECS = (
    ToolSpec(
        server=MEMORY_SERVER,
        name="save",
        description=(
            "Remember a fact for later sessions: something the user told you about "
            "themselves, a preference, a decision. One fact per call, in a full sentence."
        ),
        input_schema={
            "type": "object",
            "properties": {
                "text": {"type": "string", "minLength": 1, "maxLength": MAX_MEMORY_CHARS},
                "about": {
                    "type": "string",
                    "enum": ["user", "agent"],
                    "description": "whose memory: the user's (the default) or your own",
                },
            },
            "required": ["text"],
        },
    ),
    ToolSpec(
        server=MEMORY_SERVER,
        name="search",
        description="Search what you remember from earlier sessions, by meaning.",
        input_schema={
            "type": "object",
            "properties": {
                "query": {"type": "string", "minLength": 1},
                "limit": {"type": "integer", "minimum": 1, "maximum": _SEARCH_MAX},
            },
            "required": ["query"],
        },
    ),
    ToolSpec(
        server=MEMORY_SERVER,
        name="forget",
        description="Forget a memory, by the id a search gave.",
        input_schema={
            "type": "object",
            "properties": {"id": {"type": "string", "minLength": 1}},
            "required": ["id"],
        },
    ),
)


class Recall:
    """One turn's memory: its tools (:meth:`call`) and its recall (:meth:`passages`)."""

    def __init__(
        self, memories: Memories, settings: MemorySettings, turn: Turn, agent: str
    ) -> None:
        self.memories = memories
        self.settings = settings
        self.turn = turn
        self.agent = agent
        self.spaces: list[tuple[str, str]] = [("agent", agent)]
        if turn.user:
            self.spaces.insert(0, ("user", turn.user))

    async def passages(self) -> list[Passage]:
        """The memories nearest the turn's input, as retrieved-context passages."""
        if self.settings.recall <= 0 or not self.turn.input.strip():
            return []
        found = await self.memories.search(
            self.turn.tenant, self.spaces, self.turn.input, self.settings.recall
        )
        return [_passage(m) for score, m in found if score >= self.settings.min_score]

    async def call(self, request: ToolCallRequest) -> ToolResult:
        started = time.monotonic()
        args = request.arguments
        try:
            if request.tool == "save":
                content = await self._save(request, args)
            elif request.tool == "search":
                content = await self._search(args)
            elif request.tool == "forget":
                content = await self._forget(args)
            else:
                raise _Refused("unknown_tool", f"memory has no tool {request.tool!r}")
        except _Refused as refused:
            return self._result(request, "", refused.code, str(refused), started)
        except ValueError as exc:  # the namespace is full
            return self._result(request, "", "memory_full", str(exc), started)
        return self._result(request, content, None, "", started)

    async def _save(self, request: ToolCallRequest, args: dict[str, Any]) -> str:
        text = _text(args, "text").strip()
        if len(text) > MAX_MEMORY_CHARS:
            raise _Refused("invalid_arguments", f"`text` is longer than {MAX_MEMORY_CHARS}")
        about = args.get("about", "user")
        if about not in ("user", "agent"):
            raise _Refused("invalid_arguments", "`about` must be `user` or `agent`")
        kind, name = self.spaces[0] if about == "user" else ("agent", self.agent)
        memory = Memory(
            id=memory_id(request.call_id),
            tenant=self.turn.tenant,
            kind=kind,  # type: ignore[arg-type]
            name=name,
            text=text,
            created_at=time.time(),
            source=MemorySource(
                session=self.turn.session,
                turn=self.turn.id,
                call=request.call_id,
                agent=self.agent,
            ),
        )
        saved = await self.memories.save(memory)
        return f"saved as {saved.id} ({kind} {name})"

    async def _search(self, args: dict[str, Any]) -> str:
        query = _text(args, "query")
        limit = args.get("limit", 5)
        if not isinstance(limit, int) or not 1 <= limit <= _SEARCH_MAX:
            raise _Refused("invalid_arguments", f"`limit` must be 1 to {_SEARCH_MAX}")
        found = await self.memories.search(self.turn.tenant, self.spaces, query, limit)
        lines = [
            f"- [{m.id}] {m.text} ({_when(m)}, score {score:.2f})"
            for score, m in found
            if score >= self.settings.min_score
        ]
        return "\n".join(lines) or "nothing remembered matches"

    async def _forget(self, args: dict[str, Any]) -> str:
        id = _text(args, "id")
        if await self.memories.forget(self.turn.tenant, self.spaces, id):
            return f"forgot {id}"
        raise _Refused("not_found", f"no memory {id!r} here")

    def _result(
        self, request: ToolCallRequest, content: str, code: str | None, message: str,
        started: float,
    ) -> ToolResult:  # fmt: skip
        return ToolResult(
            call_id=request.call_id,
            status="ok" if code is None else "error",
            content=content,
            error=None if code is None else WireError(code=code, message=message),
            server=MEMORY_SERVER,
            tool=request.tool,
            duration_ms=(time.monotonic() - started) * 1000,
            worker="memory",
            finished_at=time.time(),
        )


class _Refused(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def memory_id(call_id: str) -> str:
    """A save's memory id: the same for the same call."""
    return hashlib.sha256(call_id.encode()).hexdigest()[:20]


def _text(args: dict[str, Any], field: str) -> str:
    value = args.get(field)
    if not isinstance(value, str) or not value.strip():
        raise _Refused("invalid_arguments", f"`{field}` must be a non-empty string")
    return value


def _when(memory: Memory) -> str:
    return datetime.fromtimestamp(memory.created_at, UTC).strftime("%Y-%m-%d")


def _passage(memory: Memory) -> Passage:
    source = memory.source
    where = f", session {source.session}" if source is not None and source.session else ""
    origin = f"memory {memory.id}: {memory.kind} {memory.name}, {_when(memory)}{where}"
    return Passage(text=memory.text, source=origin)


def memory_specs(mode: str) -> Sequence[ToolSpec]:
    """The memory tools offered in ``mode``."""
    return SPECS if mode != "off" else ()
