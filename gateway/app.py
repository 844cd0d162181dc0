"""The gateway's HTTP application (Starlette): one handler per operation of the table
at the bottom, which also generates ``/openapi.json``."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    generate_latest,
)
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from loopmesh import tracing
from loopmesh.errors import InvalidWebhook
from loopmesh.usage import day_of
from loopmesh.webhook import WebhookSettings, check_webhook
from schemas import (
    DEFAULT_AGENT,
    AgentSpec,
    ApprovalDecision,
    Cancel,
    Pause,
    Resume,
    SessionSnapshot,
    Turn,
    new_id,
)

from . import api, docs, webview
from .a2a import A2A
from .auth import Keys, Principal, RateLimiter, StreamSlots
from .backend import Backend
from .checks import TOOL_NAME, check_id, check_length, check_sequence, field_of, read_body
from .errors import (
    BadRequest,
    Busy,
    Conflict,
    GatewayError,
    NotFound,
    Unprocessable,
)
from .fanout import Fanout
from .openapi import AGENT, CALL_ID, SESSION, Operation, Param, document
from .schedules import Schedules
from .settings import GatewaySettings, OnBusy
from .sse import Guarded, SseResponse
from .stream import EventStream
from .traces import TURNS_ROUTE, turn_span

log = logging.getLogger("loopmesh.gateway")

T = TypeVar("T")

_MAX_MODEL_CHARS = 200
VERSION = "1"  # of the HTTP API: /v1
_LATEST_SCAN_FACTOR = 50  # /v1/events/latest: up to limit x this many messages per stream
MAX_USAGE_DAYS = 31  # /v1/usage?days= at most (the bucket keeps 40)


class Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.sse_clients = Gauge(
            "loopmesh_gateway_sse_clients", "open SSE event streams", registry=registry
        )
        self.sse_cut = Counter(
            "loopmesh_gateway_sse_cut", "SSE clients cut for falling behind", registry=registry
        )
        self.turns = Counter("loopmesh_gateway_turns", "turns published", registry=registry)


class Gateway:
    """The handlers, with what they share: settings, the NATS backend, keys and limits."""

    def __init__(
        self,
        settings: GatewaySettings,
        backend: Backend,
        *,
        registry: CollectorRegistry | None = None,
        on_busy: OnBusy = "enqueue",
        webhooks: WebhookSettings | None = None,
    ) -> None:
        self.settings = settings
        self.on_busy = on_busy  # [loop] on_busy: a turn's default
        self.webhooks = webhooks or WebhookSettings()  # a turn's webhook URL is checked
        self.backend = backend
        self.keys = Keys(settings)
        self.limiter = RateLimiter(settings.rate_per_s, settings.rate_burst)
        self.slots = StreamSlots(settings.max_streams_per_key)
        self.fanout = Fanout(backend)
        self.metrics = Metrics(registry or CollectorRegistry())
        self.schedules = Schedules(self)
        self.a2a = A2A(backend, settings, self.principal, self.slots, self.metrics.turns.inc)

    # -- request plumbing ---------------------------------------------------------------

    def principal(self, request: Request) -> Principal:
        who = self.keys.principal(request.headers.get("authorization"))
        self.limiter.take(who.key)
        return who

    async def body(self, request: Request, type_: type[T]) -> T:
        data = await read_body(request, self.settings.max_body_bytes) or b"{}"
        try:
            return msgspec.json.decode(data, type=type_)
        except msgspec.ValidationError as exc:
            raise BadRequest(f"invalid body: {exc}", field=field_of(str(exc))) from None
        except msgspec.DecodeError as exc:
            raise BadRequest(f"body is not valid JSON: {exc}") from None

    async def existing(self, who: Principal, session: str) -> SessionSnapshot:
        snapshot = await self.backend.session(who.tenant, session)
        if snapshot is None:
            raise NotFound(f"no session {session!r}")
        return snapshot

    # -- sessions ---------------------------------------------------------------------

    async def create_session(self, request: Request) -> Response:
        who = self.principal(request)
        body = await self.body(request, api.CreateSession)
        session = check_id(body.session, "session") if body.session is not None else new_id()
        agent = await self.known_agent(body.agent)
        if not await self.backend.create_session(who.tenant, session, agent):
            raise Conflict(f"session {session!r} exists already", field="session")
        return _json(api.SessionCreated(tenant=who.tenant, session=session, agent=agent), 201)

    async def list_sessions(self, request: Request) -> Response:
        who = self.principal(request)
        found = await self.backend.sessions(who.tenant)
        return _json(
            api.SessionList(
                sessions=[
                    api.SessionSummary(
                        session=s.session,
                        status=s.status,
                        turns=s.turns,
                        updated_at=s.updated_at,
                        agent=s.agent,
                    )
                    for s in found
                ]
            )
        )

    async def get_session(self, request: Request) -> Response:
        who = self.principal(request)
        s = await self.existing(who, check_id(request.path_params["session"], "session"))
        return _json(
            api.SessionView(
                tenant=s.tenant, session=s.session, status=s.status, turn_id=s.turn_id,
                iteration=s.iteration, turns=s.turns, updated_at=s.updated_at,
                messages=list(s.messages), plan=list(s.plan), summary=s.summary,
                agent=s.agent,
            )
        )  # fmt: skip

    # -- turns ------------------------------------------------------------------------

    async def post_turn(self, request: Request) -> Response:
        who = self.principal(request)
        session = check_id(request.path_params["session"], "session")
        key = request.headers.get("idempotency-key")
        turn_id = check_id(key, "Idempotency-Key") if key is not None else new_id()
        body = await self.body(request, api.PostTurn)
        turn = self.turn(who, session, turn_id, body)
        last = await self.start_turn(request, turn)
        url = f"/v1/sessions/{session}/events?turn={turn_id}&since={last}"
        return _json(api.TurnPosted(turn_id=turn_id, session=session, events_url=url), 202)

    async def start_turn(self, request: Request, turn: Turn, route: str = TURNS_ROUTE) -> int:
        """Publish ``turn`` (built by :meth:`turn`): its agent checked, a busy session
        refused at once when the turn asks ``on_busy=reject``, its session created for
        its agent. Returns the sequence, in the session's events stream, after which its
        events come (0 for a retried turn, which may have run already). ``route``: what
        the request was, for its span."""
        tenant, session = turn.tenant, turn.session
        if turn.agent is not None:
            await self.known_agent(turn.agent)
        if turn.webhook is not None:
            try:
                await check_webhook(turn.webhook, self.webhooks)
            except InvalidWebhook as exc:
                raise Unprocessable(exc.message, field=exc.field) from None
        if (turn.on_busy or self.on_busy) == "reject":
            busy = await self.backend.unfinished(tenant, session)
            if busy:
                names = ", ".join(t.turn_id for t in busy)
                raise Busy(
                    f"session {session} is busy with turn {names}; this turn asked "
                    "on_busy=reject (enqueue waits, interrupt stops the running turn)"
                )
        await self.backend.create_session(tenant, session, turn.agent or DEFAULT_AGENT)
        _, last = await self.backend.events_bounds(tenant, session)
        with turn_span(request, turn, route):  # continues the caller's traceparent; off: a no-op
            # the turn's message carries the trace on (the caller's own while off)
            if await self.backend.publish_turn(turn, tracing.forward(request.headers)):
                return 0  # a retry: the turn may have run already; its events from the start
        self.metrics.turns.inc()
        return last

    def turn(self, who: Principal, session: str, turn_id: str, body: api.PostTurn) -> Turn:
        s = self.settings
        if not body.input.strip():
            raise Unprocessable("`input` must not be empty", field="input")
        check_length(body.input, s.max_input_chars, "input")
        if body.instructions is not None:
            check_length(body.instructions, s.max_instructions_chars, "instructions")
        for field, model in (
            ("model", body.model),
            ("planner_model", body.planner_model),
            ("executor_model", body.executor_model),
        ):
            if model is not None:
                check_length(model, _MAX_MODEL_CHARS, field)
                if not model.strip():
                    raise Unprocessable(f"`{field}` must not be empty", field=field)
                if field != "model" and model != "".join(model.split()):
                    raise Unprocessable(f"`{field}` must not contain spaces", field=field)
        if body.max_iterations is not None and not 1 <= body.max_iterations <= s.max_iterations:
            raise Unprocessable(
                f"`max_iterations` must be between 1 and {s.max_iterations}",
                field="max_iterations",
            )
        tools: tuple[str, ...] | None = None
        if body.tools is not None:
            if len(body.tools) > s.max_tools:
                raise Unprocessable(f"at most {s.max_tools} tools", field="tools")
            for i, name in enumerate(body.tools):
                if not TOOL_NAME.fullmatch(name):
                    raise Unprocessable(
                        f"tool name {name[:80]!r} is not `server.tool` or `tool` "
                        "(1-64 characters from A-Z a-z 0-9 _ - each)",
                        field=f"tools[{i}]",
                    )
            tools = tuple(body.tools)
        return Turn(
            id=turn_id, tenant=who.tenant, session=session, input=body.input,
            created_at=time.time(), instructions=body.instructions, model=body.model,
            max_iterations=body.max_iterations, tools=tools, mode=body.mode,
            planner_model=body.planner_model, executor_model=body.executor_model,
            context=tuple(body.context or ()), parts=tuple(body.parts or ()),
            on_busy=body.on_busy,
            agent=check_id(body.agent, "agent") if body.agent is not None else None,
            webhook=body.webhook.plain() if body.webhook is not None else None,
        )  # fmt: skip

    async def known_agent(self, name: str | None) -> str:
        """``name`` (``default`` when ``None``), checked: an id, and a defined agent."""
        if name is None or name == DEFAULT_AGENT:
            return DEFAULT_AGENT
        check_id(name, "agent")
        if await self.backend.agent(name) is None:
            raise Unprocessable(
                f"no agent {name!r} is defined (GET /v1/agents lists them)", field="agent"
            )
        return name

    # -- events -----------------------------------------------------------------------

    async def events(self, request: Request) -> Response:
        who = self.principal(request)
        session = check_id(request.path_params["session"], "session")
        turn = request.query_params.get("turn")
        if turn is not None:
            check_id(turn, "turn")
        after = check_sequence(request.query_params.get("since"), "since")
        resume = check_sequence(request.headers.get("last-event-id"), "Last-Event-ID")
        if resume is not None:
            after = resume  # a reconnect continues after what it last got
        await self.existing(who, session)
        self.slots.acquire(who.key)
        stream = EventStream(
            self.fanout, who.tenant, session, after=after, turn=turn,
            buffer=self.settings.stream_buffer,
        )  # fmt: skip
        try:
            await stream.__aenter__()
        except BaseException:
            self.slots.release(who.key)
            raise
        self.metrics.sse_clients.inc()

        async def cleanup() -> None:
            await stream.close()
            if stream.was_cut:
                self.metrics.sse_cut.inc()
            self.slots.release(who.key)
            self.metrics.sse_clients.dec()

        response = SseResponse(
            stream,
            keepalive_s=self.settings.keepalive_s,
            send_timeout_s=self.settings.send_timeout_s,
        )
        return Guarded(response, cleanup)  # type: ignore[return-value]

    async def latest_events(self, request: Request) -> Response:
        who = self.principal(request)
        limit = check_sequence(request.query_params.get("limit"), "limit")
        limit = 100 if limit is None else limit
        if not 1 <= limit <= self.settings.latest_max:
            raise Unprocessable(
                f"`limit` must be between 1 and {self.settings.latest_max}", field="limit"
            )
        found = await self.backend.latest_events(
            who.tenant, limit, scan=limit * _LATEST_SCAN_FACTOR
        )
        body = b"[" + b",".join(_with_seq(seq, data) for seq, data in found) + b"]"
        return Response(body, media_type="application/json")

    async def usage(self, request: Request) -> Response:
        who = self.principal(request)
        days = check_sequence(request.query_params.get("days"), "days")
        days = 7 if days is None else days
        if not 1 <= days <= MAX_USAGE_DAYS:
            raise Unprocessable(f"`days` must be between 1 and {MAX_USAGE_DAYS}", field="days")
        since = day_of(time.time() - (days - 1) * 86_400)
        found = [d for d in await self.backend.usage(who.tenant) if d.day >= since]
        views = [
            api.UsageDayView(
                day=d.day, tokens=d.tokens, cost=d.cost,
                lines=[api.UsageLineView(**msgspec.structs.asdict(line)) for line in d.lines],
            )
            for d in found
        ]  # fmt: skip
        return _json(
            api.Usage(
                tenant=who.tenant, days=views, tokens=sum(d.tokens for d in found),
                cost=sum(d.cost for d in found),
                calls=sum(line.calls for d in found for line in d.lines),
            )
        )  # fmt: skip

    # -- controls ---------------------------------------------------------------------

    async def control(self, request: Request) -> Response:
        who = self.principal(request)
        session = check_id(request.path_params["session"], "session")
        body = await self.body(request, api.ControlRequest)
        reason = body.reason or ""
        check_length(reason, self.settings.max_reason_chars, "reason")
        await self.existing(who, session)
        kind = request.url.path.rsplit("/", 1)[1]
        now = time.time()
        match kind:
            case "cancel":
                control: Any = Cancel(tenant=who.tenant, session=session, at=now, reason=reason)
            case "pause":
                control = Pause(tenant=who.tenant, session=session, at=now)
            case _:
                control = Resume(tenant=who.tenant, session=session, at=now)
        await self.backend.send_control(control)
        return _json(api.ControlAccepted(type=kind, session=session), 202)

    async def approval(self, request: Request) -> Response:
        who = self.principal(request)
        session = check_id(request.path_params["session"], "session")
        call_id = check_id(request.path_params["call_id"], "call_id")
        body = await self.body(request, api.ApprovalRequest)
        reason = body.reason or ""
        check_length(reason, self.settings.max_reason_chars, "reason")
        await self.existing(who, session)
        decision = ApprovalDecision(
            tenant=who.tenant, session=session, call_id=call_id, approved=body.approve,
            reason=reason, at=time.time(),
        )  # fmt: skip
        await self.backend.send_control(decision)
        kind = "approve" if body.approve else "deny"
        return _json(api.ControlAccepted(type=kind, session=session, call_id=call_id), 202)

    # -- catalog, agents and health ------------------------------------------------------

    async def tools(self, request: Request) -> Response:
        self.principal(request)
        return _json(api.ToolList(tools=await self.backend.tools()))

    async def agents(self, request: Request) -> Response:
        self.principal(request)
        return _json(api.AgentList(agents=[_shown(a) for a in await self.backend.agents()]))

    async def agent(self, request: Request) -> Response:
        self.principal(request)
        name = check_id(request.path_params["agent"], "agent")
        agent = await self.backend.agent(name)
        if agent is None:
            raise NotFound(f"no agent {name!r} (GET /v1/agents lists them)")
        return _json(_shown(agent))

    async def healthz(self, request: Request) -> Response:
        return _json(api.Health(status="ok"))

    async def readyz(self, request: Request) -> Response:
        problem = await self.backend.ready()
        if problem is not None:
            return _json(api.Health(status="unavailable", detail=problem), 503)
        return _json(api.Health(status="ready"))

    async def prometheus(self, request: Request) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def openapi(self, request: Request) -> Response:
        return Response(self.openapi_json, media_type="application/json")

    async def docs_page(self, request: Request) -> Response:
        return HTMLResponse(docs.page("/openapi.json", "/docs/assets"))

    openapi_json: bytes = b""

    def operations(self, mcp: ASGIApp | None = None) -> list[tuple[Operation, Any]]:
        """The operations and their handlers; ``mcp``: the ASGI app of ``/mcp``, if served."""
        since = Param("since", "query", "stream events after this sequence (history)", _INT)
        turn = Param("turn", "query", "only this turn's events", _TOKEN)
        last_id = Param("Last-Event-ID", "header", "resume after this sequence", _INT_TEXT)
        idem = Param("Idempotency-Key", "header", "becomes the turn id", _TOKEN)
        limit = Param("limit", "query", "how many events (default 100)", _INT)
        days = Param("days", "query", f"days back, today included (default 7, at most "
                     f"{MAX_USAGE_DAYS})", _INT)  # fmt: skip
        control_ops = [
            (
                Operation(
                    "POST",
                    f"/v1/sessions/{{session}}/{kind}",
                    f"{kind} the session's turn",
                    202,
                    api.ControlAccepted,
                    api.ControlRequest,
                    (SESSION,),
                    (400, 401, 404, 413, 422, 429, 503),
                ),
                self.control,
            )
            for kind in ("cancel", "pause", "resume")
        ]
        mcp_ops = [
            (Operation("POST", "/mcp", "MCP over streamable HTTP: the agents as tools "
                       "(docs/AGENTS.md)", 200, api.JsonRpcAnswer, api.JsonRpcMessage,
                       (MCP_ACCEPT, MCP_VERSION), (400, 401, 403, 404, 406, 413, 421, 429),
                       tags=("agents",), error_body=api.JsonRpcAnswer, streams=True), mcp)
        ] if mcp is not None else []  # fmt: skip
        return [
            (Operation("POST", "/v1/sessions", "create a session", 201, api.SessionCreated,
                       api.CreateSession, errors=(400, 401, 409, 413, 422, 429, 503)),
             self.create_session),
            (Operation("GET", "/v1/sessions", "list the tenant's sessions", 200, api.SessionList,
                       errors=(401, 429, 503)), self.list_sessions),
            (Operation("GET", "/v1/sessions/{session}", "read a session", 200, api.SessionView,
                       params=(SESSION,), errors=(401, 404, 422, 429, 503)), self.get_session),
            (Operation("POST", "/v1/sessions/{session}/turns", "post a turn", 202, api.TurnPosted,
                       api.PostTurn, (SESSION, idem), (400, 401, 409, 413, 422, 429, 503)),
             self.post_turn),
            (Operation("GET", "/v1/sessions/{session}/events", "stream the session's events (SSE)",
                       200, None, params=(SESSION, turn, since, last_id),
                       errors=(401, 404, 422, 429, 503), media="text/event-stream"), self.events),
            *control_ops,
            (Operation("POST", "/v1/sessions/{session}/approvals/{call_id}",
                       "approve or deny a pending tool call", 202, api.ControlAccepted,
                       api.ApprovalRequest, (SESSION, CALL_ID),
                       (400, 401, 404, 413, 422, 429, 503)), self.approval),
            (Operation("GET", "/v1/tools", "the tool catalog", 200, api.ToolList,
                       errors=(401, 429, 503), tags=("tools",)), self.tools),
            (Operation("GET", "/v1/agents", "the named agents", 200, api.AgentList,
                       errors=(401, 429, 503), tags=("agents",)), self.agents),
            (Operation("GET", "/v1/agents/{agent}", "read a named agent", 200, AgentSpec,
                       params=(AGENT,), errors=(401, 404, 422, 429, 503), tags=("agents",)),
             self.agent),
            (Operation("GET", "/v1/events/latest", "the tenant's latest events, with `seq`", 200,
                       api.LatestEvents, params=(limit,), errors=(401, 422, 429, 503),
                       tags=("events",)), self.latest_events),
            (Operation("GET", "/v1/usage", "the tenant's LLM usage per day, agent and model",
                       200, api.Usage, params=(days,), errors=(401, 422, 429, 503),
                       tags=("usage",)), self.usage),
            *self.schedules.operations(),
            *mcp_ops,
            (Operation("GET", "/.well-known/agent-card.json", "the default agent's A2A card",
                       200, api.A2AAgentCard, errors=(503,), public=True, tags=("a2a",)),
             self.a2a.card),
            (Operation("GET", "/a2a/{agent}/.well-known/agent-card.json", "an agent's A2A card",
                       200, api.A2AAgentCard, params=(AGENT,), errors=(404, 422, 503),
                       public=True, tags=("a2a",)), self.a2a.card),
            (Operation("POST", "/a2a/{agent}", "A2A JSON-RPC: send, stream, tasks, push configs",
                       200, api.JsonRpcResponse, api.JsonRpcRequest, params=(AGENT,),
                       errors=(401, 404, 413, 422, 429, 503), tags=("a2a",)), self.a2a.rpc),
            (Operation("GET", "/healthz", "alive", 200, api.Health, errors=(), public=True,
                       tags=("health",)), self.healthz),
            (Operation("GET", "/readyz", "NATS connected and streams present", 200, api.Health,
                       errors=(503,), public=True, tags=("health",)), self.readyz),
        ]  # fmt: skip


MCP_ACCEPT = Param(
    "Accept", "header", "what the answer may be: both are needed",
    {"type": "string", "enum": ["application/json, text/event-stream"]}, True,
)  # fmt: skip
MCP_VERSION = Param(
    "MCP-Protocol-Version", "header",
    "the protocol revision: 2026-07-28 (stateless requests), or, after an `initialize` "
    "handshake, the one it agreed", {"type": "string"},
)  # fmt: skip
_INT = {"type": "integer", "minimum": 0}
_INT_TEXT = {"type": "string", "pattern": r"^[0-9]{1,19}$"}
_TOKEN = {"type": "string", "pattern": api.PATH_ID_PATTERN}


def create_app(gateway: Gateway, mcp: ASGIApp | None = None) -> Starlette:
    """The app of ``gateway``'s operations, with ``mcp`` (:class:`gateway.mcp.McpEndpoint`)
    served at ``/mcp`` when given."""
    ops = gateway.operations(mcp)
    gateway.openapi_json = msgspec.json.encode(
        document([op for op, _ in ops], title="loopmesh gateway", version=VERSION)
    )
    routes: list[Any] = [Route(op.path, handler, methods=[op.method]) for op, handler in ops]
    routes += [
        Route("/metrics", gateway.prometheus, methods=["GET"]),
        Route("/openapi.json", gateway.openapi, methods=["GET"]),
        Route("/docs", gateway.docs_page, methods=["GET"]),
        Mount("/docs/assets", app=StaticFiles(directory=docs.assets_dir()), name="docs-assets"),
        *webview.routes(),
    ]
    app = Starlette(
        routes=routes,
        exception_handlers={
            GatewayError: _gateway_error,
            HTTPException: _http_error,
            Exception: _crash,
        },
    )
    return app


# -- helpers ------------------------------------------------------------------------------


class _Guarded:
    """A response whose clean-up runs however it ends (finished, cut, disconnected)."""

    def __init__(self, response: ASGIApp, cleanup: Callable[[], Awaitable[None]]) -> None:
        self.response = response
        self.cleanup = cleanup

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.response(scope, receive, send)
        finally:
            await self.cleanup()


_json = api.json_response


def _error(exc: GatewayError) -> Response:
    body = api.ErrorBody(error=api.ErrorDetail(code=exc.code, message=exc.message, field=exc.field))
    response = _json(body, exc.status)
    retry_after = getattr(exc, "retry_after", None)
    if retry_after is not None:
        response.headers["Retry-After"] = str(retry_after)
    if exc.status == 401:
        response.headers["WWW-Authenticate"] = "Bearer"
    return response


async def _gateway_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, GatewayError)
    return _error(exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        return _error(NotFound(f"no route {request.url.path}"))
    error = GatewayError(str(exc.detail))
    error.status, error.code = exc.status_code, "http_error"
    response = _error(error)
    response.headers.update(exc.headers or {})  # a 405's Allow
    return response


async def _crash(request: Request, exc: Exception) -> Response:
    log.exception("gateway error path=%s", request.url.path)
    return _error(GatewayError("internal error; see the gateway's log"))


def _with_seq(seq: int, data: bytes) -> bytes:
    """An event's JSON with ``"seq"`` first."""
    body = data.strip()
    if not body.startswith(b"{"):
        return b'{"seq":%d}' % seq
    rest = body[1:].lstrip()
    sep = b"" if rest.startswith(b"}") else b","
    return b'{"seq":%d%s%s' % (seq, sep, rest)


def _shown(agent: AgentSpec) -> AgentSpec:
    """An agent as tenants see it: without its webhook (the operator's URL)."""
    return agent if agent.webhook is None else msgspec.structs.replace(agent, webhook=None)
