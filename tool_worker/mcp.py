"""MCP servers as tool sources: stdio subprocesses or streamable HTTP endpoints.

Each configured server is one :class:`McpServer`. Its MCP session lives inside one
long-lived task (:meth:`McpServer.run`, owned by the worker's task group) because the
SDK's context managers hold anyio cancel scopes that must be entered and exited in the
same task; callers reach it through a queue of calls with futures. The task:

- starts the process (or connects), initializes, lists the tools (following
  ``next_cursor``) and registers them under the server's name, tool names mapped to
  subject tokens with :func:`schemas.safe_token` and back when calling;
- runs each queued call in its own child task, with the call's idempotency key in the
  request's ``_meta`` (``io.loopmesh/idempotency-key``, see :mod:`tool_worker.context`)
  so that a server can tell a re-run of a call from a new one; a caller that gives up (its timeout)
  cancels the call, which the SDK forwards as ``notifications/cancelled``;
- re-lists on ``notifications/tools/list_changed``;
- pings the server now and then; when the process dies, the connection drops or the
  HTTP server forgets the session, it reconnects (restarts) with exponential backoff.

``is_error`` results and JSON-RPC errors become :class:`~tool_worker.errors.McpToolError`
carrying the server's text. Each tool has a circuit breaker: after
``failure_threshold`` consecutive failures, calls fail fast with ``circuit_open`` for
``cooldown_s``, then one trial call decides whether it closes again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any, cast

import anyio
import msgspec
from mcp import types
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client
from mcp.shared.exceptions import MCPError

from loopmesh import tracing
from loopmesh.settings import AtLeastOne, Positive
from schemas import safe_token

from .context import META_KEY, current
from .errors import CircuitOpen, McpToolError, Unavailable
from .registry import Registry, Tool

log = logging.getLogger("tool_worker.mcp")

CLIENT_INFO = types.Implementation(name="loopmesh-tool-worker", version="0.1.0")


class McpServerSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One MCP server: ``command`` (stdio) or ``url`` (streamable HTTP)."""

    #: The server's name: its tools are ``<name>.<tool>`` in the catalog and on subjects.
    name: str
    #: The program to start, speaking MCP over stdio (give this or ``url``).
    command: str | None = None
    #: The program's arguments.
    args: tuple[str, ...] = ()
    #: Environment variables of the program (unset: the worker's own).
    env: dict[str, str] = {}
    #: The program's working directory (unset: the worker's).
    cwd: str | None = None
    #: A streamable HTTP MCP endpoint (give this or ``command``).
    url: str | None = None
    #: HTTP headers of every request to ``url`` (an ``Authorization``, say).
    headers: dict[str, str] = {}
    #: The tool pool whose workers run this server and serve its tools.
    pool: str = "default"
    #: Each of its tools' timeout: a call still running after it ends ``tool_timeout``.
    timeout_s: Positive = 30.0
    #: Every call of its tools waits for a person's approval first.
    needs_approval: bool = False
    #: Starting (or connecting), initializing and listing its tools must take less;
    #: else the session is restarted.
    start_timeout_s: Positive = 20.0
    #: A ping this often; a ping that fails restarts the session.
    ping_interval_s: Positive = 10.0
    #: Failures in a row of one tool that open its circuit breaker (calls then fail
    #: fast with ``circuit_open``).
    failure_threshold: AtLeastOne = 5
    #: An open breaker's wait before one trial call decides whether it closes.
    cooldown_s: Annotated[float, msgspec.Meta(ge=0)] = 30.0
    #: The first wait before a session that died is started again; it doubles each time.
    backoff_initial_s: Positive = 0.25
    #: The longest wait between restarts.
    backoff_max_s: Positive = 30.0

    def __post_init__(self) -> None:
        if (self.command is None) == (self.url is None):
            raise ValueError(f"MCP server {self.name!r}: give exactly one of `command` or `url`")

    @property
    def transport(self) -> str:
        return "stdio" if self.command else "http"


class CircuitBreaker:
    """Closed → (``threshold`` failures in a row) → open → (``cooldown_s``) → half-open,
    where one trial call closes it again or reopens it."""

    def __init__(self, threshold: int, cooldown_s: float) -> None:
        self.threshold = threshold
        self.cooldown_s = cooldown_s
        self.failures = 0
        self.opened_at: float | None = None
        self._trial = False

    @property
    def state(self) -> str:
        if self.opened_at is None:
            return "closed"
        return "open" if time.monotonic() - self.opened_at < self.cooldown_s else "half-open"

    def check(self, what: str) -> None:
        state = self.state
        if state == "closed":
            return
        if state == "half-open" and not self._trial:
            self._trial = True
            return
        assert self.opened_at is not None
        left = max(0.0, self.cooldown_s - (time.monotonic() - self.opened_at))
        raise CircuitOpen(what, self.failures, left)

    def success(self) -> None:
        self.failures, self.opened_at, self._trial = 0, None, False

    def failure(self) -> None:
        self.failures += 1
        if self._trial or self.failures >= self.threshold:
            self.opened_at = time.monotonic()
        self._trial = False


@dataclass(eq=False)
class _Call:
    name: str
    arguments: dict[str, Any]
    future: asyncio.Future[str]
    idempotency_key: str | None = None
    resent: bool = False
    trace: object | None = None  # the caller's trace context, for the request's `_meta`


_RELIST = object()
#: What a streamable HTTP server answers when it no longer knows the session.
_SESSION_GONE = frozenset({"Session terminated", "Session not found"})


class McpServer:
    """One MCP server, its session kept in :meth:`run`, its tools in ``registry``."""

    def __init__(self, settings: McpServerSettings, registry: Registry) -> None:
        self.settings = settings
        self.name = settings.name
        self.registry = registry
        self.listed = False
        self.connects = 0
        self._queue: asyncio.Queue[_Call | object] = asyncio.Queue()
        self._ready = asyncio.Event()
        self._closing = False
        self._wake = asyncio.Event()  # ends the current session: closing, or connection lost
        self._names: dict[str, str] = {}
        self._breakers: dict[str, CircuitBreaker] = {}

    # -- the caller's side ------------------------------------------------------------

    async def call(
        self, name: str, arguments: dict[str, Any], *, idempotency_key: str | None = None
    ) -> str:
        """Call the MCP tool ``name`` (its original name); raises ToolError subclasses.
        ``idempotency_key`` goes to the server in the request's ``_meta``."""
        breaker = self._breakers.get(name)
        if breaker is None:
            s = self.settings
            breaker = self._breakers[name] = CircuitBreaker(s.failure_threshold, s.cooldown_s)
        breaker.check(f"{self.name}.{name}")
        if self._closing:
            raise Unavailable(self.name, "the worker is stopping")
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(
            _Call(name, arguments, future, idempotency_key, trace=tracing.current())
        )
        try:
            text = await future
        except BaseException:
            breaker.failure()
            raise
        breaker.success()
        return text

    async def wait_ready(self, timeout: float) -> bool:
        try:
            async with asyncio.timeout(timeout):
                await self._ready.wait()
        except TimeoutError:
            return False
        return True

    def close(self) -> None:
        """Make :meth:`run` end its session and return. Idempotent."""
        self._closing = True
        self._wake.set()

    # -- the session's side -----------------------------------------------------------

    async def run(self) -> None:
        """Keep a session up until :meth:`close`; restart it with backoff when it dies."""
        delay = self.settings.backoff_initial_s
        try:
            while not self._closing:
                started = time.monotonic()
                try:
                    await self._session()
                except Exception as exc:
                    log.warning("MCP server %s: session failed: %s", self.name, _describe(exc))
                finally:
                    self._ready.clear()
                if self._closing:
                    break
                if time.monotonic() - started > 4 * delay:
                    delay = self.settings.backoff_initial_s  # it ran a while: a fresh failure
                log.info("MCP server %s: reconnecting in %.2fs", self.name, delay)
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await self._wake.wait()
                delay = min(delay * 2, self.settings.backoff_max_s)
        finally:
            self._fail_queued("the worker is stopping")

    async def _session(self) -> None:
        self._wake.clear()
        async with (
            self._connect() as (read, write),
            ClientSession(
                read, write, message_handler=self._on_message, client_info=CLIENT_INFO
            ) as session,
        ):
            with anyio.fail_after(self.settings.start_timeout_s):
                await session.initialize()
                await self._list(session)
            self.connects += 1
            self._ready.set()
            log.info("MCP server %s: connected (%d tools)", self.name, len(self._names))
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._serve, session, tg)
                tg.start_soon(self._ping, session)
                await self._wake.wait()
                tg.cancel_scope.cancel()

    @contextlib.asynccontextmanager
    async def _connect(self) -> AsyncIterator[Any]:
        s = self.settings
        if s.command is not None:
            params = StdioServerParameters(
                command=s.command, args=list(s.args), env=dict(s.env) or None, cwd=s.cwd
            )
            async with stdio_client(params) as streams:
                yield streams
        else:
            assert s.url is not None
            async with (
                create_mcp_http_client(headers=dict(s.headers) or None) as http,
                streamable_http_client(s.url, http_client=http) as streams,
            ):
                yield streams

    async def _list(self, session: ClientSession) -> None:
        listed: list[types.Tool] = []
        cursor: str | None = None
        while True:
            params = types.PaginatedRequestParams(cursor=cursor) if cursor else None
            page = await session.list_tools(params=params)
            listed.extend(page.tools)
            cursor = page.next_cursor
            if not cursor:
                break
        names, tools = {}, []
        for t in listed:
            token = safe_token(t.name)
            names[token] = t.name
            tools.append(self._tool(token, t))
        self._names = names
        self.registry.replace_server(self.name, tools)
        self.listed = True

    def _tool(self, token: str, t: types.Tool) -> Tool:
        original = t.name

        async def invoke(arguments: dict[str, Any]) -> str:
            context = current()
            key = context.idempotency_key if context is not None else None
            return await self.call(original, arguments, idempotency_key=key)

        title = t.title or (original if token != original else None)
        return Tool(
            server=self.name,
            name=token,
            invoke=invoke,
            description=t.description or "",
            input_schema=dict(t.input_schema or {"type": "object", "properties": {}}),
            timeout_s=self.settings.timeout_s,
            needs_approval=self.settings.needs_approval,
            title=title,
        )

    async def _serve(self, session: ClientSession, tg: anyio.abc.TaskGroup) -> None:
        while True:
            item = await self._queue.get()
            if self._wake.is_set():  # this session is ending: leave it to the next one
                self._queue.put_nowait(item)
                return
            if item is _RELIST:
                tg.start_soon(self._relist, session)
            elif isinstance(item, _Call) and not item.future.done():
                tg.start_soon(self._call, session, item)

    async def _call(self, session: ClientSession, call: _Call) -> None:
        future = call.future
        scope = anyio.CancelScope()

        def caller_gave_up(_: asyncio.Future[str]) -> None:
            scope.cancel()

        future.add_done_callback(caller_gave_up)
        requeued = False
        try:
            with scope:
                try:
                    meta = _meta(call.idempotency_key)
                    # The MCP SDK adds the current span's traceparent to the request's
                    # `_meta` (SEP-414): make the caller's the current one here.
                    with tracing.attached(call.trace):
                        result = await session.call_tool(call.name, call.arguments, meta=meta)
                except MCPError as exc:
                    if exc.message in _SESSION_GONE and not call.resent:
                        # The server rejected the session before running anything:
                        # send the call again on the next session.
                        call.resent = requeued = True
                        self._queue.put_nowait(call)
                        self._wake.set()
                    elif exc.code == types.CONNECTION_CLOSED or exc.message in _SESSION_GONE:
                        self._wake.set()
                        _fail(future, Unavailable(self.name, exc.message))
                    else:
                        _fail(future, McpToolError(f"{self.name}.{call.name}: {exc.message}"))
                    return
                except Exception as exc:
                    self._wake.set()
                    _fail(future, Unavailable(self.name, _describe(exc)))
                    return
                text = _text(result)
                if result.is_error:
                    message = text or f"{self.name}.{call.name} reported an error"
                    _fail(future, McpToolError(message))
                elif not future.done():
                    future.set_result(text)
        finally:
            future.remove_done_callback(caller_gave_up)
            if not requeued:
                _fail(future, Unavailable(self.name, "the connection was lost during the call"))

    async def _relist(self, session: ClientSession) -> None:
        try:
            with anyio.fail_after(self.settings.start_timeout_s):
                await self._list(session)
            log.info("MCP server %s: tools changed (%d tools)", self.name, len(self._names))
        except Exception as exc:
            log.warning("MCP server %s: re-listing failed: %s", self.name, _describe(exc))
            self._wake.set()

    async def _ping(self, session: ClientSession) -> None:
        while True:
            await anyio.sleep(self.settings.ping_interval_s)
            try:
                with anyio.fail_after(min(10.0, self.settings.ping_interval_s)):
                    await session.send_ping()
            except Exception as exc:
                log.warning("MCP server %s: ping failed: %s", self.name, _describe(exc))
                self._wake.set()
                return

    async def _on_message(self, message: Any) -> None:
        if isinstance(message, types.ToolListChangedNotification):
            self._queue.put_nowait(_RELIST)
        elif isinstance(message, Exception):
            log.debug("MCP server %s: transport error %r", self.name, message)

    def _fail_queued(self, reason: str) -> None:
        while not self._queue.empty():
            item = self._queue.get_nowait()
            if isinstance(item, _Call):
                _fail(item.future, Unavailable(self.name, reason))


def _meta(idempotency_key: str | None) -> types.RequestParamsMeta | None:
    """A ``tools/call`` request's ``_meta`` (an open map: our key beside the SDK's)."""
    if not idempotency_key:
        return None
    return cast(types.RequestParamsMeta, {META_KEY: idempotency_key})


def _fail(future: asyncio.Future[str], exc: Exception) -> None:
    if not future.done():
        future.set_exception(exc)


def _text(result: types.CallToolResult) -> str:
    """The result as text: text blocks joined; other blocks (and structured content
    when there is no text) as JSON."""
    parts = []
    for block in result.content:
        if isinstance(block, types.TextContent):
            parts.append(block.text)
        else:
            parts.append(block.model_dump_json(by_alias=True, exclude_none=True))
    if not parts and result.structured_content is not None:
        return msgspec.json.encode(result.structured_content).decode()
    return "\n".join(parts)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(_describe(e) for e in exc.exceptions)
    return f"{type(exc).__name__}: {exc}"
