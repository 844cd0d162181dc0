"""The effects bucket: a finished call's :class:`~schemas.ToolResult` by call id.

The record is the source of truth for a call: a worker writes it before acking the
request, so a redelivered or repeated request returns it instead of running the tool
again, and a requester whose inbox died can read (or watch) the key for the result.

Both operations are single NATS round trips on the hot path: a get is one direct (or
stream API) get of the key's last message, a put is one JetStream publish to the key's
subject whose acknowledgement comes back through :class:`Publisher` (so a caller can
do other things, such as replying, while the store confirms). A get can be started
before its answer is needed (:meth:`Effects.lookup`): the service sends it as a request
is delivered and decodes and validates the request meanwhile.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from schemas import DecodeError, Subjects, ToolResult, decode


class StoreError(Exception):
    """JetStream refused a publish (``.description`` is the server's text)."""

    def __init__(self, subject: str, description: str) -> None:
        super().__init__(f"JetStream did not store {subject}: {description}")
        self.subject = subject
        self.description = description


class _PubAck(msgspec.Struct):
    error: dict[str, Any] | None = None
    duplicate: bool = False


_decode_ack = msgspec.json.Decoder(_PubAck).decode


class Publisher:
    """JetStream publishes whose acks are futures, and requests whose replies are
    futures, resolved by one wildcard subscription (lighter than nats-py's request)."""

    def __init__(self, nc: Client) -> None:
        self._nc = nc
        self._prefix = nc.new_inbox() + "."
        self._seq = itertools.count()
        self._pending: dict[str, tuple[str, asyncio.Future[None]]] = {}
        self._requests: dict[str, asyncio.Future[Msg]] = {}
        self._sub: Subscription | None = None
        self._idle = asyncio.Event()
        self._idle.set()

    async def start(self) -> None:
        if self._sub is None:
            self._sub = await self._nc.subscribe(self._prefix + "*", cb=self._on_ack)

    async def close(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None:
            await sub.unsubscribe()
        for subject, future in self._pending.values():
            if not future.done():
                future.set_exception(StoreError(subject, "no acknowledgement before close"))
        self._pending.clear()
        for request in list(self._requests.values()):
            request.cancel()
        self._idle.set()

    async def publish(
        self, subject: str, payload: bytes, headers: dict[str, str] | None = None
    ) -> asyncio.Future[None]:
        """Publish now; the future completes when JetStream has stored the message."""
        token = str(next(self._seq))
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending[token] = (subject, future)
        self._idle.clear()
        await self._nc.publish(subject, payload, reply=self._prefix + token, headers=headers)
        return future

    async def request(self, subject: str, payload: bytes = b"") -> asyncio.Future[Msg]:
        """Send a request now; the future completes with the reply. The caller bounds
        the wait (and cancels the future when it gives up)."""
        token = "r" + str(next(self._seq))
        future: asyncio.Future[Msg] = asyncio.get_running_loop().create_future()
        self._requests[token] = future
        future.add_done_callback(lambda _: self._requests.pop(token, None))
        await self._nc.publish(subject, payload, reply=self._prefix + token)
        return future

    @property
    def pending(self) -> int:
        return len(self._pending)

    async def wait_idle(self) -> None:
        await self._idle.wait()

    async def _on_ack(self, msg: Msg) -> None:
        token = msg.subject[len(self._prefix) :]
        if token[:1] == "r":
            request = self._requests.pop(token, None)
            if request is not None and not request.done():
                request.set_result(msg)
            return
        entry = self._pending.pop(token, None)
        if not self._pending:
            self._idle.set()
        if entry is None:
            return
        subject, future = entry
        if future.done():
            return
        if msg.headers and msg.headers.get("Status") == "503":
            future.set_exception(StoreError(subject, "no stream listens on the subject"))
            return
        try:
            ack = _decode_ack(msg.data)
        except msgspec.DecodeError:
            future.set_exception(StoreError(subject, f"unreadable acknowledgement {msg.data!r}"))
            return
        if ack.error:
            future.set_exception(StoreError(subject, str(ack.error.get("description", ack.error))))
        else:
            future.set_result(None)


class Effects:
    def __init__(
        self, nc: Client, publisher: Publisher, bucket: str, *, direct: bool, timeout: float = 5.0
    ) -> None:
        self._nc = nc
        self._publisher = publisher
        self._stream = f"KV_{bucket}"
        self._pre = f"$KV.{bucket}."
        self._direct = direct
        self._timeout = timeout

    @classmethod
    async def open(cls, nc: Client, publisher: Publisher, subjects: Subjects) -> Effects:
        bucket = subjects.effects_bucket
        info = await nc.jetstream().stream_info(f"KV_{bucket}")
        return cls(nc, publisher, bucket, direct=bool(info.config.allow_direct))

    async def get(self, call_id: str) -> tuple[ToolResult, bytes] | None:
        """The recorded result of ``call_id`` and its encoded form, or None."""
        return await self.result(await self.lookup(call_id))

    async def lookup(self, call_id: str) -> asyncio.Future[Msg]:
        """Start reading ``call_id``'s record; :meth:`result` reads the answer."""
        subject = self._pre + call_id
        if self._direct:
            return await self._publisher.request(f"$JS.API.DIRECT.GET.{self._stream}.{subject}")
        return await self._publisher.request(
            f"$JS.API.STREAM.MSG.GET.{self._stream}", b'{"last_by_subj":"%s"}' % subject.encode()
        )

    async def result(self, lookup: asyncio.Future[Msg]) -> tuple[ToolResult, bytes] | None:
        """The record a :meth:`lookup` found, or None; raises ``TimeoutError``."""
        try:
            async with asyncio.timeout(self._timeout):
                msg = await lookup
        finally:
            lookup.cancel()
        value: bytes | None
        if self._direct:
            if msg.headers and msg.headers.get("Status"):
                if msg.headers["Status"] == "404":
                    return None  # no such key
                raise StoreError(self._stream, f"direct get answered {msg.headers['Status']}")
            if msg.headers and msg.headers.get("KV-Operation"):
                return None  # deleted or purged
            value = msg.data
        else:
            value = _stream_msg_value(msg.data)
        if not value:
            return None
        try:
            return decode(value, ToolResult), value
        except DecodeError:
            return None  # an unreadable record is no record: the call runs again

    async def put(self, call_id: str, encoded: bytes) -> asyncio.Future[None]:
        """Publish ``encoded`` under ``call_id``; the future completes once it is stored."""
        return await self._publisher.publish(self._pre + call_id, encoded)


class _StoredMsg(msgspec.Struct):
    data: bytes = b""  # base64 in JSON; msgspec decodes it
    hdrs: bytes = b""


class _MsgGetResponse(msgspec.Struct):
    message: _StoredMsg | None = None
    error: dict[str, Any] | None = None


_decode_get = msgspec.json.Decoder(_MsgGetResponse).decode


def _stream_msg_value(data: bytes) -> bytes | None:
    response = _decode_get(data)
    if response.error is not None:
        if response.error.get("code") == 404:
            return None
        raise StoreError("effects", str(response.error.get("description", response.error)))
    message = response.message
    if message is None or b"KV-Operation" in message.hdrs:
        return None  # a delete or purge marker
    return message.data
