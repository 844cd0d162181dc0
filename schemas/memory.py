"""Memories: what agents keep across sessions, per tenant.

A memory lives in a namespace: a user's (``user``, the turn's ``Turn.user``) or an
agent's (``agent``, its name). It is stored in the memory KV bucket under
``<tenant>.<kind>.<name>.<id>``, with its text, where it came from, and its embedding
(``vector``: float32, little-endian; empty until a loop worker embeds it).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from .types import Timestamp, Token

MemoryKind = Literal["user", "agent"]

#: The longest memory, in characters.
MAX_MEMORY_CHARS = 4_000

MemoryText = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_MEMORY_CHARS)]


class MemorySource(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Where a memory came from: the turn (and tool call) that saved it, or the HTTP API."""

    session: Token | None = None
    turn: Token | None = None
    call: str | None = None
    agent: Token | None = None
    by: Literal["tool", "api"] = "tool"


class Memory(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    id: Token
    tenant: Token
    kind: MemoryKind
    #: The user's id or the agent's name.
    name: Token
    text: MemoryText
    created_at: Timestamp = 0.0
    source: MemorySource | None = None
    #: The embeddings model of ``vector`` (empty: not embedded).
    model: str = ""
    vector: bytes = b""

    @property
    def key(self) -> str:
        return memory_key(self.tenant, self.kind, self.name, self.id)


def memory_key(tenant: str, kind: str, name: str, id: str) -> str:
    return f"{tenant}.{kind}.{name}.{id}"


def namespace_keys(tenant: str, kind: str, name: str) -> str:
    """The KV key filter of one namespace's memories."""
    return f"{tenant}.{kind}.{name}.*"
