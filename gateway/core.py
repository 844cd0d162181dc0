"""What every handler of the gateway shares (:class:`Gateway`): its settings, the NATS
backend, the keys and limits, the shared event feed, the metrics, and the request
plumbing (who calls, the body, the session) with the one way a turn is built and
published, which the turns route, ``/mcp`` and A2A use alike.

The handlers themselves live by resource in :mod:`gateway.routes`; :mod:`gateway.app`
assembles them into the application."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge
from starlette.requests import Request
from starlette.responses import Response

from loopmesh import tracing
from loopmesh.errors import InvalidWebhook
from loopmesh.settings import Tenants, TenantSettings
from loopmesh.webhook import WebhookSettings, check_webhook
from schemas import DEFAULT_AGENT, SessionSnapshot, Turn
from schemas.events import TurnQueued

from . import api
from .a2a import A2A
from .auth import Keys, Principal, RateLimiter, StreamSlots
from .backend import Backend
from .checks import TOOL_NAME, check_id, check_length, field_of, read_body
from .errors import BacklogFull, BadRequest, Busy, NotFound, Unprocessable
from .fanout import Fanout
from .settings import GatewaySettings, OnBusy
from .traces import TURNS_ROUTE, turn_span

T = TypeVar("T")

#: A route's handler.
Handler = Callable[[Request], Awaitable[Response]]

_MAX_MODEL_CHARS = 200


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
    """What the handlers share: settings, the NATS backend, keys and limits."""

    def __init__(
        self,
        settings: GatewaySettings,
        backend: Backend,
        *,
        registry: CollectorRegistry | None = None,
        on_busy: OnBusy = "enqueue",
        webhooks: WebhookSettings | None = None,
        tenants: Tenants | None = None,
    ) -> None:
        self.settings = settings
        self.on_busy = on_busy  # [loop] on_busy: a turn's default
        self.webhooks = webhooks or WebhookSettings()  # a turn's webhook URL is checked
        self.tenants = tenants or {}  # [tenants]: max_backlog, min_schedule_interval_s
        self.backend = backend
        self.keys = Keys(settings)
        self.limiter = RateLimiter(settings.rate_per_s, settings.rate_burst)
        self.slots = StreamSlots(settings.max_streams_per_key)
        self.fanout = Fanout(backend)
        self.metrics = Metrics(registry or CollectorRegistry())
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

    # -- turns --------------------------------------------------------------------------

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
        ahead = await self._room_in_backlog(tenant)
        await self.backend.create_session(tenant, session, turn.agent or DEFAULT_AGENT)
        _, last = await self.backend.events_bounds(tenant, session)
        with turn_span(request, turn, route):  # continues the caller's traceparent; off: a no-op
            # the turn's message carries the trace on (the caller's own while off)
            if await self.backend.publish_turn(turn, tracing.forward(request.headers)):
                return 0  # a retry: the turn may have run already; its events from the start
        self.metrics.turns.inc()
        if ahead:  # it waits behind the tenant's turns no loop worker holds yet: say so
            queued = TurnQueued(
                tenant=tenant, session=session, turn_id=turn.id, ts=time.time(), ahead=ahead
            )
            await self.backend.publish_event(queued, f"{turn.msg_id}:queued")
        return last

    def tenant(self, tenant: str) -> TenantSettings:
        """``[tenants."<tenant>"]``, else ``[tenants."*"]``, else the defaults."""
        return self.tenants.get(tenant) or self.tenants.get("*") or TenantSettings()

    async def _room_in_backlog(self, tenant: str) -> int:
        """How many of the tenant's turns wait for a loop worker; refuse the turn (429
        ``backlog_full``) when they are ``max_backlog`` or more: nothing is published then."""
        limits = self.tenant(tenant)
        waiting = await self.backend.turns_waiting(tenant)
        if limits.max_backlog and waiting >= limits.max_backlog:
            raise BacklogFull(
                f"tenant {tenant} has {waiting} turns waiting, its limit "
                f"([tenants] max_backlog = {limits.max_backlog}); try again once some have run",
                retry_after=1,
            )
        return waiting

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
            user=check_id(body.user, "user") if body.user is not None else None,
            priority=body.priority,
        )  # fmt: skip
