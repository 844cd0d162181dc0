"""The agent loop engine: pure, it imports no NATS.

``Engine`` talks to the world through the Protocols of ``protocols.py`` (an LLM, a tool
dispatcher, an event sink, a session store); ``inmemory`` runs it in one process and
the durable service in ``loop_worker`` runs it on NATS.
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
