"""The context of one tool call, and its idempotency key.

A tool worker that is killed while a call runs leaves the call unacked; JetStream
redelivers it and another worker runs it again. The effect record cannot cover that
window (it is written when the call finishes), so the systems behind a tool are handed
the means to absorb the second run: the call's id, which is deterministic (the same
turn, iteration and index give the same id, on every worker and every delivery), as an
idempotency key:

- a local tool declares a parameter annotated :class:`ToolContext` (or
  ``ToolContext | None``); it is filled in, never shown to the model::

      @tool
      def transfer(amount: int, ctx: ToolContext) -> str:
          bank.transfer(amount, idempotency_key=ctx.idempotency_key)

- an MCP tool receives it in the request's ``_meta`` under :data:`META_KEY`;
- ``http_fetch`` sends it as the :data:`HEADER` header.

:func:`current` is the context of the call running in this task (or in the thread a
sync tool runs in); the service sets it with :func:`calling`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

import msgspec

#: The ``_meta`` key of an MCP ``tools/call`` request that carries the idempotency key.
META_KEY = "io.loopmesh/idempotency-key"
#: The HTTP header ``http_fetch`` sends it in (the IETF httpapi draft's name).
HEADER = "Idempotency-Key"


class ToolContext(msgspec.Struct, frozen=True, kw_only=True):
    """Who asks for this call. ``attempt`` counts the deliveries of the request (2 or
    more: an earlier run may have happened, on this worker or on a dead one)."""

    call_id: str
    tenant: str = ""
    session: str = ""
    turn_id: str = ""
    iteration: int = 0
    attempt: int = 1

    @property
    def idempotency_key(self) -> str:
        """The same for every run of this call: its deterministic call id."""
        return self.call_id


_current: ContextVar[ToolContext | None] = ContextVar("loopmesh_tool_context", default=None)


def current() -> ToolContext | None:
    """The context of the call this task (or thread) runs, or None outside a call."""
    return _current.get()


@contextlib.contextmanager
def calling(context: ToolContext) -> Iterator[ToolContext]:
    """Make ``context`` :func:`current` within the block."""
    token = _current.set(context)
    try:
        yield context
    finally:
        _current.reset(token)
