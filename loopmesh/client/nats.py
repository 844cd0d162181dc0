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
from loopmesh.controls import send_control
from loopmesh.erase import Eraser
from loopmesh.errors import EraseError, NatsConnectError, NatsTlsError, ProvisionError
from loopmesh.jetstream import ordered_subscribe
from loopmesh.nats import DEFAULT_URL, connect, shown
from loopmesh.provision import check_partitions
from loopmesh.sessions import Query, page, read_sessions
from loopmesh.settings import NatsSettings
from loopmesh.turns import publish_turn
from schemas import AgentSpec, Control, Subjects, Turn
from schemas.agents import default_agent

from .errors import ClientError, InvalidRequest, NotFound, NotSetUp, Unauthorized, Unavailable
from .transport import Erased, SessionEvent, SessionPage, Submitted

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
        for stream in (self.subjects.turns_stream, *self.subjects.events_streams):
            while True:
                try:
                    await js.stream_info(stream)
                    break
                except NotFoundError:
                    if stream != self.subjects.turns_stream:
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
