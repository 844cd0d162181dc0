"""Errors of the durable loop-worker service (the engine's are in ``loop_worker.engine.errors``).

LoopWorkerError            (``loop_worker.engine.errors``)
└── LeaseLostError         the session lease expired or was taken over (``.key``)
"""

from __future__ import annotations

from .engine.errors import LoopWorkerError


class LeaseLostError(LoopWorkerError):
    def __init__(self, key: str, message: str = "") -> None:
        super().__init__(message or f"lost the lease of session {key}")
        self.key = key
