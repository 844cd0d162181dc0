"""In-process implementations of the engine's Protocols: events, sessions, tools.

They let the engine run in one process (tests, benchmarks, embedding as a library)::

    tools = LocalTools()

    @tools.tool(description="Add two numbers")
    def add(a: int, b: int) -> int:
        return a + b

    engine = Engine(settings=LoopSettings(), llm=llm, tools=tools,
                    events=InMemoryEvents(), store=InMemoryStore())
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, get_type_hints

import msgspec

from schemas import SessionSnapshot, ToolCallRequest, ToolResult, ToolSpec, Turn, WireError
from schemas.events import Event, LoopEnd

from .control import TurnControl
from .errors import StaleSessionError
from .protocols import Relay

E = TypeVar("E", bound=Event)
F = TypeVar("F", bound=Callable[..., Any])


class InMemoryEvents:
    """Keeps every event in order; tests wait on them with a deadline."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self._changed = asyncio.Condition()

    async def emit(self, event: Event) -> None:
        async with self._changed:
            self.events.append(event)
            self._changed.notify_all()

    @property
    def types(self) -> list[str]:
        return [e.type for e in self.events]

    def of(self, cls: type[E]) -> list[E]:
        return [e for e in self.events if isinstance(e, cls)]

    async def wait_for(
        self, type_: str, timeout: float = 5.0, *, where: Callable[[Event], bool] | None = None
    ) -> Event:
        """The first event of ``type_`` (already emitted or to come) that matches
        ``where``; raises ``TimeoutError`` after ``timeout`` seconds."""

        def found() -> Event | None:
            for e in self.events:
                if e.type == type_ and (where is None or where(e)):
                    return e
            return None

        async with asyncio.timeout(timeout), self._changed:
            await self._changed.wait_for(lambda: found() is not None)
        event = found()
        assert event is not None
        return event


class InMemoryStore:
    """Session snapshots in a dict, revision-checked like a KV bucket.

    Each handle remembers the revision it last loaded or saved per session; a save
    over a revision it has not seen raises :class:`StaleSessionError`. :meth:`fork`
    gives another handle on the same data (a second worker).
    """

    def __init__(self, _data: dict[str, tuple[int, SessionSnapshot]] | None = None) -> None:
        self._data = {} if _data is None else _data
        self._seen: dict[str, int] = {}
        self.saves = 0

    def fork(self) -> InMemoryStore:
        return InMemoryStore(self._data)

    async def load(self, tenant: str, session: str) -> SessionSnapshot | None:
        key = f"{tenant}.{session}"
        entry = self._data.get(key)
        if entry is None:
            self._seen.pop(key, None)
            return None
        self._seen[key] = entry[0]
        return entry[1]

    async def save(self, snapshot: SessionSnapshot) -> None:
        key = f"{snapshot.tenant}.{snapshot.session}"
        current = self._data.get(key)
        current_rev = current[0] if current else 0
        if current_rev != self._seen.get(key, 0):
            raise StaleSessionError(key)
        self._data[key] = (current_rev + 1, snapshot)
        self._seen[key] = current_rev + 1
        self.saves += 1

    def get(self, tenant: str, session: str) -> SessionSnapshot | None:
        entry = self._data.get(f"{tenant}.{session}")
        return entry[1] if entry else None


_JSON_TYPES: dict[Any, str] = {
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    list: "array",
    dict: "object",
}


def schema_of(fn: Callable[..., Any]) -> dict[str, Any]:
    """A JSON Schema for ``fn``'s keyword arguments, from its annotations."""
    hints = get_type_hints(fn)
    props: dict[str, Any] = {}
    required = []
    for name, param in inspect.signature(fn).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        kind = _JSON_TYPES.get(hints.get(name))
        props[name] = {"type": kind} if kind else {}
        if param.default is param.empty:
            required.append(name)
    return {"type": "object", "properties": props, "required": required}


class LocalTools:
    """A ToolDispatcher over Python callables (sync ones run in a thread).

    A call's result is recorded by call id: the same id again returns the recorded
    result without running the tool (what the tool-effects bucket does on NATS).
    ``runs`` lists the requests that actually ran.
    """

    def __init__(self) -> None:
        self._fns: dict[tuple[str, str], tuple[ToolSpec, Callable[..., Any]]] = {}
        self._done: dict[str, asyncio.Future[ToolResult]] = {}
        self.runs: list[ToolCallRequest] = []

    def add(
        self,
        fn: Callable[..., Any],
        *,
        server: str = "local",
        name: str | None = None,
        description: str | None = None,
        input_schema: dict[str, Any] | None = None,
        timeout_s: float = 30.0,
        needs_approval: bool = False,
    ) -> ToolSpec:
        spec = ToolSpec(
            server=server,
            name=name or fn.__name__,
            description=description if description is not None else inspect.getdoc(fn) or "",
            input_schema=input_schema if input_schema is not None else schema_of(fn),
            timeout_s=timeout_s,
            needs_approval=needs_approval,
        )
        self._fns[(spec.server, spec.name)] = (spec, fn)
        return spec

    def tool(self, **options: Any) -> Callable[[F], F]:
        """Decorator form of :meth:`add`."""

        def register(fn: F) -> F:
            self.add(fn, **options)
            return fn

        return register

    async def tools(self) -> Sequence[ToolSpec]:
        return [spec for spec, _ in self._fns.values()]

    async def call(self, request: ToolCallRequest) -> ToolResult:
        recorded = self._done.get(request.call_id)
        if recorded is not None:
            return await asyncio.shield(recorded)
        future: asyncio.Future[ToolResult] = asyncio.get_running_loop().create_future()
        self._done[request.call_id] = future
        try:
            result = await self._run(request)
        except BaseException:  # cancelled: forget it, so a retry runs the tool
            del self._done[request.call_id]
            future.cancel()
            raise
        future.set_result(result)
        return result

    async def _run(self, request: ToolCallRequest) -> ToolResult:
        entry = self._fns.get((request.server, request.tool))
        started = time.perf_counter()

        def done(
            status: Any = "ok", content: str = "", error: WireError | None = None
        ) -> ToolResult:
            return ToolResult(
                call_id=request.call_id,
                status=status,
                content=content,
                error=error,
                server=request.server,
                tool=request.tool,
                duration_ms=(time.perf_counter() - started) * 1000,
                worker="local",
                finished_at=time.time(),
            )

        if entry is None:
            msg = f"no tool {request.tool!r} on server {request.server!r}"
            return done("error", error=WireError(code="unknown_tool", message=msg))
        spec, fn = entry
        try:
            inspect.signature(fn).bind(**request.arguments)
        except TypeError as exc:
            return done("error", error=WireError(code="invalid_arguments", message=str(exc)))
        self.runs.append(request)
        timeout = request.timeout_s or spec.timeout_s
        try:
            async with asyncio.timeout(timeout):
                if inspect.iscoroutinefunction(fn):
                    value = await fn(**request.arguments)
                else:
                    value = await asyncio.to_thread(fn, **request.arguments)
        except TimeoutError:
            msg = f"{spec.server}.{spec.name} did not finish within {timeout:g} s"
            return done("timeout", error=WireError(code="timeout", message=msg))
        except Exception as exc:
            msg = f"{type(exc).__name__}: {exc}"
            return done("error", error=WireError(code="tool_exception", message=msg))
        if isinstance(value, str):
            return done(content=value)
        try:
            return done(content=msgspec.json.encode(value).decode())
        except (TypeError, msgspec.EncodeError):
            return done(content=str(value))


class LocalAgentCalls:
    """:class:`~.protocols.AgentCalls` in one process: a called agent's turn runs on
    ``engine`` (set after the engine is made: ``calls.engine = engine``), in the calling
    task. A child asked for again after it ended answers with its stored end, as the
    durable service does; approval requests are not relayed (the caller's person sees
    them in the child's session)."""

    def __init__(self) -> None:
        self.engine: Any = None
        self.children: list[Turn] = []

    async def call(self, child: Turn, *, timeout_s: float, relay: Relay) -> LoopEnd:
        from .run import ended_again
        from .scope import TurnScope

        stored = await self.engine.store.load(child.tenant, child.session)
        if stored is not None and stored.turn_id == child.id and stored.status == "idle":
            scope = TurnScope(child, TurnControl(), self.engine.events, time.time)
            end = await ended_again(scope, stored.last_end)
            if end is not None:
                return end
        self.children.append(child)
        async with asyncio.timeout(timeout_s):
            end = await self.engine.run(child)
        assert end is not None
        return end

    async def cancel(self, child: Turn, reason: str) -> None:
        return None  # the child ran in the caller's task, and was cancelled with it
