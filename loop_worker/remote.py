"""How the commands people type (``run``, ``events``, ``approve``, ``deny``, ``cancel``)
reach loopmesh: straight to NATS, or through the HTTP gateway.

::

    [client]
    gateway = "http://127.0.0.1:8080"   # unset: straight to NATS ([nats] url)
    api_key = "..."                     # the gateway's API key; better in LOOPMESH_CLIENT__API_KEY
    tenant = "local"                    # over NATS only: through a gateway the key decides

``--gateway URL`` and ``--api-key KEY`` override them. Both transports give a
session's events as :class:`Item` s (the JetStream sequence, the type, the event's
JSON), so the commands print the same thing either way.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any, Protocol

import httpx
import msgspec
from nats.aio.client import Client
from nats.js import api as js_api
from nats.js.errors import NotFoundError, ServiceUnavailableError

from loopmesh.aio import quietly
from loopmesh.cli import config_from_args
from loopmesh.errors import LoopmeshError, NatsConnectError, NatsTlsError
from loopmesh.jetstream import ordered_subscribe
from loopmesh.nats import DEFAULT_URL, connect
from loopmesh.settings import NatsSettings, replace
from schemas import (
    ApprovalDecision,
    Cancel,
    Control,
    DecodeError,
    Pause,
    Resume,
    Subjects,
    Turn,
    check_token,
    encode,
)
from schemas.events import Event, decode_event
from schemas.ids import TOKEN_PATTERN

from .controls import send_control


class ClientSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    gateway: Annotated[str, msgspec.Meta(pattern=r"^https?://")] | None = None
    api_key: str | None = None
    tenant: Annotated[str, msgspec.Meta(pattern=TOKEN_PATTERN)] = "local"


class ClientConfig(msgspec.Struct, frozen=True, kw_only=True):
    nats: NatsSettings = NatsSettings()
    client: ClientSettings = ClientSettings()


class RemoteError(LoopmeshError):
    """The gateway refused a request (``.status``, ``.code``) or cannot be reached."""

    def __init__(self, message: str, *, status: int = 0, code: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class Item(msgspec.Struct, frozen=True):
    """One event of a session: ``seq`` is its stream sequence (None for the gateway's
    own notices, such as ``trimmed``), ``data`` the event's JSON."""

    seq: int | None
    type: str
    data: bytes

    def event(self) -> Event | None:
        """The decoded event (``UnknownEvent`` for a type this client does not know, see
        :func:`~schemas.events.decode_event`); None for a notice or bytes that are no event."""
        if self.seq is None:
            return None
        try:
            return decode_event(self.data)
        except DecodeError:
            return None

    def json_line(self) -> str:
        """The event's JSON with ``"seq"`` first (resume with ``--since SEQ``)."""
        if self.seq is None:
            return msgspec.json.encode(
                {"notice": self.type, **msgspec.json.decode(self.data)}
            ).decode()
        return f'{{"seq":{self.seq},{self.data.decode()[1:]}'


class Remote(Protocol):
    """One of the two ways in; see :func:`open_remote`."""

    where: str

    def run(self, turn: Turn) -> AsyncIterator[Item]:
        """Submit ``turn`` and yield its events as they come (from before it started)."""
        ...

    def events(
        self, session: str, *, after: int | None, turn: str | None, follow: bool
    ) -> AsyncIterator[Item]:
        """The session's stored events after ``after`` (all when None), then, with
        ``follow``, new ones as they come."""
        ...

    async def send(self, control: Control) -> None: ...


# -- options ----------------------------------------------------------------------------


def token(kind: str) -> Any:
    """An argparse ``type`` that accepts only a valid id."""

    def check(value: str) -> str:
        try:
            return check_token(value, kind)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return check


def add_remote_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("how to reach loopmesh (default: straight to NATS)")
    group.add_argument(
        "--gateway", metavar="URL",
        help="through the HTTP gateway at URL instead of NATS ([client] gateway)",
    )  # fmt: skip
    group.add_argument(
        "--api-key", metavar="KEY",
        help="the gateway's API key ([client] api_key; prefer LOOPMESH_CLIENT__API_KEY, "
        "which other users cannot see in the process list)",
    )  # fmt: skip
    group.add_argument(
        "--tenant", type=token("tenant"),
        help="tenant id over NATS (default: [client] tenant, local); a gateway key decides it",
    )  # fmt: skip
    group.add_argument(
        "--connect-timeout", type=float, default=0.0, metavar="S",
        help="keep trying to reach NATS, and for loopmesh's streams to be there, for this "
        "long (for a `loopmesh up` still starting)",
    )  # fmt: skip


def client_config(args: argparse.Namespace) -> ClientConfig:
    config = config_from_args(ClientConfig, args)
    changes: dict[str, Any] = {}
    if getattr(args, "gateway", None):
        changes["gateway"] = args.gateway
    if getattr(args, "api_key", None):
        changes["api_key"] = args.api_key
    if getattr(args, "tenant", None):
        changes["tenant"] = args.tenant
    client = replace(config.client, "the command line", **changes)
    return msgspec.structs.replace(config, client=client)


@contextlib.asynccontextmanager
async def open_remote(args: argparse.Namespace) -> AsyncIterator[Remote]:
    """The gateway named by ``--gateway`` / ``[client] gateway``, else NATS."""
    config = client_config(args)
    if config.client.gateway:
        async with GatewayRemote(config.client.gateway, config.client.api_key) as remote:
            yield remote
        return
    deadline = time.monotonic() + getattr(args, "connect_timeout", 0.0)
    subjects = Subjects(config.nats.prefix)
    nc = await _connect(config.nats, deadline)
    try:
        await _provisioned(nc, config.nats.url or DEFAULT_URL, subjects, deadline)
        yield NatsRemote(nc, subjects, config.client.tenant)
    finally:
        await nc.close()


async def _connect(settings: NatsSettings, deadline: float) -> Client:
    while True:
        try:
            return await connect(settings, name="loopmesh-cli")
        except NatsTlsError:
            raise  # a setting to change: no use waiting
        except NatsConnectError:
            if time.monotonic() >= deadline:
                raise
            await asyncio.sleep(0.5)


async def _provisioned(nc: Client, url: str, subjects: Subjects, deadline: float) -> None:
    """Wait until the turns and events streams exist (a starting `loopmesh up` takes
    clients before it has created them), else say what is missing: a turn published now
    would be refused, and a session's events could not be read."""
    js = nc.jetstream()
    for stream in (subjects.turns_stream, subjects.events_stream):
        while True:
            try:
                await js.stream_info(stream)
                break
            except NotFoundError:
                missing = (
                    f"NATS at {url} has no stream {stream}: loopmesh is not set up there "
                    "(`loopmesh up`, a loop worker or a tool worker creates its streams)"
                )
            except ServiceUnavailableError:
                missing = f"NATS at {url} has no JetStream (nats-server -js)"
            if time.monotonic() >= deadline:
                raise RemoteError(f"{missing}; --connect-timeout S waits for one starting")
            await asyncio.sleep(0.5)


# -- straight to NATS -------------------------------------------------------------------


class NatsRemote:
    def __init__(self, nc: Client, subjects: Subjects, tenant: str) -> None:
        self.nc = nc
        self.subjects = subjects
        self.tenant = tenant
        self.where = f"NATS, tenant {tenant}"

    async def run(self, turn: Turn) -> AsyncIterator[Item]:
        # subscribe first: a plain subscription does not replay what came before it
        sub = await self._subscribe(turn.session, js_api.DeliverPolicy.NEW)
        try:
            await self.nc.jetstream().publish(
                self.subjects.turn(turn.tenant, turn.session),
                encode(turn),
                headers={"Nats-Msg-Id": turn.msg_id},
            )
            while True:
                msg = await sub.next_msg(timeout=None)
                item = _item(msg)
                if _turn_of(item) == turn.id:
                    yield item
        finally:
            await quietly(sub.unsubscribe())

    async def events(
        self, session: str, *, after: int | None, turn: str | None, follow: bool
    ) -> AsyncIterator[Item]:
        if after is None:
            sub = await self._subscribe(session, js_api.DeliverPolicy.ALL)
        else:
            sub = await self._subscribe(
                session, js_api.DeliverPolicy.BY_START_SEQUENCE, start=after + 1
            )
        try:
            # Without --follow: what is stored now, i.e. until a message says nothing is
            # pending. (The server pushes at once, so the consumer's own count is 0 soon
            # after it starts: it says "nothing stored" only when nothing was delivered.)
            if not follow:
                info = await sub.consumer_info()
                if info.num_pending == 0 and not info.delivered.consumer_seq:
                    return
            while True:
                msg = await sub.next_msg(timeout=None)
                item = _item(msg)
                if turn is None or _turn_of(item) == turn:
                    yield item
                if not follow and msg.metadata.num_pending == 0:
                    return
        finally:
            await quietly(sub.unsubscribe())

    async def send(self, control: Control) -> None:
        await send_control(self.nc, self.subjects, control)

    async def _subscribe(self, session: str, policy: js_api.DeliverPolicy, start: int = 0) -> Any:
        config = js_api.ConsumerConfig(opt_start_seq=start) if start else None
        return await ordered_subscribe(
            self.nc,
            self.subjects.session_events(self.tenant, session),
            stream=self.subjects.events_stream,
            deliver_policy=policy,
            config=config,
        )


def _item(msg: Any) -> Item:
    return Item(msg.metadata.sequence.stream, msg.subject.rpartition(".")[2], msg.data)


class _TurnId(msgspec.Struct):
    turn_id: str = ""


_turn_id = msgspec.json.Decoder(_TurnId)


def _turn_of(item: Item) -> str:
    try:
        return _turn_id.decode(item.data).turn_id
    except msgspec.DecodeError:
        return ""


# -- through the gateway ----------------------------------------------------------------


class GatewayRemote:
    """The gateway's HTTP API (docs/GATEWAY.md). A dropped or cut event stream is
    resumed with ``Last-Event-ID``, so nothing is missed or repeated."""

    #: Reconnects of an event stream in a row that bring nothing new, before giving up.
    RETRIES = 5

    def __init__(self, url: str, api_key: str | None, *, timeout: float = 30.0) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.url = url.rstrip("/")
        self.where = f"gateway {self.url}"
        self.http = httpx.AsyncClient(
            base_url=self.url, headers=headers, timeout=httpx.Timeout(timeout, read=None)
        )

    async def __aenter__(self) -> GatewayRemote:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.http.aclose()

    async def run(self, turn: Turn) -> AsyncIterator[Item]:
        body: dict[str, Any] = {"input": turn.input}
        if turn.max_iterations is not None:
            body["max_iterations"] = turn.max_iterations
        if turn.model:
            body["model"] = turn.model
        if turn.agent:
            body["agent"] = turn.agent
        if turn.webhook is not None:
            body["webhook"] = msgspec.to_builtins(turn.webhook)
        posted = await self._call(
            "POST", f"/v1/sessions/{turn.session}/turns", body, {"Idempotency-Key": turn.id}
        )
        events_url = httpx.URL(posted["events_url"])
        since = events_url.params.get("since")
        async for item in self._stream(
            turn.session, after=int(since) if since else None, turn=posted["turn_id"]
        ):
            yield item

    def events(
        self, session: str, *, after: int | None, turn: str | None, follow: bool
    ) -> AsyncIterator[Item]:
        return self._stream(
            session, after=0 if after is None else after, turn=turn,
            until_caught_up=not follow,
        )  # fmt: skip

    async def send(self, control: Control) -> None:
        base = f"/v1/sessions/{control.session}"
        match control:
            case Cancel(reason=reason):
                await self._call("POST", f"{base}/cancel", {"reason": reason} if reason else {})
            case Pause():
                await self._call("POST", f"{base}/pause", {})
            case Resume():
                await self._call("POST", f"{base}/resume", {})
            case ApprovalDecision(call_id=call_id, approved=approved, reason=reason):
                body: dict[str, Any] = {"approve": approved}
                if reason:
                    body["reason"] = reason
                await self._call("POST", f"{base}/approvals/{call_id}", body)

    async def _call(
        self, method: str, path: str, body: Any, headers: dict[str, str] | None = None
    ) -> Any:
        try:
            r = await self.http.request(method, path, json=body, headers=headers)
        except httpx.HTTPError as exc:
            raise RemoteError(f"cannot reach the gateway at {self.url}: {exc}") from None
        if r.status_code >= 400:
            raise _refused(r, r.content)
        return r.json()

    async def _stream(
        self, session: str, *, after: int | None, turn: str | None, until_caught_up: bool = False
    ) -> AsyncIterator[Item]:
        """The session's events after ``after``, resumed across cuts and dropped
        connections; with ``until_caught_up``, only those stored when it was called."""
        last, fruitless = after, 0
        params = {"turn": turn} if turn else {}
        while True:
            headers = {"Last-Event-ID": str(last)} if last is not None else {}
            got = False
            try:
                async with self.http.stream(
                    "GET", f"/v1/sessions/{session}/events", params=params, headers=headers
                ) as r:
                    if r.status_code >= 400:
                        raise _refused(r, await r.aread())
                    async for item in _sse(r):
                        if item.type == "caught_up" and until_caught_up:
                            return  # all that was stored has come
                        if item.type == "cut":
                            break  # fell behind: resume after the last id
                        got = True
                        if item.seq is not None:
                            last = item.seq
                        yield item
            except httpx.HTTPError as exc:
                fruitless = 0 if got else fruitless + 1
                if fruitless > self.RETRIES:
                    raise RemoteError(f"the gateway's event stream keeps failing: {exc}") from None
                await asyncio.sleep(0.2 * fruitless)
                continue
            fruitless = 0 if got else fruitless + 1
            if fruitless > self.RETRIES:
                raise RemoteError("the gateway's event stream keeps ending with nothing new")


def _refused(r: httpx.Response, body: bytes) -> RemoteError:
    try:
        error = msgspec.json.decode(body)["error"]
        code, message = str(error.get("code", "")), str(error.get("message", ""))
    except (msgspec.DecodeError, KeyError, TypeError, AttributeError):
        code, message = "", body.decode(errors="replace")[:300]
    return RemoteError(
        f"the gateway answered {r.status_code} {code}: {message}", status=r.status_code, code=code
    )


async def _sse(r: httpx.Response) -> AsyncIterator[Item]:
    """The messages of an SSE response as items."""
    kind: str = "message"
    seq: int | None = None
    data: list[str] = []
    async for line in r.aiter_lines():
        if line == "":
            if data:
                yield Item(seq, kind, "\n".join(data).encode())
            kind, seq, data = "message", None, []
        elif line.startswith(":"):
            continue  # keep-alive
        else:
            name, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if name == "event":
                kind = value
            elif name == "id" and value.isdigit():
                seq = int(value)
            elif name == "data":
                data.append(value)
