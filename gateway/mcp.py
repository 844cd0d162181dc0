"""The named agents as MCP tools at ``/mcp`` (streamable HTTP, the ``mcp`` SDK's server).

Each agent in the agents bucket is a tool: its name, its definition's description, and
the arguments :class:`Arguments` (``input``; ``session`` to continue a conversation).
``tools/list`` reads the bucket on every call, so an agent defined a moment ago is
listed. A ``tools/call`` runs one turn of the agent, published to the turns stream as
``POST /v1/sessions/{session}/turns`` publishes one (:meth:`Gateway.start_turn`), and
follows it on the session's shared feed (:mod:`gateway.fanout`), joined before the turn
is published so that none of its events can be missed:

- each ``loop_iteration`` and ``tool_call`` (but those of the loop's own tools, which
  end the turn or plan it) is a ``notifications/progress`` for the client's progress
  token ("iteration 2 of 20", "calling local.calculator");
- its ``loop_end`` is the result: the answer as text, and :class:`Answer` as the
  structured result (with the session to continue); a turn that did not answer (a
  limit, an error, a cancel) is a result with ``isError`` and the reason;
- a client that cancels the call (a 2026-07-28 client closes the call's response
  stream; the SDK's client does so for its ``notifications/cancelled``), or drops the
  connection, cancels the turn: a ``cancel`` control for it, from whichever replica
  holds the call, reaching whichever loop worker runs it. A gateway that is shutting
  down leaves its turns running.

Stateless: no MCP session is kept between HTTP requests (the SDK's session manager with
``stateless=True``; the 2026-07-28 revision is stateless by design), so any gateway
replica behind a load balancer answers any request, and a replica that restarts loses
nothing but the calls it was holding. What lasts is loopmesh's own session, in NATS,
named by the ``session`` argument. A handshake-era client's ``notifications/cancelled``
arrives as a POST of its own, on a connection that knows nothing of the call (perhaps on
another replica), and is dropped; closing the call's connection cancels it.

Auth is the gateway's: the bearer API key, checked (and rate-limited) before the SDK
sees the request, refused with the HTTP status and a JSON-RPC error saying why; the
tenant comes from the key. An unknown tool is a JSON-RPC error
(``-32602``); bad arguments are tool results with ``isError`` naming the field (as the
MCP specification asks: a model can correct its call).
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import time
from collections import deque
from collections.abc import Mapping
from typing import Annotated, Any

import anyio
import msgspec
from mcp import types
from mcp.server import Server, ServerRequestContext
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.server.transport_security import TransportSecuritySettings
from mcp.shared.exceptions import MCPError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from schemas import BUILTIN_SERVER, DEFAULT_AGENT, AgentSpec, Cancel, Turn, is_token, new_id
from schemas.events import (
    ANSWERED,
    Event,
    LoopEnd,
    LoopIteration,
    ToolCallEvent,
    decode_event,
)
from schemas.ids import TOKEN_PATTERN

from . import api
from .auth import Principal
from .checks import check_id, field_of
from .core import Gateway
from .errors import GatewayError, RateLimited, Unavailable, Unprocessable
from .fanout import Item
from .openapi import Operation, Param

log = logging.getLogger("loopmesh.gateway.mcp")

ROUTE = "/mcp"
MCP_ACCEPT = Param(
    "Accept", "header", "what the answer may be: both are needed",
    {"type": "string", "enum": ["application/json, text/event-stream"]}, True,
)  # fmt: skip
MCP_VERSION = Param(
    "MCP-Protocol-Version", "header",
    "the protocol revision: 2026-07-28 (stateless requests), or, after an `initialize` "
    "handshake, the one it agreed", {"type": "string"},
)  # fmt: skip
#: Where the ASGI scope carries the caller, for the SDK's handlers.
PRINCIPAL = "loopmesh.principal"
_FOLLOWED = frozenset({"loop_iteration", "tool_call", "loop_end"})
_CANCEL_TIMEOUT_S = 5.0
INSTRUCTIONS = (
    "Each tool is a loopmesh agent. A call runs one turn of it and returns its answer; "
    "pass the `session` of a result to continue that conversation."
)


class Arguments(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a call of an agent takes."""

    input: Annotated[str, msgspec.Meta(description="What to ask the agent, in words.")]
    session: (
        Annotated[
            str,
            msgspec.Meta(
                pattern=TOKEN_PATTERN,
                description=(
                    "The conversation to continue: the `session` of an earlier call's "
                    "result (or a name of your own for a new one). Leave it out to "
                    "start a new conversation."
                ),
            ),
        ]
        | None
    ) = None


class Answer(msgspec.Struct, frozen=True, kw_only=True):
    """A call's structured result: the turn's end, and the session to continue."""

    answer: str
    session: str
    turn_id: str
    agent: str
    reason: str
    iterations: int = 0
    error: str | None = None


def _object_schema(struct: type) -> dict[str, Any]:
    (_,), components = msgspec.json.schema_components([struct])
    return dict(components[struct.__name__])


INPUT_SCHEMA = _object_schema(Arguments)
OUTPUT_SCHEMA = _object_schema(Answer)


class McpEndpoint:
    """``/mcp``: an ASGI app (auth, then the SDK's session manager) and the manager's
    lifetime, as an async context manager::

        async with McpEndpoint(gateway) as mcp:  # before the HTTP server serves
            ...
    """

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        settings = gateway.settings
        self.server: Server[Any] = Server(
            "loopmesh",
            version=importlib.metadata.version("loopmesh"),
            instructions=INSTRUCTIONS,
            on_list_tools=self.list_tools,
            on_call_tool=self.call_tool,
            get_tool_input_schema=lambda name: INPUT_SCHEMA,  # the same for every agent
        )
        self.manager = StreamableHTTPSessionManager(
            app=self.server,
            stateless=True,
            security_settings=_security(settings.no_auth, settings.no_auth_any_host),
            max_request_body_size=settings.max_body_bytes,
        )
        self.closing = False  # set as the gateway stops: its calls end, their turns do not
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    # -- lifetime ---------------------------------------------------------------------

    async def __aenter__(self) -> McpEndpoint:
        # The manager's task group lives in a task of its own, so whichever task closes
        # the gateway, its cancel scope is left in the task that entered it.
        started = asyncio.Event()
        self._task = asyncio.create_task(self._run(started), name="gateway-mcp")
        waiter = asyncio.ensure_future(started.wait())
        try:
            await asyncio.wait({waiter, self._task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        if self._task.done():
            self._task.result()
            raise RuntimeError("the MCP session manager stopped while starting")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _run(self, started: asyncio.Event) -> None:
        async with self.manager.run():
            started.set()
            await self._stop.wait()

    async def close(self) -> None:
        self.closing = True
        self._stop.set()
        task, self._task = self._task, None
        if task is not None:
            await task

    # -- HTTP -------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            scope[PRINCIPAL] = self.gateway.principal(Request(scope))
        except GatewayError as exc:  # no key, an unknown one, over its rate
            await _http_refusal(exc)(scope, receive, send)
            return
        await self.manager.handle_request(scope, receive, send)

    # -- tools ------------------------------------------------------------------------

    async def list_tools(
        self, ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        _principal(ctx)
        agents = await self._unless_unavailable(self.gateway.backend.agents())
        return types.ListToolsResult(tools=[_tool(agent) for agent in agents])

    async def call_tool(
        self, ctx: ServerRequestContext[Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        who = _principal(ctx)
        slots = self.gateway.slots
        try:  # the call holds a feed until its turn ends: a slot of the key's
            slots.acquire(who.key)
        except RateLimited as exc:
            raise MCPError(
                code=types.INVALID_REQUEST, message=exc.message,
                data={"code": exc.code, "retry_after": exc.retry_after},
            ) from None  # fmt: skip
        try:
            return await self._call(ctx, who, params)
        finally:
            slots.release(who.key)

    async def _call(
        self, ctx: ServerRequestContext[Any], who: Principal, params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        request = ctx.request
        assert isinstance(request, Request)  # the HTTP transports always carry it
        agent = await self._agent(params.name)
        try:
            turn = await self._turn(who, agent, params.arguments or {})
        except GatewayError as exc:
            return _refused(exc)
        fanout = self.gateway.fanout
        feed = await self._unless_unavailable(fanout.acquire(turn.tenant, turn.session))
        follower = _Follower(turn.id, self.gateway.settings.stream_buffer)
        feed.join(follower)  # before the turn is published: none of its events is missed
        try:
            try:
                await self.gateway.start_turn(request, turn, ROUTE)
            except Unavailable as exc:  # the turn may have been published all the same
                await self._cancel(turn)
                return _refused(exc)
            except GatewayError as exc:
                return _refused(exc)
            return await self._follow(ctx, follower, turn)
        except BaseException:
            if not self.closing:
                with anyio.CancelScope(shield=True):
                    await self._cancel(turn)
            raise
        finally:
            feed.leave(follower)
            with anyio.CancelScope(shield=True):
                await fanout.release(feed)

    async def _agent(self, name: str) -> AgentSpec:
        """The agent a call names, or the JSON-RPC error of an unknown tool."""
        found = None
        if is_token(name):
            found = await self._unless_unavailable(self.gateway.backend.agent(name))
        if found is None:
            raise MCPError(
                code=types.INVALID_PARAMS,
                message=f"unknown tool {name[:80]!r}: no agent has that name (see tools/list)",
                data={"field": "name"},
            )
        return found

    async def _turn(self, who: Principal, agent: AgentSpec, arguments: Mapping[str, Any]) -> Turn:
        """The turn a call asks for, its arguments checked (:class:`Unprocessable`
        naming the field); a session that exists must be the agent's."""
        try:
            args = msgspec.convert(arguments, Arguments)
        except msgspec.ValidationError as exc:
            raise Unprocessable(f"invalid arguments: {exc}", field=field_of(str(exc))) from None
        if args.session is None:
            session = new_id()
        else:
            session = check_id(args.session, "session")
            existing = await self.gateway.backend.session(who.tenant, session)
            if existing is not None and existing.agent != agent.name:
                raise Unprocessable(
                    f"session {session!r} belongs to agent {existing.agent!r}: call that "
                    f"tool to continue it, or leave `session` out to start a new one",
                    field="session",
                )
        body = api.PostTurn(input=args.input, agent=agent.name)
        return self.gateway.turn(who, session, new_id(), body)

    async def _follow(
        self, ctx: ServerRequestContext[Any], follower: _Follower, turn: Turn
    ) -> types.CallToolResult:
        """Progress for each iteration and tool call, then the result of the turn's end."""
        limit = self.gateway.settings.mcp_timeout_s
        steps = 0
        with anyio.move_on_after(limit) as waited:
            while True:
                match await follower.next():
                    case LoopEnd() as end:
                        return _result(turn, end)
                    case LoopIteration(iteration=k, max_iterations=n):
                        message = f"iteration {k} of {n}" if n else f"iteration {k}"
                    case ToolCallEvent(server=server, tool=tool) if server != BUILTIN_SERVER:
                        message = f"calling {server}.{tool}" if server else f"calling {tool}"
                    case _:
                        continue
                steps += 1
                await ctx.session.report_progress(steps, None, message)
        assert waited.cancelled_caught
        text = (
            f"turn {turn.id} of session {turn.session} has not ended after {limit:g} s "
            f"([gateway] mcp_timeout_s); it goes on: GET /v1/sessions/{turn.session}/events"
            f"?turn={turn.id}&since=0 follows it"
        )
        answer = _answer(turn, reason="timeout", content="", error=text)
        return _error_result(text, answer)

    async def _cancel(self, turn: Turn) -> None:
        """The caller went away: cancel its turn, wherever it runs."""
        cancel = Cancel(
            tenant=turn.tenant, session=turn.session, turn_id=turn.id, at=time.time(),
            reason="the MCP client cancelled the call",
        )  # fmt: skip
        try:
            with anyio.fail_after(_CANCEL_TIMEOUT_S):
                await self.gateway.backend.send_control(cancel)
        except Exception as exc:  # its limits end it, then
            log.warning("turn of a cancelled MCP call not cancelled turn=%s error=%r", turn.id, exc)
        else:
            log.info("MCP call cancelled; turn cancelled turn=%s", turn.msg_id)

    @staticmethod
    async def _unless_unavailable(call: Any) -> Any:
        try:
            return await call
        except GatewayError as exc:  # NATS did not answer in time, a bucket missing
            raise MCPError(code=types.INTERNAL_ERROR, message=exc.message) from None


class _Follower:
    """A listener on the session's feed: one turn's iterations, tool calls and end."""

    def __init__(self, turn_id: str, size: int) -> None:
        self.turn_id = turn_id
        self.size = size  # progress beyond this many unsent steps is dropped, the end never
        self._steps: deque[Event] = deque()
        self._end: LoopEnd | None = None
        self._arrived = asyncio.Event()

    def offer(self, item: Item) -> bool:
        if item.turn_id != self.turn_id or item.event not in _FOLLOWED:
            return True
        try:
            event = decode_event(item.data)
        except Exception:  # not an event of this schema: nothing to follow
            return True
        if isinstance(event, LoopEnd):
            self._end = event
        elif len(self._steps) < self.size:
            self._steps.append(event)
        self._arrived.set()
        return True  # never full: the feed never drops it

    async def next(self) -> Event:
        while True:
            if self._steps:
                return self._steps.popleft()
            if self._end is not None:
                return self._end
            self._arrived.clear()
            await self._arrived.wait()


def _principal(ctx: ServerRequestContext[Any]) -> Principal:
    """The caller, as :meth:`McpEndpoint.__call__` found it (fail closed)."""
    request = ctx.request
    who = request.scope.get(PRINCIPAL) if isinstance(request, Request) else None
    if not isinstance(who, Principal):
        raise MCPError(code=types.INTERNAL_ERROR, message="request not authenticated")
    return who


def _tool(agent: AgentSpec) -> types.Tool:
    return types.Tool(
        name=agent.name,
        description=agent.description or f"The {agent.name} agent.",
        input_schema=INPUT_SCHEMA,
        output_schema=OUTPUT_SCHEMA,
    )


def _answer(turn: Turn, *, reason: str, content: str, iterations: int = 0,
            error: str | None = None) -> Answer:  # fmt: skip
    return Answer(
        answer=content, session=turn.session, turn_id=turn.id, agent=turn.agent or DEFAULT_AGENT,
        reason=reason, iterations=iterations, error=error,
    )  # fmt: skip


def _result(turn: Turn, end: LoopEnd) -> types.CallToolResult:
    answer = _answer(
        turn, reason=end.reason, content=end.content, iterations=end.iterations, error=end.error
    )
    if end.reason in ANSWERED:
        return types.CallToolResult(
            content=[types.TextContent(text=end.content)],
            structured_content=msgspec.to_builtins(answer),
        )
    why = end.error or end.content or "no detail"
    return _error_result(f"the turn ended with {end.reason}: {why}", answer)


def _error_result(text: str, answer: Answer | None = None) -> types.CallToolResult:
    return types.CallToolResult(
        content=[types.TextContent(text=text)],
        structured_content=msgspec.to_builtins(answer) if answer is not None else None,
        is_error=True,
    )


def _refused(exc: GatewayError) -> types.CallToolResult:
    """A call refused before its turn ran: what was wrong, naming the field."""
    text = f"{exc.code}: {exc.message}"
    return _error_result(text if exc.field is None else f"{text} (field `{exc.field}`)")


def _http_refusal(exc: GatewayError) -> Response:
    """A request refused before the SDK sees it: its HTTP status (401 with
    ``WWW-Authenticate: Bearer``, 429 with ``Retry-After``), and a JSON-RPC error body,
    which MCP clients read and show (the SDK's raises an ``MCPError`` with its message)."""
    error = types.ErrorData(
        code=types.INVALID_REQUEST, message=exc.message, data={"code": exc.code}
    )
    body = types.JSONRPCError(jsonrpc="2.0", id=None, error=error)
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else {}
    retry_after = getattr(exc, "retry_after", None)
    if retry_after is not None:
        headers["Retry-After"] = str(retry_after)
    data = body.model_dump(mode="json", by_alias=True, exclude_none=True)
    data["id"] = None  # JSON-RPC: an error for a request whose id was not read says null
    return JSONResponse(data, status_code=exc.status, headers=headers)


def _security(no_auth: bool, any_host: bool) -> TransportSecuritySettings | None:
    """Without keys, on loopback, a web page that rebinds a name of its own to 127.0.0.1
    must not reach the agents: the Host (and any Origin) must be a loopback one. With
    keys, the key is the guard; with ``no_auth_any_host``, open access was asked for."""
    if not no_auth or any_host:
        return None
    loopback = ("127.0.0.1", "localhost", "[::1]")
    return TransportSecuritySettings(
        enable_dns_rebinding_protection=True,
        allowed_hosts=[f"{host}:*" for host in loopback],
        allowed_origins=[f"http://{host}:*" for host in loopback],
    )


def operation(app: ASGIApp) -> tuple[Operation, ASGIApp]:
    """``/mcp`` served by ``app`` (an :class:`McpEndpoint`), with its OpenAPI entry."""
    return (
        Operation("POST", ROUTE, "MCP over streamable HTTP: the agents as tools "
                  "(docs/AGENTS.md)", 200, api.JsonRpcAnswer, api.JsonRpcMessage,
                  (MCP_ACCEPT, MCP_VERSION), (400, 401, 403, 404, 406, 413, 421, 429),
                  tags=("agents",), error_body=api.JsonRpcAnswer, streams=True),
        app,
    )  # fmt: skip
