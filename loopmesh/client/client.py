""":class:`Client`: run turns, read events, decide approvals, cancel, list agents, over
NATS or through the gateway, with one API."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Self, TypedDict, Unpack

import msgspec

from loopmesh.sessions import DEFAULT_PAGE, MAX_PAGE, Query
from loopmesh.settings import NatsSettings, load, replace
from schemas import (
    AgentSpec,
    ApprovalDecision,
    Cancel,
    ContentPart,
    Control,
    Passage,
    Pause,
    Resume,
    Turn,
    Webhook,
    check_token,
    new_id,
)
from schemas.events import Error, Event, LoopEnd, LoopStart
from schemas.memory import MAX_MEMORY_CHARS

from .config import ClientConfig
from .errors import InvalidRequest, TurnRefused
from .gateway import GatewayTransport
from .nats import NatsTransport
from .transport import (
    Erased,
    Fork,
    MemoryItem,
    Rewind,
    SessionEvent,
    SessionPage,
    Submitted,
    Transport,
)


class TurnOptions(TypedDict, total=False):
    """What a turn may set besides its input (``schemas.Turn``'s fields of the same
    names), over either transport; ``None`` is the same as not setting it."""

    #: The session it continues (default: a new one).
    session: str | None
    #: The named agent that runs it (default: the session's; ``default`` for a new one).
    agent: str | None
    #: Its id (default: a new one). Submitting the same id twice runs it once.
    turn_id: str | None
    instructions: str | None
    model: str | None
    max_iterations: int | None
    #: Only these tools (``server.tool``, or a bare tool name) may be called.
    tools: Sequence[str] | None
    mode: Literal["loop", "orchestrator"] | None
    planner_model: str | None
    executor_model: str | None
    #: Passages already retrieved, for the prompt.
    context: Sequence[Passage] | None
    #: Images and files that go with the input.
    parts: Sequence[ContentPart] | None
    #: When an earlier turn of the session has not ended: wait, be refused, interrupt it
    #: or interrupt and undo it (default: the deployment's ``[loop] on_busy``).
    on_busy: Literal["enqueue", "reject", "interrupt", "rollback"] | None
    #: Where to POST the turn's events, signed (``schemas.Webhook``: ``url``, ``events``).
    webhook: Webhook | None
    #: Who the turn is for: the namespace of the memories its agent keeps of them.
    user: str | None
    #: ``interactive`` (the default) or ``batch``: loop workers take interactive turns
    #: of every tenant before batch ones.
    priority: Literal["interactive", "batch"] | None


class Client:
    """loopmesh from Python, over NATS or through the HTTP gateway::

        async with Client(nats_url="nats://127.0.0.1:4222") as client:
            async for event in client.run("What is 17 * 23?", session="s1"):
                print(event.type)

    Give ``nats_url`` (and, where needed, ``creds_file`` and the TLS files, or a whole
    :class:`~loopmesh.settings.NatsSettings` as ``nats``; ``tenant``: whose sessions,
    default ``local``), or ``gateway`` with its ``api_key`` (the key decides the
    tenant); with neither, NATS at ``nats://127.0.0.1:4222``. :meth:`from_config` reads
    ``[nats]`` and ``[client]`` from the shared TOML file and ``LOOPMESH_*`` variables.

    ``timeout``: how long one request may wait for its answer (an event stream waits as
    long as it must); ``connect_wait_s``: how long to keep trying to reach NATS, and
    for loopmesh's streams to be there (a ``loopmesh up`` still starting).

    It connects on ``async with`` (or on first use); :meth:`close` is idempotent.
    Errors are :mod:`loopmesh.client.errors`.
    """

    def __init__(
        self,
        *,
        nats_url: str | None = None,
        gateway: str | None = None,
        api_key: str | None = None,
        tenant: str = "local",
        nats: NatsSettings | None = None,
        creds_file: str | None = None,
        tls_ca_file: str | None = None,
        tls_cert_file: str | None = None,
        tls_key_file: str | None = None,
        timeout: float = 30.0,
        connect_wait_s: float = 0.0,
        name: str = "loopmesh-client",
    ) -> None:
        over_nats = {
            "url": nats_url, "creds_file": creds_file, "tls_ca_file": tls_ca_file,
            "tls_cert_file": tls_cert_file, "tls_key_file": tls_key_file,
        }  # fmt: skip
        given = {k: v for k, v in over_nats.items() if v is not None}
        self.tenant = check_token(tenant, "tenant")
        self._transport: Transport
        if gateway is not None:
            if given or nats is not None:
                raise ValueError(
                    "give either a gateway or NATS settings, not both: through a gateway, "
                    "the gateway holds the NATS connection"
                )
            if not gateway.startswith(("http://", "https://")):
                raise ValueError(f"gateway {gateway!r}: an http:// or https:// URL")
            self._transport = GatewayTransport(gateway, api_key, timeout=timeout)
        else:
            if api_key is not None:
                raise ValueError("an api_key is the gateway's: give gateway= too")
            settings = replace(nats or NatsSettings(), "Client(...)", **given)
            self._transport = NatsTransport(
                settings, self.tenant, wait_s=connect_wait_s, timeout=timeout, name=name
            )
        self._opened = False
        self._closed = False
        self._lock = asyncio.Lock()

    @classmethod
    def from_config(
        cls,
        config: ClientConfig | str | Path | None = None,
        *,
        timeout: float = 30.0,
        connect_wait_s: float = 0.0,
        name: str = "loopmesh-client",
    ) -> Client:
        """A client as ``config`` says (a :class:`~loopmesh.client.ClientConfig`, or
        the TOML file to read it from; ``None``: ``$LOOPMESH_CONFIG``, if set, and the
        ``LOOPMESH_NATS__*`` and ``LOOPMESH_CLIENT__*`` variables)."""
        if not isinstance(config, ClientConfig):
            config = load(ClientConfig, config)
        options: dict[str, Any] = {
            "timeout": timeout, "connect_wait_s": connect_wait_s, "name": name,
        }  # fmt: skip
        settings = config.client
        if settings.gateway:
            return cls(gateway=settings.gateway, api_key=settings.api_key, **options)
        return cls(nats=config.nats, tenant=settings.tenant, **options)

    @property
    def where(self) -> str:
        """Where it goes, for messages: ``NATS, tenant local`` or ``gateway http://...``."""
        return self._transport.where

    async def connect(self) -> None:
        """Connect now (``async with`` does, and so does the first call): NATS is reached
        and loopmesh's streams are found, or this raises."""
        await self._ready()

    async def __aenter__(self) -> Self:
        await self._ready()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the connection (NATS, or the HTTP client); again does nothing."""
        if self._closed:
            return
        self._closed = True
        await self._transport.close()

    # -- turns ----------------------------------------------------------------------------

    async def submit(self, input: str, **options: Unpack[TurnOptions]) -> Submitted:
        """Hand a turn to loopmesh; its id and session (and where its events start).

        Raises :class:`~loopmesh.client.errors.TurnRefused` when the gateway refuses it
        (409 ``session_busy``, 422 naming a field); a refusal that comes later, from a
        loop worker, is an ``error`` event (:meth:`run` raises it)."""
        turn = self._turn(input, options)
        return await (await self._ready()).submit(turn)

    async def run(self, input: str, **options: Unpack[TurnOptions]) -> AsyncGenerator[Event, None]:
        """Submit a turn and yield its events as they come, from its first one to its
        ``loop_end`` (the last). Events of other turns of the session are not shown.

        Raises :class:`~loopmesh.client.errors.TurnRefused` when the turn is refused,
        whether by the gateway or by the loop worker's ``error`` event (an unknown
        agent, a session of another agent, ``on_busy="reject"`` while a turn runs...)."""
        submitted = await self.submit(input, **options)
        transport = await self._ready()
        started = False
        refusal: Error | None = None
        items = transport.events(
            submitted.session, since=submitted.since, turn=submitted.turn_id, follow=True
        )
        async with contextlib.aclosing(items):
            async for item in items:
                event = item.event
                if isinstance(event, LoopStart):
                    started = True
                elif isinstance(event, Error) and event.fatal and not started:
                    refusal = event  # the turn cannot start: its loop_end follows
                    continue
                if isinstance(event, LoopEnd):
                    if refusal is not None:
                        raise _refused(submitted, refusal, event)
                    yield event
                    return
                yield event

    def events(
        self, session: str, *, since: int = 0, turn: str | None = None, follow: bool = True
    ) -> AsyncGenerator[SessionEvent, None]:
        """The session's events after the stream sequence ``since`` (0: every event still
        kept), each with its sequence: resume after the last one handled with
        ``since=item.seq``. ``turn``: only that turn's. ``follow``: go on with new
        events as they come (until the iterator is closed); else stop after the
        events stored when it was called.

        Through the gateway a session nobody created is
        :class:`~loopmesh.client.errors.NotFound`; over NATS it has no events."""
        check_token(session, "session")
        if turn is not None:
            check_token(turn, "turn")
        if since < 0:
            raise ValueError(f"since={since}: a stream sequence is 0 or more")
        return self._events(session, since=since, turn=turn, follow=follow)

    async def _events(
        self, session: str, *, since: int, turn: str | None, follow: bool
    ) -> AsyncGenerator[SessionEvent, None]:
        items = (await self._ready()).events(session, since=since, turn=turn, follow=follow)
        async with contextlib.aclosing(items):
            async for item in items:
                yield item

    # -- controls -------------------------------------------------------------------------

    async def approve(self, session: str, call_id: str, *, reason: str = "") -> None:
        """Let a tool call that waits for a person (an ``approval_required`` event) run."""
        await self._decide(session, call_id, approved=True, reason=reason)

    async def deny(self, session: str, call_id: str, *, reason: str = "") -> None:
        """Refuse a tool call that waits for a person; the model gets an error (``reason``)."""
        await self._decide(session, call_id, approved=False, reason=reason)

    async def cancel(self, session: str, *, turn_id: str | None = None, reason: str = "") -> None:
        """Stop the session's running turn at its next step (``loop_end`` reason
        ``cancelled``); over NATS, ``turn_id`` stops that turn only."""
        if turn_id is not None:
            check_token(turn_id, "turn")
        await self._send(
            Cancel(tenant=self.tenant, session=session, turn_id=turn_id, reason=reason)
        )

    async def pause(self, session: str) -> None:
        """Pause the session's running turn at its next step (``paused``)."""
        await self._send(Pause(tenant=self.tenant, session=session))

    async def resume(self, session: str) -> None:
        """Resume a paused turn (``resumed``)."""
        await self._send(Resume(tenant=self.tenant, session=session))

    async def _decide(self, session: str, call_id: str, *, approved: bool, reason: str) -> None:
        check_token(call_id, "call")
        await self._send(
            ApprovalDecision(
                tenant=self.tenant, session=session, call_id=call_id, approved=approved,
                reason=reason,
            )
        )  # fmt: skip

    async def _send(self, control: Control) -> None:
        check_token(control.session, "session")
        control = msgspec.structs.replace(control, at=time.time())
        await (await self._ready()).send(control)

    # -- fork and rewind ------------------------------------------------------------------

    async def fork(
        self,
        session: str,
        *,
        at_turn: str | None = None,
        before_turn: str | None = None,
        into: str | None = None,
    ) -> Fork:
        """A new session holding ``session`` as it was at the end of ``at_turn``, or
        before ``before_turn`` began (give one); ``into``: its id (default: one the
        gateway picks). ``session`` stays as it is. Through the gateway only."""
        turn, before = _point(at_turn, before_turn)
        check_token(session, "session")
        if into is not None:
            check_token(into, "session")
        return await (await self._ready()).fork(session, turn=turn, before=before, into=into)

    async def rewind(
        self, session: str, *, before_turn: str | None = None, at_turn: str | None = None
    ) -> Rewind:
        """Take ``session`` back to before ``before_turn`` began, or to the end of
        ``at_turn`` (give one): the turns after it are undone (their events stay, and a
        ``rewound`` event names them); the next turn starts from there. Tool calls that
        ran are not undone (``Rewind.calls``). Through the gateway only."""
        turn, before = _point(at_turn, before_turn)
        check_token(session, "session")
        return await (await self._ready()).rewind(session, turn=turn, before=before)

    # -- agents ---------------------------------------------------------------------------

    async def agents(self) -> list[AgentSpec]:
        """The named agents, ``default`` first, each with its revision (docs/AGENTS.md)."""
        return await (await self._ready()).agents()

    # -- memory -------------------------------------------------------------------------

    async def memories(
        self, *, user: str | None = None, agent: str | None = None
    ) -> list[MemoryItem]:
        """The memories kept of ``user`` (or by ``agent``), oldest first ([loop.memory])."""
        kind, name = _namespace(user, agent)
        return await (await self._ready()).memories(kind, name)

    async def remember(
        self, text: str, *, user: str | None = None, agent: str | None = None
    ) -> MemoryItem:
        """Add a memory of ``user`` (or of ``agent``); loop workers embed it as they load it."""
        kind, name = _namespace(user, agent)
        if not text.strip() or len(text) > MAX_MEMORY_CHARS:
            raise InvalidRequest(f"`text` must be 1 to {MAX_MEMORY_CHARS} characters", field="text")
        return await (await self._ready()).remember(kind, name, text)

    async def forget(self, id: str, *, user: str | None = None, agent: str | None = None) -> bool:
        """Delete memory ``id`` of ``user`` (or of ``agent``); whether there was one."""
        kind, name = _namespace(user, agent)
        return await (await self._ready()).forget(kind, name, check_token(id, "id"))

    async def erase_memories(self, *, user: str | None = None, agent: str | None = None) -> int:
        """Erase every memory of ``user`` (or of ``agent``), all trace of them; how many."""
        kind, name = _namespace(user, agent)
        return await (await self._ready()).erase_memories(kind, name)

    # -- sessions -------------------------------------------------------------------------

    async def sessions(
        self,
        *,
        agent: str | None = None,
        labels: Mapping[str, str | None] | None = None,
        active_after: float | None = None,
        active_before: float | None = None,
        limit: int = DEFAULT_PAGE,
        cursor: str | None = None,
    ) -> SessionPage:
        """A page of the tenant's sessions, most recently active first, each with its
        title, labels and counts: only ``agent``'s, those with every label of ``labels``
        (a value of ``None``: any value), last active in [``active_after``,
        ``active_before``) (seconds since the epoch). ``limit``: 1 to 1000 a page; pass a
        page's ``next_cursor`` as ``cursor`` for the next one."""
        if agent is not None:
            check_token(agent, "agent")
        if not 1 <= limit <= MAX_PAGE:
            raise ValueError(f"limit={limit}: 1 to {MAX_PAGE} sessions a page")
        query = Query(
            agent=agent, labels=dict(labels or {}), active_after=active_after,
            active_before=active_before, limit=limit, after=cursor,
        )  # fmt: skip
        return await (await self._ready()).sessions(self.tenant, query)

    async def delete_session(self, session: str) -> Erased:
        """Erase the session everywhere loopmesh keeps it: its running turn cancelled
        first, its events, snapshot, effects, controls and A2A tasks, and the sessions of
        the agents it called; recorded on the tenant's audit subject (docs/GATEWAY.md,
        "Erasing a session"). :class:`~loopmesh.client.errors.NotFound` when nothing of
        it is stored (another tenant's session included)."""
        check_token(session, "session")
        return await (await self._ready()).delete_session(self.tenant, session)

    # -- inside -----------------------------------------------------------------------------

    async def _ready(self) -> Transport:
        if self._closed:
            raise RuntimeError("this loopmesh Client is closed")
        if not self._opened:
            async with self._lock:
                if not self._opened:
                    await self._transport.open()
                    self._opened = True
        return self._transport

    def _turn(self, input: str, options: TurnOptions) -> Turn:
        unknown = sorted(set(options) - set(TurnOptions.__annotations__))
        if unknown:
            known = ", ".join(TurnOptions.__annotations__)
            raise TypeError(f"a turn has no option {', '.join(unknown)} (it has: {known})")
        if not isinstance(input, str) or not input.strip():
            raise ValueError("a turn's input must be text, not empty")
        session = check_token(options.get("session") or new_id(), "session")
        turn_id = check_token(options.get("turn_id") or new_id(), "turn")
        agent = options.get("agent")
        tools = options.get("tools")
        return Turn(
            id=turn_id, tenant=self.tenant, session=session, input=input,
            created_at=time.time(), instructions=options.get("instructions"),
            model=options.get("model"), max_iterations=options.get("max_iterations"),
            tools=tuple(tools) if tools is not None else None, mode=options.get("mode"),
            planner_model=options.get("planner_model"),
            executor_model=options.get("executor_model"),
            context=tuple(options.get("context") or ()), parts=tuple(options.get("parts") or ()),
            on_busy=options.get("on_busy"), webhook=options.get("webhook"),
            agent=check_token(agent, "agent") if agent is not None else None,
            user=check_token(user, "user") if (user := options.get("user")) is not None else None,
            priority=options.get("priority") or "interactive",
        )  # fmt: skip


def _point(at_turn: str | None, before_turn: str | None) -> tuple[str, bool]:
    """The turn named and whether it is ``before_turn``: exactly one of the two."""
    if (at_turn is None) == (before_turn is None):
        raise ValueError("give exactly one of at_turn and before_turn (a turn id)")
    if before_turn is not None:
        return check_token(before_turn, "turn"), True
    assert at_turn is not None
    return check_token(at_turn, "turn"), False


def _refused(submitted: Submitted, error: Error, end: LoopEnd) -> TurnRefused:
    said = error.message.removeprefix("turn refused: ")
    return TurnRefused(
        f"turn {submitted.turn_id} of session {submitted.session} was refused: "
        f"{error.code}: {said}",
        turn_id=submitted.turn_id, session=submitted.session, code=error.code, event=error,
        end=end,
    )  # fmt: skip


def _namespace(user: str | None, agent: str | None) -> tuple[str, str]:
    if (user is None) == (agent is None):
        raise InvalidRequest("give exactly one of `user` and `agent`", field="user")
    if user is not None:
        return "user", check_token(user, "user")
    return "agent", check_token(agent or "", "agent")
