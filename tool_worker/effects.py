"""The effects bucket: a finished call's :class:`~schemas.ToolResult` by call id.

The record is the source of truth for a call: a worker writes it before acking the
request, so a redelivered or repeated request returns it instead of running the tool
again, and a requester whose inbox died can read (or watch) the key for the result.

Both operations are single NATS round trips on the hot path: a get is one direct (or
stream API) get of the key's last message, a put is one JetStream publish to the key's
subject whose acknowledgement comes back through the shared
:class:`~loopmesh.jetstream.Publisher` (so a caller can
do other things, such as replying, while the store confirms). A get can be started
before its answer is needed (:meth:`Effects.lookup`): the service sends it as a request
is delivered and decodes and validates the request meanwhile.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg

from loopmesh.jetstream import PubAck, Publisher, acked, is_transient, replicated, retry, settled
from schemas import DecodeError, Subjects, ToolResult, decode


class StoreError(Exception):
    """The effects bucket answered a read with an error (``.description`` is the
    server's text). A refused write fails its future with nats-py's ``APIError``."""

    def __init__(self, subject: str, description: str) -> None:
        super().__init__(f"JetStream did not store {subject}: {description}")
        self.subject = subject
        self.description = description


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
        bucket = subjects.effects_bucket  # a worker starting while a node does waits for it
        info = await retry(lambda: nc.jetstream().stream_info(f"KV_{bucket}"), "effects info")
        # A follower may answer a direct get before it has the record a crashed worker
        # wrote: on a replicated bucket the leader answers (docs/ARCHITECTURE.md).
        direct = bool(info.config.allow_direct) and not replicated(info)
        return cls(nc, publisher, bucket, direct=direct)

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

    async def put(self, call_id: str, encoded: bytes) -> asyncio.Future[PubAck]:
        """Publish ``encoded`` under ``call_id``; the future completes once it is stored."""
        return await self._publisher.publish(self._pre + call_id, encoded)

    async def stored(
        self, call_id: str, encoded: bytes, first: asyncio.Future[PubAck], *, timeout: float
    ) -> None:
        """Until the record :meth:`put` published is stored, publishing it again while
        that fails for a passing reason (its ack lost in a reconnect, a stream electing
        its leader), for up to ``timeout`` seconds. A call that ran is then not run
        again for want of its record. Raises what is not passing, or the last error."""
        deadline = time.monotonic() + timeout
        try:
            await settled(first, min(self._timeout, timeout))
            return
        except Exception as exc:
            if not (isinstance(exc, TimeoutError) or is_transient(exc)):
                raise
        first.cancel()
        await retry(
            lambda: acked(self._publisher, self._pre + call_id, encoded),
            f"record effect {call_id}",
            timeout=max(0.1, deadline - time.monotonic()),
        )


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
