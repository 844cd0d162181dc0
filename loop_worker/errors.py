"""Errors of the durable loop-worker service (the engine's are in ``loop_worker.engine.errors``).

LoopWorkerError            (``loop_worker.engine.errors``)
├── LeaseLostError         the session lease expired or was taken over (``.key``)
├── LimiterError           the rate-limit leader refused an ask (a worker of another version)
└── BucketNotLoadedError   a watched bucket did not load in time (``.bucket``, ``.timeout_s``)
    ├── CatalogNotLoadedError  the tool catalog
    └── AgentsNotLoadedError   the named agents
"""

from __future__ import annotations

from .engine.errors import LoopWorkerError


class LeaseLostError(LoopWorkerError):
    def __init__(self, key: str, message: str = "") -> None:
        super().__init__(message or f"lost the lease of session {key}")
        self.key = key


class LimiterError(LoopWorkerError):
    """The rate-limit leader refused an ask (``[llm.limits]``): the message says why."""


class BucketNotLoadedError(LoopWorkerError):
    """A watched KV bucket's first load was not in within ``timeout_s``."""

    def __init__(
        self, what: str, bucket: str, timeout_s: float, last: BaseException | None, then: str
    ) -> None:
        why = f" (last error: {last!r})" if last is not None else ""
        super().__init__(
            f"{what} (KV bucket {bucket}) did not load within {timeout_s:g} s{why}; {then}"
        )
        self.bucket = bucket
        self.timeout_s = timeout_s
        self.last = last


class CatalogNotLoadedError(BucketNotLoadedError):
    def __init__(self, bucket: str, timeout_s: float, last: BaseException | None = None) -> None:
        super().__init__(
            "the tool catalog", bucket, timeout_s, last, "no turn runs on a half-known catalog"
        )


class AgentsNotLoadedError(BucketNotLoadedError):
    def __init__(self, bucket: str, timeout_s: float, last: BaseException | None = None) -> None:
        super().__init__(
            "the named agents", bucket, timeout_s, last,
            "no turn runs before its agent's definition is known",
        )  # fmt: skip
