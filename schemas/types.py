"""Annotated field types shared by every wire struct."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from .ids import TOKEN_PATTERN

#: A subject-safe identifier (tenant, session, turn, call, pool, server, tool).
Token = Annotated[
    str,
    msgspec.Meta(
        pattern=TOKEN_PATTERN,
        description="1-64 characters from A-Z a-z 0-9 _ -",
    ),
]

#: Seconds since the Unix epoch.
Timestamp = Annotated[float, msgspec.Meta(ge=0, description="seconds since the Unix epoch")]

SCHEMA_VERSION = 1

#: A turn's lane on the turns stream: ``interactive`` turns (a person waits) are pulled
#: before ``batch`` ones (scheduled, bulk), of every tenant (docs/ARCHITECTURE.md,
#: "Fair share between tenants").
Priority = Literal["interactive", "batch"]


class Parent(msgspec.Struct, frozen=True, kw_only=True):
    """The turn that called an agent, on a child turn and its events: the calling turn's
    ``session`` and ``turn``, and the ``call`` (its tool call id) the child answers."""

    session: Token
    turn: Token
    call: Token


#: The server name of the tools that call agents (``agents.<name>``).
AGENTS_SERVER = "agents"
#: The server name of the memory tools (``memory.save``, ``memory.search``,
#: ``memory.forget``): they run in the loop worker, on the tenant's memory bucket.
MEMORY_SERVER = "memory"
#: The server name of the loop's own tools (``task_completion``, ``ask_question``,
#: ``converse``, ``update_plan``): they end a turn or plan it, and run in the loop worker.
BUILTIN_SERVER = "loop"
