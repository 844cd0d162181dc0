"""The engine's view of the world: four small Protocols.

The agent loop engine (``engine.py``) is pure: it reaches the LLM, the tools, the event
stream and the session store only through these (and the named agents' definitions
through :class:`Agents`, the agents a turn calls through :class:`AgentCalls`).
``inmemory.py`` implements the last three for one process (tests, benchmarks, embedding
as a library); the durable service implements them over NATS; ``llm.py`` implements
:class:`LLM` with the ``openai`` client.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import msgspec

from schemas import (
    AgentSpec,
    ChatMessage,
    SessionSnapshot,
    ToolCall,
    ToolCallRequest,
    ToolResult,
    ToolSpec,
    Turn,
)
from schemas.events import Event, LoopEnd, Usage
from schemas.memory import Memory


class Completion(msgspec.Struct, frozen=True, kw_only=True):
    """One finished LLM response: all text, all tool calls (assembled), usage."""

    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    finish_reason: str | None = None
    usage: Usage | None = None
    model: str = ""
    latency_ms: float = 0.0


#: Called with each text fragment as it streams in (raw: thinking tags included).
OnDelta = Callable[[str], Awaitable[None]]
#: Called before each retry: (attempt, reason, delay_s, model).
OnRetry = Callable[[int, str, float, str], Awaitable[None]]


class LLM(Protocol):
    async def complete(
        self,
        messages: Sequence[ChatMessage],
        *,
        tools: Sequence[dict[str, Any]] = (),
        model: str | None = None,
        on_delta: OnDelta | None = None,
        on_retry: OnRetry | None = None,
    ) -> Completion:
        """Stream one response. Retries and falls back internally; raises
        ``loop_worker.engine.errors.LLMError`` when every attempt of every model failed.
        Cancelling the awaiting task closes the stream."""
        ...


class ToolSelector(Protocol):
    """Narrows the tools offered for one piece of work (an orchestrator step): returns
    those of ``tools`` that suit ``text``. The default offers them all; a pre-filter
    (embedding similarity, say) plugs in here. Tools it returns that were not among
    ``tools`` are ignored."""

    async def __call__(self, text: str, tools: Sequence[ToolSpec]) -> Sequence[ToolSpec]: ...


async def all_tools(text: str, tools: Sequence[ToolSpec]) -> Sequence[ToolSpec]:
    """The default :class:`ToolSelector`: every tool."""
    return tools


class ToolDispatcher(Protocol):
    async def tools(self) -> Sequence[ToolSpec]:
        """The tools the model may call (local and MCP, from every pool)."""
        ...

    async def call(self, request: ToolCallRequest) -> ToolResult:
        """Run one call and return its result. Tool failures are results with
        ``status`` ``error`` or ``timeout``, never exceptions."""
        ...


class EventSink(Protocol):
    async def emit(self, event: Event) -> None: ...


#: Called with each event a called agent's turn announces to its caller (its approval
#: requests), to emit in the calling turn's session.
Relay = Callable[[Event], Awaitable[None]]


class AgentCalls(Protocol):
    async def call(self, child: Turn, *, timeout_s: float, relay: Relay) -> LoopEnd:
        """Run ``child`` (an agent called as a tool: its id and session come from the
        call's id) and return its ``loop_end``. Asked again with the same child (the
        caller resumed after a crash), it never starts a second: it waits for the first,
        or returns its stored end. Raises ``TimeoutError`` after ``timeout_s``."""
        ...

    async def cancel(self, child: Turn, reason: str) -> None:
        """Cancel ``child`` (its caller was cancelled), whether it runs or waits."""
        ...


class Memories(Protocol):
    """A tenant's memories across sessions (``[loop.memory]``), by namespace: ``(kind,
    name)``, ``("user", <Turn.user>)`` or ``("agent", <name>)``."""

    async def save(self, memory: Memory) -> Memory:
        """Store ``memory`` (embedded here); saving the same id again replaces it. Raises
        ``ValueError`` when the namespace is full."""
        ...

    async def search(
        self, tenant: str, spaces: Sequence[tuple[str, str]], query: str, k: int
    ) -> list[tuple[float, Memory]]:
        """The ``k`` memories of ``spaces`` nearest ``query`` (cosine similarity), nearest
        first."""
        ...

    async def forget(self, tenant: str, spaces: Sequence[tuple[str, str]], id: str) -> bool:
        """Erase memory ``id`` from whichever of ``spaces`` holds it; whether one did."""
        ...


class Agents(Protocol):
    async def agent(self, name: str) -> AgentSpec | None:
        """The named agent's definition, as it stands now (``None``: no such agent).
        May raise when the definitions cannot be known yet (the durable service's
        watch has not loaded); the turn then ends with an ``error`` event."""
        ...


class SessionStore(Protocol):
    async def load(self, tenant: str, session: str) -> SessionSnapshot | None: ...

    async def save(self, snapshot: SessionSnapshot) -> None:
        """Store a checkpoint. Implementations check revisions: a save that would
        overwrite a newer snapshot raises ``loop_worker.engine.errors.StaleSessionError``."""
        ...
