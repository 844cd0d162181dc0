"""Signing a delivery, the Standard Webhooks way (https://www.standardwebhooks.com).

Each POST carries three headers::

    webhook-id:        <stored>-<sequence>: when the events stream stored the event
                       (Unix µs) and its sequence (the same on every try)
    webhook-timestamp: when this try was signed, in Unix seconds
    webhook-signature: v1,<base64 of HMAC-SHA256(key, "<id>.<timestamp>.<body>")>

where ``key`` is the base64-decoded part of the tenant's ``whsec_...`` secret after the
prefix, and ``body`` the request's body, byte for byte. A receiver recomputes the HMAC,
compares it in constant time, refuses a timestamp more than a few minutes from its own
clock (a replayed request is refused once it is that old) and drops a ``webhook-id`` it
has seen (a retry after a success it could not answer). docs/WEBHOOKS.md has the
receiver's code; the ``standardwebhooks`` package verifies the same signatures.

The signature itself is the reference library's (``standardwebhooks``), not ours.
"""

from __future__ import annotations

import datetime as dt
import functools

from standardwebhooks.webhooks import Webhook as _Signer

from schemas.webhook import ID_HEADER, SIGNATURE_HEADER, TIMESTAMP_HEADER


@functools.lru_cache(maxsize=1024)
def _signer(secret: str) -> _Signer:
    return _Signer(secret)


def signed_headers(secret: str, msg_id: str, body: bytes, now: float) -> dict[str, str]:
    """The three headers of a delivery of ``body`` with id ``msg_id``, signed at ``now``
    (Unix seconds) with ``secret`` (``whsec_...``)."""
    stamp = dt.datetime.fromtimestamp(int(now), tz=dt.UTC)
    signature = _signer(secret).sign(msg_id, stamp, body.decode("utf-8"))
    return {
        ID_HEADER: msg_id,
        TIMESTAMP_HEADER: str(int(now)),
        SIGNATURE_HEADER: signature,
    }
