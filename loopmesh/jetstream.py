"""JetStream plumbing that the loop and tool workers share, in one import.

Each concern has its own module; this one names them together (``from
loopmesh.jetstream import Publisher, KV, retry``) and keeps the two helpers that have no
other home:

- :mod:`loopmesh.publisher`: :class:`Publisher`, publishes and direct gets whose
  answers are futures on one inbox, and the bounded waits on them (:func:`acked`,
  :func:`answered`, :func:`settled`);
- :mod:`loopmesh.kv`: :class:`KV`, a bucket's hot-path reads and revision-checked
  writes on a publisher (:func:`open_kv`), :func:`kv_values`, a bucket read whole, and
  :class:`KeyWatch`, which wakes a key's waiters when it is deleted;
- :mod:`loopmesh.retry`: :func:`retry` an idempotent operation through a reconnect,
  on the errors :func:`is_transient` names;
- :func:`loopmesh.aio.quietly`: await an ack, nak or flush whose failure changes nothing;
- here: :func:`ordered_subscribe`, an ordered consumer's subscription the server
  surely holds, and :func:`worker_name`, a worker process's default name (its consumer
  name, its lease holder).
"""

from __future__ import annotations

import os
import socket
from typing import Any

from nats.aio.client import Client
from nats.js.client import JetStreamContext

from .aio import quietly
from .kv import (
    KV,
    WRONG_LAST_SEQUENCE,
    Deletions,
    KeyWatch,
    KVEntry,
    kv_entries,
    kv_values,
    open_kv,
    replicated,
)
from .publisher import PubAck, Publisher, acked, answered, settled
from .retry import IN_PROCESS_ERR_CODE, is_transient, retry

__all__ = [
    "IN_PROCESS_ERR_CODE",
    "KV",
    "WRONG_LAST_SEQUENCE",
    "Deletions",
    "KVEntry",
    "KeyWatch",
    "PubAck",
    "Publisher",
    "acked",
    "answered",
    "is_transient",
    "kv_entries",
    "kv_values",
    "open_kv",
    "ordered_subscribe",
    "quietly",
    "replicated",
    "retry",
    "settled",
    "worker_name",
]


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


def worker_name() -> str:
    """``<host>-<pid>``: a worker process's default name."""
    return f"{socket.gethostname()}-{os.getpid()}"
