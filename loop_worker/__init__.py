"""The loop worker: the agent loop engine and the service that runs turns durably.

The engine is the subpackage ``loop_worker.engine``: pure (``Engine`` over the Protocols
of ``engine/protocols.py``, no NATS); ``engine.inmemory`` runs it in one process. The
modules beside it (``service``, ``lease``, ``store``, ``sink``, ``dispatch``,
``controls``, ``client``, ``cli``, ``config``) are the durable service on NATS.
"""

from .engine.control import TurnControl
from .engine.engine import Engine
from .engine.hooks import SKIP, HookError, Hooks
from .engine.inmemory import InMemoryEvents, InMemoryStore, LocalTools
from .engine.protocols import LLM, Completion, EventSink, SessionStore, ToolDispatcher
from .engine.settings import LLMSettings, LoopSettings

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
