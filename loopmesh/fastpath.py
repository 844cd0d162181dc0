"""NATS on the hot path, for a fraction of what nats-py's general API costs.

**Publishing.**
nats-py's ``publish`` validates the subject with a regular expression, builds header
bytes key by key (another expression per key), formats the command, and, when its
flusher is idle, wakes it with a fresh future through an ``asyncio.Queue``: about 9 µs
a message with a header here. A loop worker publishes some 25 messages per turn (events,
checkpoints, acks, the tool call), so :func:`publish` writes the command into the
client's pending buffer itself and wakes the flusher with a finished future::

    publish(nc, subject, payload, reply=inbox, headers={"Nats-Msg-Id": msg_id})

It takes subjects built from checked tokens (``schemas.subjects``) and refuses header
keys or values that could break the protocol line. Whenever the fast path does not
apply (not connected, a buffer near its limit, a client without the attributes it
relies on), it returns ``False`` and the caller awaits ``Client.publish``, which buffers
across reconnects and raises nats-py's own errors: :func:`publish_async` does both.

**Receiving.** A subscription with a callback hands each message to a task through an
``asyncio.Queue``: a task wake-up per message. :func:`subscribe_inline` subscribes with
nats-py's ``future=`` parameter (how it waits for a single reply) and a stand-in whose
``set_result`` calls a plain function at once, inside the client's read loop, for every
message::

    sub = await subscribe_inline(nc, inbox + ".*", on_reply)  # on_reply(msg) -> None

The handler must be quick and must not block; what it raises is logged, never passed
to the read loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

log = logging.getLogger("loopmesh.fastpath")

_HEADER_LINE = b"NATS/1.0\r\n"


class _Kick:
    """What wakes nats-py's flusher: it takes a future from its queue, writes what is
    pending and resolves the future unless it is done. This one always is."""

    def done(self) -> bool:
        return True


_KICK = _Kick()


_RELIED_ON = (
    "_pending",
    "_pending_data_size",
    "_flush_queue",
    "_max_pending_size",
    "_flusher_task",
)


def _unsafe(text: str) -> bool:
    return "\r" in text or "\n" in text


def _plain(subject: str) -> bool:
    """No whitespace or control character: nothing that could break the protocol line."""
    return bool(subject) and subject.isprintable() and " " not in subject


_CLIENTS: dict[type, bool] = {}  # client class -> has what the fast path relies on


def _supported(nc: Client) -> bool:
    known = _CLIENTS.get(type(nc))
    if known is None:
        known = _CLIENTS[type(nc)] = all(hasattr(nc, name) for name in _RELIED_ON)
    flusher = nc._flusher_task if known else None
    return flusher is not None and not flusher.done()


def header_bytes(headers: Mapping[str, str]) -> bytes:
    """NATS header block for ``headers``; ``ValueError`` on a CR or LF, or a ':' in a key."""
    parts = [_HEADER_LINE]
    for key, value in headers.items():
        if not key or ":" in key or " " in key or _unsafe(key) or _unsafe(value):
            raise ValueError(f"header {key!r}: {value!r} cannot be sent")
        parts.append(f"{key}: {value}\r\n".encode())
    parts.append(b"\r\n")
    return b"".join(parts)


def msg_id_header(msg_id: str) -> bytes:
    """The header block of a message whose only header is ``Nats-Msg-Id``."""
    if "\r" in msg_id or "\n" in msg_id:
        raise ValueError(f"message id {msg_id!r} cannot be sent")
    return b"NATS/1.0\r\nNats-Msg-Id: " + msg_id.encode() + b"\r\n\r\n"


def publish(
    nc: Client,
    subject: str,
    payload: bytes,
    *,
    reply: str = "",
    headers: Mapping[str, str] | None = None,
    header: bytes | None = None,
) -> bool:
    """Queue the message for the client's flusher; ``False`` if the caller must use
    ``Client.publish`` instead (nothing was queued then). ``header`` is a header block
    already built (:func:`header_bytes`, :func:`msg_id_header`), in place of ``headers``."""
    if not _plain(subject) or (reply and not _plain(reply)):
        return False  # let nats-py refuse it, with its error
    if not nc.is_connected or not _supported(nc):
        return False
    hdr = header if header is not None else header_bytes(headers) if headers else None
    if hdr is not None:
        size = len(hdr) + len(payload)
        cmd = b"HPUB %b %b %d %d\r\n%b%b\r\n" % (
            subject.encode(), reply.encode(), len(hdr), size, hdr, payload
        )  # fmt: skip
    else:
        cmd = b"PUB %b %b %d\r\n%b\r\n" % (subject.encode(), reply.encode(), len(payload), payload)
    limit = nc._max_pending_size
    if limit > 0 and nc._pending_data_size + len(cmd) > limit:
        return False  # nats-py flushes, waits, or refuses as it does
    if len(payload) > nc.max_payload:
        return False  # nats-py raises MaxPayloadError
    nc._pending.append(cmd)
    nc._pending_data_size += len(cmd)
    nc.stats["out_msgs"] += 1
    nc.stats["out_bytes"] += len(payload)
    queue = nc._flush_queue
    if queue is not None and queue.empty():
        queue.put_nowait(_KICK)  # type: ignore[arg-type]  # a finished future, as far as it looks
    return True


async def publish_async(
    nc: Client,
    subject: str,
    payload: bytes,
    *,
    reply: str = "",
    headers: Mapping[str, str] | None = None,
) -> None:
    """:func:`publish`, else ``Client.publish`` (which buffers while reconnecting)."""
    if not publish(nc, subject, payload, reply=reply, headers=headers):
        await nc.publish(subject, payload, reply=reply, headers=dict(headers or {}))


class _Inline:
    """What ``Client._process_msg`` takes for a request's future: it checks
    ``cancelled()`` and calls ``set_result(msg)`` for each message of the subscription."""

    def __init__(self, handler: Callable[[Msg], None]) -> None:
        self._handler = handler

    def __bool__(self) -> bool:
        return True

    def cancelled(self) -> bool:
        return False

    def done(self) -> bool:
        return False

    def set_result(self, msg: Msg) -> None:
        try:
            self._handler(msg)
        except Exception:
            log.exception("message handler failed subject=%s", msg.subject)


async def subscribe_inline(
    nc: Client, subject: str, handler: Callable[[Msg], None]
) -> Subscription:
    """Subscribe ``handler`` to ``subject``; it runs inside the read loop, per message."""
    return await nc.subscribe(subject, future=_Inline(handler))  # type: ignore[arg-type]
