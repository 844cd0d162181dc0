"""Errors of the loop engine (the durable service adds its own in ``loop_worker.errors``).

LoopWorkerError
├── LLMError               every attempt of every model failed (``.attempts``, ``.last``)
├── PlanError              the planner's reply is no valid plan (orchestrator mode)
├── StaleSessionError      a checkpoint lost a revision race (``.key``)
└── ToolFormatError        model output in the text tool format could not be read
    ├── ToolParseError     the ``<tool>`` body is not JSON (``.text``)
    └── ToolFieldError     a required field is missing or of the wrong type (``.field``)
"""

from __future__ import annotations


class LoopWorkerError(Exception):
    """Base class of loop-worker errors."""


class LLMError(LoopWorkerError):
    def __init__(self, message: str, *, attempts: int = 0, last: BaseException | None = None):
        super().__init__(message)
        self.attempts = attempts
        self.last = last


class PlanError(LoopWorkerError):
    """The planner's reply holds no valid plan; the message says what was wrong."""


class StaleSessionError(LoopWorkerError):
    def __init__(self, key: str, message: str = "") -> None:
        super().__init__(message or f"session {key} was saved by someone else first")
        self.key = key


class ToolFormatError(LoopWorkerError):
    """Base of the text tool-format errors; the message goes back to the model."""


class ToolParseError(ToolFormatError):
    def __init__(self, message: str, *, text: str = "") -> None:
        super().__init__(message)
        self.text = text


class ToolFieldError(ToolFormatError):
    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(message)
        self.field = field
