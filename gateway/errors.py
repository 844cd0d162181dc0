"""Errors of the gateway. Each is an HTTP answer: a status, a stable code, a message a
person can act on and, for a bad field, its path.

GatewayError                     (``.status``, ``.code``, ``.message``, ``.field``)
├── BadRequest         400       malformed JSON or a field of the wrong type
├── Unauthorized       401       no key, or a key that matches none
├── NotFound           404       no such session (in this tenant), route or call
├── Conflict           409       the session exists already
│   └── Busy           409       a turn with ``on_busy: reject`` while one runs
├── PayloadTooLarge    413       the body is over ``max_body_bytes``
├── Unprocessable      422       a value out of bounds, a hostile id
├── RateLimited        429       over the key's rate (``.retry_after``) or stream cap
│   ├── BacklogFull      429       the tenant has as many turns waiting as it may
│   └── QuotaExceeded    429       the tenant has as many schedules as it may
└── Unavailable        503       NATS did not answer in time
"""

from __future__ import annotations


class GatewayError(Exception):
    status = 500
    code = "internal"

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


class BadRequest(GatewayError):
    status, code = 400, "bad_request"


class Unauthorized(GatewayError):
    status, code = 401, "unauthorized"


class NotFound(GatewayError):
    status, code = 404, "not_found"


class Conflict(GatewayError):
    status, code = 409, "conflict"


class Busy(Conflict):
    code = "session_busy"


class PayloadTooLarge(GatewayError):
    status, code = 413, "payload_too_large"


class Unprocessable(GatewayError):
    status, code = 422, "invalid"


class RateLimited(GatewayError):
    status, code = 429, "rate_limited"

    def __init__(self, message: str, *, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class BacklogFull(RateLimited):
    """The tenant has as many turns waiting as it may (``[tenants] max_backlog``): a
    turn is taken again once some have run."""

    code = "backlog_full"


class QuotaExceeded(RateLimited):
    """A count the tenant may not pass: waiting does not help (no ``Retry-After``),
    deleting one does."""

    code = "quota_exceeded"


class Unavailable(GatewayError):
    status, code = 503, "unavailable"
