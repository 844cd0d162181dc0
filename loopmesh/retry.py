"""Retrying through a reconnect.

While the client reconnects (a nats-server restart, a network blip), requests time out
or find no responders, and JetStream answers 503 for a moment after it comes back.
:func:`retry` repeats an operation on those errors (:func:`is_transient`), with
backoff, until a deadline; every other error is raised at once. Operations retried this
way must be idempotent: publishes carry a ``Nats-Msg-Id``, KV writes check revisions.

    kv = await retry(lambda: js.key_value(bucket), f"open bucket {bucket}", timeout=30)
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import nats.errors
import nats.js.errors

log = logging.getLogger("loopmesh.retry")

T = TypeVar("T")

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


#: "duplicate message id is in process": a message whose ``Nats-Msg-Id`` the stream's
#: leader has seen but not stored. nats-server 2.11+ says so with this error; 2.10 acks
#: it as a duplicate of sequence 0 (:class:`~loopmesh.publisher.Publisher` turns that
#: into this error). A leader that lost its leadership with the first copy still
#: proposed kept the id (2.10 until the duplicate window passes), so acking such a copy
#: as stored lost it: it is transient, published again until the stream stores it or
#: truly has it.
IN_PROCESS_ERR_CODE = 10158


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` may go away by itself once the connection is back."""
    if isinstance(exc, _TRANSIENT):
        return True
    if isinstance(exc, nats.js.errors.APIError):
        if getattr(exc, "err_code", None) == IN_PROCESS_ERR_CODE:
            return True  # its first copy is still proposed, or was lost with a leader
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
