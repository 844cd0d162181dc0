"""The client straight to NATS: turns published with JetStream, events read with an
ordered consumer on the session's events, controls recorded and published
(:mod:`loopmesh.controls`), agents read from their bucket (:mod:`loopmesh.agents`).

It connects with :func:`loopmesh.nats.connect`, so credentials and TLS are the
services' own ``[nats]`` settings, and it checks that loopmesh's streams are there: a
turn published where they are not would be refused, and a session's events could not
be read.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Awaitable
from typing import Any, TypeVar

import nats.errors
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.errors import NotFoundError, ServiceUnavailableError

from loopmesh.agents import read_agents
from loopmesh.aio import quietly
from loopmesh.branching import Branching
from loopmesh.controls import send_control
from loopmesh.erase import Eraser
from loopmesh.errors import (
    BranchRefused,
    EraseError,
    NatsConnectError,
    NatsTlsError,
    ProvisionError,
)
from loopmesh.jetstream import ordered_subscribe
from loopmesh.kv import open_kv
from loopmesh.mappings import check_turn_partitions
from loopmesh.memory import MemoryStore
from loopmesh.nats import DEFAULT_URL, connect, shown
from loopmesh.provision import check_partitions
from loopmesh.publisher import Publisher
from loopmesh.sessions import Query, page, read_sessions
from loopmesh.settings import NatsSettings
from loopmesh.turns import publish_turn
from schemas import AgentSpec, Control, Subjects, Turn, new_id
from schemas.agents import default_agent
from schemas.events import Event
from schemas.memory import Memory, MemorySource

from .errors import ClientError, InvalidRequest, NotFound, NotSetUp, Unauthorized, Unavailable
from .transport import Erased, Fork, MemoryItem, Rewind, SessionEvent, SessionPage, Submitted

T = TypeVar("T")

#: Seconds between tries while ``wait_s`` lasts (NATS not up yet, streams not made yet).
RETRY_EVERY_S = 0.5


async def follow_session(
    nc: Client, subjects: Subjects, tenant: str, session: str, *, since: int | None = None
) -> JetStreamContext.PushSubscription:
    """An ordered consumer on the session's events: after sequence ``since`` (0: all that
    are kept), or, with ``None``, only those stored from now on."""
    if since is None:
        kwargs: dict[str, Any] = {"deliver_policy": js_api.DeliverPolicy.NEW}
    elif since == 0:
        kwargs = {"deliver_policy": js_api.DeliverPolicy.ALL}
    else:
        kwargs = {
            "deliver_policy": js_api.DeliverPolicy.BY_START_SEQUENCE,
            "config": js_api.ConsumerConfig(opt_start_seq=since + 1),
        }
    stream = subjects.events_stream_of(tenant, session)  # its partition's
    return await ordered_subscribe(
        nc, subjects.session_events(tenant, session), stream=stream, **kwargs
    )


class NatsTransport:
    """See the module docstring. ``wait_s``: how long :meth:`open` keeps trying to reach
    NATS and to find loopmesh's streams (a ``loopmesh up`` still starting); ``timeout``:
    how long a request may wait for its answer."""

    def __init__(
        self,
        settings: NatsSettings,
        tenant: str,
        *,
        wait_s: float = 0.0,
        timeout: float = 30.0,
        name: str = "loopmesh-client",
    ) -> None:
        self.settings = settings
        self.tenant = tenant
        self.subjects = settings.subjects
        self.url = shown(settings.url or DEFAULT_URL)  # as errors show it
        self.where = f"NATS, tenant {tenant}"
        self._wait_s = wait_s
        self._timeout = timeout
        self._name = name
        self._nc: Client | None = None
        self._publisher: Publisher | None = None  # fork and rewind's

    async def open(self) -> None:
        deadline = time.monotonic() + self._wait_s
        nc = await self._connect(deadline)
        try:
            await self._provisioned(nc, deadline)
        except BaseException:
            await nc.close()
            raise
        self._nc = nc

    async def close(self) -> None:
        nc, self._nc = self._nc, None
        publisher, self._publisher = self._publisher, None
        if publisher is not None:
            await quietly(publisher.close())
        if nc is not None:
            await nc.close()

    @property
    def nc(self) -> Client:
        if self._nc is None:
            raise RuntimeError("not connected to NATS")
        return self._nc

    async def submit(self, turn: Turn) -> Submitted:
        js = self.nc.jetstream()
        stream = self.subjects.events_stream_of(turn.tenant, turn.session)
        info = await self._call("read the events stream", js.stream_info(stream))
        ack = await self._call("publish the turn", publish_turn(js, self.subjects, turn))
        since = 0 if ack.duplicate else info.state.last_seq  # published before: it may have run
        return Submitted(turn.id, turn.session, since)

    async def events(
        self, session: str, *, since: int, turn: str | None, follow: bool
    ) -> AsyncGenerator[SessionEvent, None]:
        sub = await self._call(
            "read the session's events",
            follow_session(self.nc, self.subjects, self.tenant, session, since=since),
        )
        try:
            # Without ``follow``: what is stored now, i.e. until a message says nothing is
            # pending. (The server pushes at once, so the consumer's own count is 0 soon
            # after it starts: it says "nothing stored" only when nothing was delivered.)
            if not follow:
                info = await self._call("read the session's events", sub.consumer_info())
                delivered = info.delivered.consumer_seq if info.delivered else 0
                if info.num_pending == 0 and not delivered:
                    return
            while True:
                msg = await sub.next_msg(timeout=None)
                item = SessionEvent.of(msg.metadata.sequence.stream, msg.data)
                if item is not None and (turn is None or item.event.turn_id == turn):
                    yield item
                if not follow and msg.metadata.num_pending == 0:
                    return
        finally:
            await quietly(sub.unsubscribe())

    async def send(self, control: Control) -> None:
        what = f"send a {type(control).__name__}"
        await self._call(what, send_control(self.nc, self.subjects, control))

    async def agents(self) -> list[AgentSpec]:
        js = self.nc.jetstream()
        try:
            found = await self._call("read the agents", read_agents(js, self.subjects))
        except NotFoundError:
            return [default_agent()]  # no bucket yet: only the deployment's [loop]
        return list(found.values())

    def _memory(self) -> MemoryStore:
        return MemoryStore(
            self.nc.jetstream(), self.subjects.memory_bucket, timeout_s=self._timeout
        )

    async def memories(self, kind: str, name: str) -> list[MemoryItem]:
        found = await self._call("read memories", self._memory().list(self.tenant, kind, name))
        return [_item(m) for m in found]

    async def remember(self, kind: str, name: str, text: str) -> MemoryItem:
        memory = Memory(
            id=new_id(), tenant=self.tenant, kind=kind, name=name, text=text,  # type: ignore[arg-type]
            created_at=time.time(), source=MemorySource(by="api"),
        )  # fmt: skip
        await self._call("store a memory", self._memory().put(memory))
        return _item(memory)

    async def forget(self, kind: str, name: str, id: str) -> bool:
        return await self._call(
            "erase a memory", self._memory().delete(self.tenant, kind, name, id)
        )

    async def erase_memories(self, kind: str, name: str) -> int:
        return await self._call("erase memories", self._memory().erase(self.tenant, kind, name))

    async def fork(self, session: str, *, turn: str, before: bool, into: str | None) -> Fork:
        branching = await self._branching()
        fork, made = await self._branched(
            "fork the session",
            session,
            branching.fork(self.tenant, session, turn, before=before, into=into or new_id()),
        )
        return Fork(
            session=fork.session, source=session, agent=fork.agent, at_turn=made.last,
            turns=made.kept, messages=len(made.messages),
        )  # fmt: skip

    async def rewind(self, session: str, *, turn: str, before: bool) -> Rewind:
        branching = await self._branching()
        _, made = await self._branched(
            "rewind the session",
            session,
            branching.rewind(self.tenant, session, turn, before=before),
        )
        return Rewind(
            session=session, to_turn=made.last, undone=made.later, calls=made.calls,
            messages=len(made.messages),
        )  # fmt: skip

    async def _branching(self) -> Branching:
        js, s = self.nc.jetstream(), self.subjects
        if self._publisher is None:
            self._publisher = Publisher(self.nc)
        publisher = self._publisher
        sessions, leases = await self._call(
            "open the sessions and leases buckets",
            asyncio.gather(
                open_kv(js, publisher, s.sessions_bucket, timeout=self._timeout),
                open_kv(js, publisher, s.leases_bucket, timeout=self._timeout),
            ),
        )
        return Branching(
            js, publisher, s, sessions=sessions, leases=leases, events=self._stored,
            timeout=self._timeout,
        )  # fmt: skip

    async def _stored(self, tenant: str, session: str) -> list[Event]:
        """The session's events stored now (``tenant`` is this transport's)."""
        items = self.events(session, since=0, turn=None, follow=False)
        return [item.event async for item in items]

    async def _branched(self, what: str, session: str, request: Awaitable[T]) -> T:
        """A fork or rewind; its refusal as the client's error (as the gateway says it)."""
        try:
            return await self._call(what, request)
        except BranchRefused as exc:
            if exc.kind == "not_found":
                raise NotFound(exc.message, what=f"session {session!r}") from None
            if exc.kind == "invalid":
                raise InvalidRequest(exc.message, field=exc.field) from None
            code = "session_busy" if exc.kind == "busy" else exc.kind
            raise ClientError(exc.message, code=code) from None

    async def sessions(self, tenant: str, query: Query) -> SessionPage:
        found = await self._call(
            "read the sessions", read_sessions(self.nc.jetstream(), self.subjects, tenant)
        )
        try:
            shown, cursor = page(found, query)
        except ValueError as exc:
            raise InvalidRequest(str(exc), field="cursor") from None
        return SessionPage(shown, cursor)

    async def delete_session(self, tenant: str, session: str) -> Erased:
        eraser = Eraser(self.nc, self.subjects, timeout=self._timeout)
        try:
            erased = await eraser.erase(tenant, session, by=f"client {self._name}")
        except EraseError as exc:
            raise ClientError(exc.message, code="erase") from exc
        if erased is None:
            raise NotFound(f"no session {session!r}", what=f"session {session!r}")
        return Erased(erased.session, erased.at, list(erased.children), dict(erased.removed))

    # -- connecting -----------------------------------------------------------------------

    async def _connect(self, deadline: float) -> Client:
        while True:
            try:
                return await connect(self.settings, name=self._name)
            except NatsTlsError as exc:  # a setting to change: no use waiting
                raise Unavailable(str(exc), url=self.url) from exc
            except NatsConnectError as exc:
                if _refused_credentials(exc.__cause__):
                    raise Unauthorized(str(exc)) from exc
                if time.monotonic() >= deadline:
                    raise Unavailable(str(exc), url=self.url) from exc
            await asyncio.sleep(RETRY_EVERY_S)

    async def _provisioned(self, nc: Client, deadline: float) -> None:
        """Return once the turns and events streams exist, else raise :class:`NotSetUp`
        saying what is missing; :class:`ClientError` if the server's events streams are
        for another partition count than ``[nats] partitions`` (no use waiting)."""
        js = nc.jetstream()
        for stream in (*self.subjects.turns_streams, *self.subjects.events_streams):
            while True:
                try:
                    await js.stream_info(stream)
                    break
                except NotFoundError:
                    if stream not in self.subjects.turns_streams:
                        await self._same_partitions(js)
                    missing = stream
                    said = (
                        f"NATS at {self.url} has no stream {stream}: loopmesh is not set up "
                        "there (`loopmesh up`, a loop worker or a tool worker creates its "
                        "streams)"
                    )
                except ServiceUnavailableError:
                    missing = "JetStream"
                    said = f"NATS at {self.url} has no JetStream (nats-server -js)"
                if time.monotonic() >= deadline:
                    raise NotSetUp(said, url=self.url, missing=missing)
                await asyncio.sleep(RETRY_EVERY_S)
        await self._same_partitions(js)
        try:
            await check_turn_partitions(nc, self.subjects)
        except ProvisionError as exc:
            raise ClientError(str(exc), code="partitions") from exc

    async def _same_partitions(self, js: JetStreamContext) -> None:
        """Raise :class:`ClientError` (code ``partitions``) when the server keeps the
        events in another number of streams: the client would read a session's events
        where they are not."""
        try:
            await self._call("read the events streams", check_partitions(js, self.subjects))
        except ProvisionError as exc:
            raise ClientError(str(exc), code="partitions") from exc

    async def _call(self, what: str, request: Awaitable[T]) -> T:
        """``request``, within the timeout; NATS not answering is :class:`Unavailable`."""
        try:
            async with asyncio.timeout(self._timeout):
                return await request
        except (
            TimeoutError,
            nats.errors.NoRespondersError,
            nats.errors.ConnectionClosedError,
        ) as exc:
            raise Unavailable(
                f"NATS at {self.url} did not answer (to {what}): {type(exc).__name__}",
                url=self.url,
            ) from exc


def _refused_credentials(cause: BaseException | None) -> bool:
    """Whether the server refused the credentials. (nats-py 2.16 raises its
    ``AuthorizationError`` only for a lower-case "authorization violation"; the server
    says "Authorization Violation", which comes as a plain error.)"""
    if isinstance(cause, nats.errors.AuthorizationError):
        return True
    return cause is not None and "authorization violation" in str(cause).lower()


def _item(m: Memory) -> MemoryItem:
    return MemoryItem(
        id=m.id, kind=m.kind, name=m.name, text=m.text, created_at=m.created_at, source=m.source
    )
