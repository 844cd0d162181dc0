"""Errors of the durable loop-worker service (the engine's are in ``loop_worker.engine.errors``).

LoopWorkerError            (``loop_worker.engine.errors``)
├── LeaseLostError         the session lease expired or was taken over (``.key``)
└── CatalogNotLoadedError  the tool catalog did not load in time (``.bucket``, ``.timeout_s``)
"""

from __future__ import annotations

from .engine.errors import LoopWorkerError


class LeaseLostError(LoopWorkerError):
    def __init__(self, key: str, message: str = "") -> None:
        super().__init__(message or f"lost the lease of session {key}")
        self.key = key


class CatalogNotLoadedError(LoopWorkerError):
    def __init__(self, bucket: str, timeout_s: float, last: BaseException | None = None) -> None:
        why = f" (last error: {last!r})" if last is not None else ""
        super().__init__(
            f"the tool catalog (KV bucket {bucket}) did not load within {timeout_s:g} s{why}; "
            "no turn runs on a half-known catalog"
        )
        self.bucket = bucket
        self.timeout_s = timeout_s
        self.last = last
