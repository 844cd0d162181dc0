"""Publishes and direct gets whose answers are futures, on one inbox.

nats-py's ``js.publish`` is a request per message (a fresh token, an
``asyncio.wait_for``, ``json.loads`` and a dataclass per ack). A worker publishes a
dozen messages per iteration (events, checkpoints, the tool call, effect records), so
it uses :class:`Publisher` instead: one wildcard subscription (``<inbox>.*``) receives
every ack and reply, a counter names them, and acks are decoded by msgspec::

    publisher = Publisher(nc)
    ack = await publisher.publish(subject, payload, {"Nats-Msg-Id": msg_id})
    ...  # the message is on its way; do something else
    seq = (await ack).seq  # raises nats.js.errors.APIError if JetStream refused it

A future is never resolved when its answer is lost (a reconnect); callers bound their
waits (:func:`acked`, :func:`answered`, :func:`settled`) and publish again under the
same ``Nats-Msg-Id`` (or with a revision check), as they would after a timed-out
request. Errors are nats-py's own exception types, so :func:`~loopmesh.retry.retry`
treats them as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from .aio import quietly
from .retry import IN_PROCESS_ERR_CODE

_SWEEP_EVERY = 4096  # publishes between drops of abandoned (cancelled) futures

#: What a duplicate ack of sequence 0 (nats-server 2.10) means: the error 2.11+ send.
IN_PROCESS: dict[str, Any] = {
    "code": 409,
    "err_code": IN_PROCESS_ERR_CODE,
    "description": "duplicate message id is in process (acked as a duplicate of sequence 0)",
}


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
            await quietly(sub.unsubscribe())
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

    async def next_msg(
        self, stream: str, subject: str, seq: int, *, timeout: float = 5.0
    ) -> tuple[int, bytes] | None:
        """The first message of ``subject`` at or after sequence ``seq``, as the stream's
        leader has it: its sequence and data, or ``None`` when there is none."""
        query: dict[str, str | int] = {"seq": seq, "next_by_subj": subject}
        found = await self._leader_get(stream, query, timeout, _decode_get_whole)
        if not isinstance(found, _StoredMsg):
            return None
        return found.seq, found.data

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
        query: dict[str, str | int],
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
        error = reply.error
        if error is None and reply.duplicate and not reply.seq:
            error = IN_PROCESS  # nats-server 2.10: a first copy proposed (or lost), not stored
        if error is not None:
            try:
                _raise(error)
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
