"""What :class:`~loopmesh.client.Client` raises when loopmesh says no, or cannot be reached.

ClientError           base: ``.status`` (the gateway's HTTP status, 0 over NATS), ``.code``
├── TurnRefused       the turn will not run (``.turn_id``, ``.session``, ``.field``,
│                     ``.event`` and ``.end``: the ``error`` and ``loop_end`` that said so)
├── InvalidRequest    a request the gateway refused as malformed, or cannot take (``.field``)
├── Unauthorized      no key, a wrong key, NATS credentials refused
├── NotFound          no such session in the caller's tenant, no such agent (``.what``)
└── Unavailable       loopmesh cannot be reached, or cannot answer now (``.url``)
    ├── NotSetUp      NATS is there but loopmesh's streams are not (``.missing``)
    └── RateLimited   over the gateway key's rate (``.retry_after``, seconds)

Each message says what was wrong; a gateway's is ``the gateway answered <status> <code>:
<its message>``. Arguments the client checks itself (an id that cannot be a subject
token, an empty input, a setting the transport cannot carry) raise ``ValueError``
(:class:`~schemas.ids.InvalidIdError` for an id) before anything is sent, and settings
that are invalid raise :class:`~loopmesh.errors.ConfigError`. All of them but
``ValueError`` are :class:`~loopmesh.errors.LoopmeshError` s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from loopmesh.errors import LoopmeshError

if TYPE_CHECKING:
    from schemas.events import Error, LoopEnd


class ClientError(LoopmeshError):
    """Base class: ``.status`` is the gateway's HTTP status (0 over NATS), ``.code`` the
    gateway's or the refusal's code (``""`` where there is none)."""

    def __init__(self, message: str, *, status: int = 0, code: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code


class TurnRefused(ClientError):
    """The turn will not run. Through the gateway: its 409 (``session_busy``: the turn
    asked ``on_busy="reject"`` while another ran) or 422 (``invalid``: ``.field`` names
    what, e.g. ``agent`` for an agent nobody defined). Over either transport: the
    ``error`` event a loop worker published instead of starting the turn (``.code``:
    ``session_busy``, ``agent_mismatch``, ``unknown_agent``, ``invalid_message``...),
    kept in ``.event`` with the ``loop_end`` that followed it in ``.end``."""

    def __init__(
        self,
        message: str,
        *,
        turn_id: str,
        session: str,
        status: int = 0,
        code: str = "",
        field: str | None = None,
        event: Error | None = None,
        end: LoopEnd | None = None,
    ) -> None:
        super().__init__(message, status=status, code=code)
        self.turn_id = turn_id
        self.session = session
        self.field = field
        self.event = event
        self.end = end


class InvalidRequest(ClientError):
    """The gateway refused a request other than a turn as malformed or too large (400,
    413, 422), or the request is one it cannot take (cancelling a turn by its id);
    ``.field`` names the part, where known."""

    def __init__(
        self, message: str, *, status: int = 0, code: str = "", field: str | None = None
    ) -> None:
        super().__init__(message, status=status, code=code)
        self.field = field


class Unauthorized(ClientError):
    """The gateway wants a (valid) API key, or NATS refused the credentials."""


class NotFound(ClientError):
    """No such session in the caller's tenant (another tenant's is the same), or no such
    agent; ``.what`` is the path or name asked for."""

    def __init__(self, message: str, *, what: str, status: int = 0, code: str = "") -> None:
        super().__init__(message, status=status, code=code)
        self.what = what


class Unavailable(ClientError):
    """loopmesh at ``.url`` cannot be reached, or cannot answer now (the gateway's 503: it
    lost NATS); worth retrying later."""

    def __init__(self, message: str, *, url: str, status: int = 0, code: str = "") -> None:
        super().__init__(message, status=status, code=code)
        self.url = url


class NotSetUp(Unavailable):
    """NATS answers, but ``.missing`` (a stream, or JetStream itself) is not there: no
    loop worker, tool worker or ``loopmesh up`` has set loopmesh up on it yet."""

    def __init__(self, message: str, *, url: str, missing: str) -> None:
        super().__init__(message, url=url)
        self.missing = missing


class RateLimited(Unavailable):
    """The gateway's 429: over the key's rate, or too many event streams open at once;
    try again after ``.retry_after`` seconds (0 when it did not say)."""

    def __init__(
        self, message: str, *, url: str, retry_after: float, status: int = 429, code: str = ""
    ) -> None:
        super().__init__(message, url=url, status=status, code=code)
        self.retry_after = retry_after


__all__ = [
    "ClientError",
    "InvalidRequest",
    "NotFound",
    "NotSetUp",
    "RateLimited",
    "TurnRefused",
    "Unauthorized",
    "Unavailable",
]
