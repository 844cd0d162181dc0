"""Errors of the durable loop-worker service (the engine's are in ``loop_worker.engine.errors``).

LoopWorkerError            (``loop_worker.engine.errors``)
├── LeaseLostError         the session lease expired or was taken over (``.key``)
├── LLMError               (the engine's) a call failed: its turn ends ``llm_failed``
│   └── LimiterError       the rate-limit leader refused an ask (a worker of another version)
│       └── LimiterUnavailableError  no leader answered for ``leader_wait_s`` (``.model``)
└── BucketNotLoadedError   a watched bucket did not load in time (``.bucket``, ``.timeout_s``)
    ├── CatalogNotLoadedError  the tool catalog
    └── AgentsNotLoadedError   the named agents
"""

from __future__ import annotations

from .engine.errors import LLMError, LoopWorkerError


class LeaseLostError(LoopWorkerError):
    def __init__(self, key: str, message: str = "") -> None:
        super().__init__(message or f"lost the lease of session {key}")
        self.key = key


class LimiterError(LLMError):
    """The rate-limit leader refused an ask (``[llm.limits]``): the message says why. An
    ``LLMError``: the call fails, and its turn ends ``llm_failed`` with the message."""


class LimiterUnavailableError(LimiterError):
    """No rate-limit leader answered a call to ``model`` for ``waited_s`` (``[llm.limits]
    leader_wait_s``, with ``no_leader = "fail"``)."""

    def __init__(self, model: str, waited_s: float) -> None:
        super().__init__(
            f"no rate-limit leader answered for {waited_s:.0f} s, so the call to {model} was "
            'not made ([llm.limits] no_leader = "fail"): is the limits bucket reachable?'
        )
        self.model = model
        self.waited_s = waited_s


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
