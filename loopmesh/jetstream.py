"""JetStream plumbing that the loop and tool workers share.

**Publishes and direct gets whose answers are futures, on one inbox.** nats-py's
``js.publish`` is a request per message (a fresh token, an ``asyncio.wait_for``,
``json.loads`` and a dataclass per ack). A worker publishes a dozen messages per
iteration (events, checkpoints, the tool call, effect records), so it uses
:class:`Publisher` instead: one wildcard subscription (``<inbox>.*``) receives every
ack and reply, a counter names them, and acks are decoded by msgspec::

    publisher = Publisher(nc)
    ack = await publisher.publish(subject, payload, {"Nats-Msg-Id": msg_id})
    ...  # the message is on its way; do something else
    seq = (await ack).seq  # raises nats.js.errors.APIError if JetStream refused it

A future is never resolved when its answer is lost (a reconnect); callers bound their
waits (:func:`acked`, :func:`answered`, :func:`settled`) and publish again under the
same ``Nats-Msg-Id`` (or with a revision check), as they would after a timed-out
request. Errors are nats-py's own exception types, so :func:`retry` treats them as
before. :class:`KV` is the hot-path operations of one KV bucket on a publisher.

**Retrying through a reconnect.** While the client reconnects (a nats-server restart, a
network blip), requests time out or find no responders, and JetStream answers 503 for
a moment after it comes back. :func:`retry` repeats an operation on those errors
(:func:`is_transient`), with backoff, until a deadline; every other error is raised at
once. Operations retried this way must be idempotent: publishes carry a
``Nats-Msg-Id``, KV writes check revisions.

**Small helpers.** :func:`worker_name` names a worker process (its consumer name, its
lease holder); :func:`kv_values` reads a KV bucket whole; :func:`quietly` awaits an
ack, nak or flush whose failure changes nothing.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import secrets
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, StreamInfo
from nats.js.client import JetStreamContext

log = logging.getLogger("loopmesh.jetstream")

T = TypeVar("T")

_SWEEP_EVERY = 4096  # publishes between drops of abandoned (cancelled) futures


class PubAck(msgspec.Struct):
    stream: str = ""
    seq: int = 0
    duplicate: bool = False
    error: dict[str, Any] | None = None


_decode_ack = msgspec.json.Decoder(PubAck).decode


class _StoredSeq(msgspec.Struct):
    seq: int = 0


class _StoredMsg(_StoredSeq):
    data: bytes = b""  # base64 in JSON; msgspec decodes it
    hdrs: bytes = b""


class _MsgGet(msgspec.Struct):
    message: _StoredSeq | None = None  # only the sequence is decoded
    error: dict[str, Any] | None = None


class _MsgGetWhole(msgspec.Struct):
    message: _StoredMsg | None = None
    error: dict[str, Any] | None = None


_decode_get = msgspec.json.Decoder(_MsgGet).decode
_decode_get_whole = msgspec.json.Decoder(_MsgGetWhole).decode


class Publisher:
    """Publishes to JetStream and sends requests; answers arrive on one subscription."""

    def __init__(self, nc: Client) -> None:
        self._nc = nc
        self._prefix = ""
        self._n = 0
        self._waiting: dict[str, tuple[asyncio.Future[Any], bool]] = {}
        self._sub: Subscription | None = None
        self._starting: asyncio.Lock | None = None
        self._unacked = 0  # publishes whose ack has not arrived (nor been given up on)
        self._idle: asyncio.Event | None = None

    async def start(self) -> None:
        if self._sub is not None:
            return
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if self._sub is None:
                prefix = self._nc.new_inbox() + "."
                self._sub = await self._nc.subscribe(prefix + "*", cb=self._on_reply)
                self._prefix = prefix

    async def close(self) -> None:
        """Unsubscribe and fail what is still waiting. Idempotent."""
        sub, self._sub = self._sub, None
        if sub is not None:
            try:
                await sub.unsubscribe()
            except Exception:
                pass
        waiting, self._waiting = self._waiting, {}
        for future, _ in waiting.values():
            if not future.done():
                future.cancel()
        self._unacked = 0
        if self._idle is not None:
            self._idle.set()

    @property
    def nc(self) -> Client:
        """The connection this publisher sends on."""
        return self._nc

    @property
    def pending(self) -> int:
        """Publishes whose ack has not arrived yet."""
        return self._unacked

    async def wait_idle(self) -> None:
        """Until no publish waits for its ack (the caller bounds the wait)."""
        self._sweep()
        if self._unacked == 0:
            return
        if self._idle is None:
            self._idle = asyncio.Event()
        self._idle.clear()
        await self._idle.wait()

    def _forget(self, token: str) -> tuple[asyncio.Future[Any], bool] | None:
        entry = self._waiting.pop(token, None)
        if entry is not None and entry[1]:
            self._unacked -= 1
            if self._unacked == 0 and self._idle is not None:
                self._idle.set()
        return entry

    async def publish(
        self, subject: str, payload: bytes, headers: dict[str, str] | None = None
    ) -> asyncio.Future[PubAck]:
        """Publish now; the future resolves with JetStream's ack (or its refusal)."""
        return await self._send(subject, payload, headers, True)

    async def request(
        self, subject: str, payload: bytes = b"", headers: dict[str, str] | None = None
    ) -> asyncio.Future[Msg]:
        """Send a request now; the future resolves with the reply."""
        return await self._send(subject, payload, headers, False)

    async def _send(
        self, subject: str, payload: bytes, headers: dict[str, str] | None, ack: bool
    ) -> asyncio.Future[Any]:
        if self._sub is None:
            await self.start()
        self._n += 1
        if self._n % _SWEEP_EVERY == 0:
            self._sweep()
        token = str(self._n)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting[token] = (future, ack)
        if ack:
            self._unacked += 1
        try:
            await self._nc.publish(subject, payload, reply=self._prefix + token, headers=headers)
        except BaseException:
            self._forget(token)
            raise
        return future

    async def direct_get(self, stream: str, subject: str, *, timeout: float = 5.0) -> Msg | None:
        """The last message of ``subject`` (a direct get: the stream must allow it), or
        ``None`` when there is none."""
        future = await self.request(f"$JS.API.DIRECT.GET.{stream}.{subject}")
        msg = await _within(future, timeout)
        status = msg.headers.get("Status") if msg.headers else None
        if status is None:
            return msg
        if status == "404":
            return None
        if status == "503":
            raise nats.errors.NoRespondersError
        raise nats.js.errors.APIError(code=int(status), description=msg.headers.get("Description"))

    async def first_seq(self, stream: str, subject: str, *, timeout: float = 5.0) -> int | None:
        """The sequence of the first message of ``subject`` in ``stream``, or ``None``."""
        found = await self._leader_get(stream, {"next_by_subj": subject}, timeout, _decode_get)
        return found.seq if found is not None else None

    async def leader_get(self, stream: str, subject: str, *, timeout: float = 5.0) -> Msg | None:
        """The last message of ``subject``, as the stream's leader has it (the stream
        API; only the leader answers), or ``None``. Its ``Nats-Sequence`` header is set.

        A direct get may be answered by any replica, and a follower can be behind the
        leader: what must reflect every acknowledged write reads here."""
        found = await self._leader_get(
            stream, {"last_by_subj": subject}, timeout, _decode_get_whole
        )
        if not isinstance(found, _StoredMsg):
            return None
        headers = _parse_headers(found.hdrs)
        headers["Nats-Sequence"] = str(found.seq)
        return Msg(self._nc, subject=subject, data=found.data, headers=headers)

    async def _leader_get(
        self,
        stream: str,
        query: dict[str, str],
        timeout: float,
        decoder: Callable[[bytes], _MsgGet | _MsgGetWhole],
    ) -> _StoredSeq | None:
        future = await self.request(f"$JS.API.STREAM.MSG.GET.{stream}", msgspec.json.encode(query))
        msg = await _within(future, timeout)
        if msg.headers and msg.headers.get("Status") == "503":
            raise nats.errors.NoRespondersError
        reply = decoder(msg.data)
        if reply.error is not None:
            if reply.error.get("code") == 404:
                return None
            _raise(reply.error)
        return reply.message

    async def _on_reply(self, msg: Msg) -> None:
        entry = self._forget(msg.subject[len(self._prefix) :])
        if entry is None:
            return
        future, ack = entry
        if future.done():
            return
        if not ack:
            future.set_result(msg)
            return
        if msg.headers and msg.headers.get("Status") == "503":
            future.set_exception(nats.js.errors.NoStreamResponseError())
            return
        try:
            reply = _decode_ack(msg.data)
        except msgspec.DecodeError as exc:
            future.set_exception(nats.js.errors.APIError(description=f"bad ack: {exc}"))
            return
        if reply.error is not None:
            try:
                _raise(reply.error)
            except nats.js.errors.APIError as exc:
                future.set_exception(exc)
            return
        future.set_result(reply)

    def _sweep(self) -> None:
        """Forget futures their callers gave up on (their answers were lost)."""
        for token in [t for t, (f, _) in self._waiting.items() if f.done()]:
            self._forget(token)


def _parse_headers(raw: bytes) -> dict[str, str]:
    """``NATS/1.0\r\nKey: value\r\n...`` (a stored message's headers) as a dict."""
    headers: dict[str, str] = {}
    for line in raw.decode(errors="replace").split("\r\n")[1:]:
        key, sep, value = line.partition(":")
        if sep:
            headers[key.strip()] = value.strip()
    return headers


def _raise(error: dict[str, Any]) -> None:
    nats.js.errors.APIError.from_error(
        {"code": error.get("code", 500), "description": error.get("description"),
         "err_code": error.get("err_code")}
    )  # fmt: skip


async def _within(future: asyncio.Future[Any], timeout: float) -> Any:
    """``await future``, failing it with ``nats.errors.TimeoutError`` after ``timeout``
    (one timer, no task or timeout context: this runs several times per turn)."""
    if not future.done():
        timer = asyncio.get_running_loop().call_later(timeout, _expire, future)
        try:
            await future  # a cancel of the caller cancels the future too
        finally:
            timer.cancel()
    return future.result()


async def settled(future: asyncio.Future[Any], timeout: float) -> Any:
    """The result of ``future`` once it is done; ``TimeoutError`` after ``timeout``.
    Unlike :func:`_within`, neither the timeout nor a cancel of the caller touches
    ``future`` (``asyncio.wait_for(asyncio.shield(future))``, for less)."""
    if not future.done():
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()

        def wake(_: object = None) -> None:
            if not waiter.done():
                waiter.set_result(None)

        future.add_done_callback(wake)
        timer = loop.call_later(timeout, wake)
        try:
            await waiter
        finally:
            timer.cancel()
            future.remove_done_callback(wake)
        if not future.done():
            raise TimeoutError
    return future.result()


def _expire(future: asyncio.Future[Any]) -> None:
    if not future.done():
        future.set_exception(nats.errors.TimeoutError())


async def acked(
    publisher: Publisher,
    subject: str,
    payload: bytes,
    headers: dict[str, str] | None = None,
    *,
    timeout: float = 5.0,
) -> PubAck:
    """Publish and wait for the ack (``js.publish``); raises ``nats.errors.TimeoutError``."""
    return await _within(await publisher.publish(subject, payload, headers), timeout)


async def answered(
    publisher: Publisher, subject: str, payload: bytes = b"", *, timeout: float = 5.0
) -> Msg:
    """Send a request and wait for the reply (``nc.request``); raises
    ``nats.errors.TimeoutError``, or ``NoRespondersError`` when nobody listens."""
    msg: Msg = await _within(await publisher.request(subject, payload), timeout)
    if msg.headers and msg.headers.get("Status") == "503":
        raise nats.errors.NoRespondersError
    return msg


class KVEntry(msgspec.Struct, frozen=True):
    """A key's last revision: ``value`` is ``None`` for a delete or purge marker."""

    revision: int
    value: bytes | None


class KV:
    """The hot-path operations of one KV bucket through a :class:`Publisher`: a read is
    one get, a write one publish with a revision check.

    On a bucket with one replica a read is a direct get. With more (a cluster), a
    direct get may be answered by a follower that has not applied the last writes yet,
    so reads go to the stream's leader (``leader=True``, what :func:`open_kv` picks):
    a snapshot, a control or an effect record read stale could resume a turn from an
    old checkpoint or miss a recorded decision (docs/ARCHITECTURE.md, "On a cluster")."""

    def __init__(self, publisher: Publisher, bucket: str, *, leader: bool = False) -> None:
        self.publisher = publisher
        self.bucket = bucket
        self.stream = f"KV_{bucket}"
        self.prefix = f"$KV.{bucket}."
        self.leader = leader

    async def entry(self, key: str, *, timeout: float = 5.0) -> KVEntry | None:
        """The key's last revision (a delete marker included), or ``None``."""
        get = self.publisher.leader_get if self.leader else self.publisher.direct_get
        msg = await get(self.stream, self.prefix + key, timeout=timeout)
        if msg is None:
            return None
        headers = msg.headers or {}
        revision = int(headers.get("Nats-Sequence", 0))
        if headers.get("KV-Operation"):
            return KVEntry(revision, None)
        return KVEntry(revision, msg.data)

    async def update(self, key: str, value: bytes, last: int, *, timeout: float = 5.0) -> int:
        """Write ``value`` if ``last`` is the key's revision (0: no key); the new revision.
        Raises :class:`~nats.js.errors.KeyWrongLastSequenceError` otherwise."""
        headers = {"Nats-Expected-Last-Subject-Sequence": str(last)}
        return await self._write(key, value, headers, timeout)

    async def delete(self, key: str, last: int, *, timeout: float = 5.0) -> int:
        """Put a delete marker if ``last`` is the key's revision; the marker's revision."""
        headers = {"KV-Operation": "DEL", "Nats-Expected-Last-Subject-Sequence": str(last)}
        return await self._write(key, b"", headers, timeout)

    async def _write(self, key: str, value: bytes, headers: dict[str, str], timeout: float) -> int:
        try:
            ack = await acked(self.publisher, self.prefix + key, value, headers, timeout=timeout)
        except nats.js.errors.APIError as exc:
            if exc.err_code in WRONG_LAST_SEQUENCE:
                wrong = nats.js.errors.KeyWrongLastSequenceError(description=exc.description)
                raise wrong from None
            raise
        return ack.seq


async def open_kv(
    js: JetStreamContext, publisher: Publisher, bucket: str, *, timeout: float = 30.0
) -> KV:
    """A :class:`KV` of ``bucket`` (retrying through a reconnect): its reads go to the
    leader when the bucket has more than one replica."""
    kv = await retry(lambda: js.key_value(bucket), f"open bucket {bucket}", timeout=timeout)
    status = await retry(kv.status, f"bucket {bucket} status", timeout=timeout)
    await publisher.start()
    return KV(publisher, bucket, leader=replicated(status.stream_info))


def replicated(info: StreamInfo) -> bool:
    """Whether a stream keeps more than one replica (it runs on a cluster)."""
    return (info.config.num_replicas or 1) > 1


async def kv_values(
    js: JetStreamContext, bucket: str, keys: str = ">", *, timeout: float = 5.0
) -> dict[str, bytes]:
    """Every live key matching ``keys`` in ``bucket`` with its value, as of the call.

    A consumer that starts at each key's last revision, whose creation says how many
    messages it has to deliver, fetched until that many are in. (A KV watch cannot say
    when its initial values are in: nats-py marks them done early when the server has
    already pushed every value to a busy client.) Keys whose last revision lapses while
    being read are left out."""
    stream, prefix = f"KV_{bucket}", f"$KV.{bucket}."
    config = ConsumerConfig(
        name=f"snapshot-{secrets.token_hex(8)}",
        filter_subject=prefix + keys,
        deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
        ack_policy=AckPolicy.NONE,
        mem_storage=True,
        inactive_threshold=max(timeout, 5.0),
    )
    info = await js.add_consumer(stream, config)
    values: dict[str, bytes] = {}
    try:
        pending = info.num_pending or 0
        sub = await js.pull_subscribe_bind(consumer=info.name, stream=stream)
        try:
            while pending > 0:
                try:
                    msgs = await sub.fetch(min(pending, 256), timeout=timeout)
                except nats.errors.TimeoutError:
                    break  # the rest lapsed
                for msg in msgs:
                    pending = min(pending - 1, msg.metadata.num_pending)
                    key = msg.subject[len(prefix) :]
                    headers = msg.headers or {}
                    if headers.get("KV-Operation") or headers.get("Nats-Marker-Reason"):
                        values.pop(key, None)
                    else:
                        values[key] = msg.data
        finally:
            await quietly(sub.unsubscribe())
    finally:
        await quietly(js.delete_consumer(stream, info.name))
    return values


async def ordered_subscribe(
    nc: Client, subject: str, *, js: JetStreamContext | None = None, **kwargs: Any
) -> JetStreamContext.PushSubscription:
    """``js.subscribe(subject, ordered_consumer=True, **kwargs)``, returned once the
    server holds the subscription to the consumer's deliver subject.

    nats-py creates the ephemeral consumer first and then only queues the SUB. When the
    process does not get to write it for five seconds (a loaded machine, a slow import
    right after), the server deletes the consumer as having no interest, and nothing is
    ever delivered to the subscription. The flush closes that window."""
    sub = await (js or nc.jetstream()).subscribe(subject, ordered_consumer=True, **kwargs)
    await nc.flush()
    return sub


#: JetStream's error codes for a failed ``Nats-Expected-Last-Subject-Sequence`` check.
WRONG_LAST_SEQUENCE = (10071, 10164)


# -- retrying through a reconnect ---------------------------------------------------

_TRANSIENT: tuple[type[BaseException], ...] = (
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.StaleConnectionError,
    nats.errors.OutboundBufferLimitError,
    nats.js.errors.ServiceUnavailableError,
    nats.js.errors.NoStreamResponseError,
    asyncio.TimeoutError,
)


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` may go away by itself once the connection is back."""
    if isinstance(exc, _TRANSIENT):
        return True
    if isinstance(exc, nats.js.errors.APIError):
        return getattr(exc, "code", None) == 503  # JetStream not ready yet after a restart
    return False


async def retry(
    op: Callable[[], Awaitable[T]],
    what: str,
    *,
    timeout: float = 30.0,
    initial: float = 0.05,
    maximum: float = 1.0,
) -> T:
    """``await op()``, again on transient errors, until ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    delay = initial
    attempt = 1
    while True:
        try:
            return await op()
        except Exception as exc:
            if not is_transient(exc) or time.monotonic() + delay > deadline:
                raise
            if attempt == 2:
                log.warning("retrying %s error=%r", what, exc)
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))
            delay = min(delay * 2, maximum)
            attempt += 1


# -- small helpers ------------------------------------------------------------------


def worker_name() -> str:
    """``<host>-<pid>``: a worker process's default name."""
    return f"{socket.gethostname()}-{os.getpid()}"


async def quietly(op: Awaitable[object]) -> None:
    """``await op``, logging (at debug) instead of raising what it raises: for acks,
    naks and flushes whose failure the protocol already covers (a redelivery)."""
    try:
        await op
    except Exception as exc:
        log.debug("ignored error=%r", exc)
