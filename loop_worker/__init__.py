"""The loop worker: the agent loop engine and the service that runs turns durably.

The engine is pure (``Engine`` over the Protocols of ``protocols.py``); ``inmemory``
runs it in one process.
"""

from .control import TurnControl
from .engine import Engine
from .hooks import SKIP, HookError, Hooks
from .inmemory import InMemoryEvents, InMemoryStore, LocalTools
from .protocols import LLM, Completion, EventSink, SessionStore, ToolDispatcher
from .settings import LLMSettings, LoopSettings

__all__ = [
    "LLM",
    "SKIP",
    "Completion",
    "Engine",
    "EventSink",
    "HookError",
    "Hooks",
    "InMemoryEvents",
    "InMemoryStore",
    "LLMSettings",
    "LocalTools",
    "LoopSettings",
    "SessionStore",
    "ToolDispatcher",
    "TurnControl",
]
