"""The loopmesh wire contract: every message and event, subjects, streams and buckets.

Depends on msgspec only, so any service (or another project) can import it alone.
"""

from .agents import DEFAULT_AGENT, AgentSpec
from .codec import DecodeError, decode, encode
from .events import EVENT_NAMES, EVENT_TYPES, AnyEvent, Event
from .ids import (
    InvalidIdError,
    call_id,
    check_call_id,
    check_token,
    is_token,
    new_id,
    safe_token,
    turn_msg_id,
)
from .keys import catalog_key, session_key, session_meta_key
from .messages import ChatMessage, PlanStep, SessionMeta, SessionSnapshot, ToolCall, TurnEnd
from .streams import ConsumerDef, Definitions, KVDef, StreamDef, definitions, pool_consumer
from .subjects import Subjects
from .types import AGENTS_SERVER, BUILTIN_SERVER, MEMORY_SERVER, SCHEMA_VERSION, Parent, Token
from .webhook import WEBHOOK_EVENTS, Webhook
from .wire import (
    ApprovalDecision,
    Cancel,
    ContentPart,
    Control,
    FilePart,
    ImagePart,
    Passage,
    Pause,
    Resume,
    ToolCallRequest,
    ToolResult,
    ToolSpec,
    Turn,
    WireError,
)

__all__ = [
    "AGENTS_SERVER",
    "BUILTIN_SERVER",
    "DEFAULT_AGENT",
    "EVENT_NAMES",
    "EVENT_TYPES",
    "MEMORY_SERVER",
    "SCHEMA_VERSION",
    "WEBHOOK_EVENTS",
    "AgentSpec",
    "AnyEvent",
    "ApprovalDecision",
    "Cancel",
    "ChatMessage",
    "ConsumerDef",
    "ContentPart",
    "Control",
    "DecodeError",
    "Definitions",
    "Event",
    "FilePart",
    "ImagePart",
    "InvalidIdError",
    "KVDef",
    "Parent",
    "Passage",
    "Pause",
    "PlanStep",
    "Resume",
    "SessionMeta",
    "SessionSnapshot",
    "StreamDef",
    "Subjects",
    "Token",
    "ToolCall",
    "ToolCallRequest",
    "ToolResult",
    "ToolSpec",
    "Turn",
    "TurnEnd",
    "Webhook",
    "WireError",
    "call_id",
    "catalog_key",
    "check_call_id",
    "check_token",
    "decode",
    "definitions",
    "encode",
    "is_token",
    "new_id",
    "pool_consumer",
    "safe_token",
    "session_key",
    "session_meta_key",
    "turn_msg_id",
]
