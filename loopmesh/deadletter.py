"""Dead-letter records: a message given up on, kept in the dead-letter stream with why.

Loop workers record turns given up on (``loop_worker/deadletter.py``), the webhooks
service records events whose delivery was given up on. A record is the message's body
unchanged, published to ``<prefix>.deadletter.<stream>`` with headers
``Loopmesh-Stream``, ``Loopmesh-Seq``, ``Loopmesh-Subject``, ``Loopmesh-Deliveries`` and
``Loopmesh-Reason`` (one line), and ``Nats-Msg-Id`` ``<stream>:<seq>``, so recording it
twice keeps one.
"""

from __future__ import annotations

from collections.abc import Mapping

from schemas import Subjects

from .jetstream import Publisher, acked, retry

REASON_CHARS = 512


async def record(
    publisher: Publisher,
    subjects: Subjects,
    *,
    stream: str,
    seq: int,
    subject: str,
    data: bytes,
    deliveries: int,
    reason: str,
    headers: Mapping[str, str] | None = None,
) -> None:
    """Store the dead-letter record of message ``seq`` of ``stream`` (retried while NATS
    is briefly unavailable); ``headers`` adds to the record's own."""
    sent = {
        "Nats-Msg-Id": f"{stream}:{seq}",
        "Loopmesh-Stream": stream,
        "Loopmesh-Seq": str(seq),
        "Loopmesh-Subject": subject,
        "Loopmesh-Deliveries": str(deliveries),
        "Loopmesh-Reason": one_line(reason),
        **(headers or {}),
    }
    where = subjects.deadletter(stream)
    await retry(lambda: acked(publisher, where, data, sent), f"dead-letter {stream} message {seq}")


def one_line(text: str) -> str:
    """``text`` on one line, at most :data:`REASON_CHARS` characters (a header value)."""
    return " ".join(text.split())[:REASON_CHARS]
