"""A turn's events as the protocol's response stream (§6), and its end as the stream's
last text or the protocol's error (§9).

The protocol's caller concatenates the ``response`` chunks in order, and that is the
reply: nothing sent can be taken back. The loop does take text back: a model reply
that called no tool is usually asked again (a nudge: ``[loop] max_no_tool_reminders``)
and a model call that failed mid-stream is made again, each announced by a ``retract``.
So the text a model reply streams (its ``content_delta`` events, coalesced by the loop
worker) is held until the loop has kept it:

- when the reply called a tool (a ``tool_call`` event), its text is what the agent said
  on the way (``I'll count them.``), and goes out as a ``response`` chunk then, before
  the tool runs: a caller reads the turn as it goes, a step at a time;
- when the reply was taken as the answer (a ``message`` event), its text goes out then;
- when the next model call starts (``llm_request``) with text still held, the loop kept
  it (an orchestrator step's result, said without a tool call): it goes out then;
- a ``retract``, or a fatal ``error`` (a model call that failed for good), drops what
  is held.

At ``loop_end``, a turn that answered (``task_completion``, ``converse``,
``ask_question``) ends the reply with its answer (``loop_end.content``), unless the text
sent last already was it (an answer the model streamed): so the reply always ends with
the turn's answer, after a blank line when other text went before it. Thinking is not
sent. Any other end is the protocol's error, its code from what ended the turn (below),
its description naming the turn and the session where it can be looked at.
"""

from __future__ import annotations

from synadia_ai.agent_service import RequestRejectedError

from schemas import Turn
from schemas.events import (
    ANSWERED,
    ContentDelta,
    Error,
    Event,
    LLMRequest,
    LoopEnd,
    Message,
    Retract,
    ToolCallEvent,
)

#: §9.2 codes for what ended a turn: an agent nobody defined (it was deleted after the
#: caller discovered it) is "not found"; a turn refused or stopped by the session's state
#: (another agent's session, a busy session with ``on_busy = reject``, a cancel, a later
#: turn's interrupt) is a conflict; a spending ceiling is "rate limited"; the rest
#: (limits, a failed model, a failed tool, an error) is an internal error.
NOT_FOUND = frozenset({"unknown_agent"})
CONFLICT = frozenset({"agent_mismatch", "session_busy", "rejected", "cancelled", "interrupted"})
RATE_LIMITED = frozenset({"budget", "budget_exceeded"})


class Reply:
    """What one turn's events put on the stream: :meth:`take` each event, then
    :meth:`end` with its ``loop_end``."""

    def __init__(self, turn: Turn) -> None:
        self.turn = turn
        self.sent = False  # some text went out
        self._held: list[str] = []  # the current model reply's text, not kept yet
        self._last = ""  # the text sent last
        self._codes: list[str] = []  # the codes of the turn's fatal errors

    def take(self, event: Event) -> str:
        """The text ``event`` puts on the stream now (``""``: none)."""
        match event:
            case ContentDelta(text=text):
                self._held.append(text)
            case Retract():
                self._held.clear()
            case ToolCallEvent() | Message() | LLMRequest():
                return self._keep()
            case Error(code=code, fatal=True):  # the reply in progress is given up
                self._codes.append(code)
                self._held.clear()
        return ""

    def end(self, end: LoopEnd) -> str:
        """The text that completes the reply (``""``: none); raises the protocol's error
        (:class:`RequestRejectedError`) when the turn ended without an answer."""
        if end.reason not in ANSWERED:
            raise self.error(end)
        answer = end.content.strip()
        if not answer or self._last.strip().startswith(answer):
            return ""
        self._last = answer
        return ("\n\n" if self.sent else "") + answer

    def error(self, end: LoopEnd) -> RequestRejectedError:
        why = {end.reason, *self._codes}
        code = 500
        if why & NOT_FOUND:
            code = 404
        elif why & CONFLICT:
            code = 409
        elif why & RATE_LIMITED:
            code = 429
        detail = end.error or end.content or "no detail"
        last = self._codes[-1] if self._codes else end.reason
        cause = end.reason if last == end.reason else f"{end.reason} ({last})"
        return RequestRejectedError(
            code,
            f"turn {self.turn.id} in session {self.turn.session} ended with {cause}: {detail}",
        )

    def _keep(self) -> str:
        text, self._held = "".join(self._held), []
        if not text.strip():
            return ""
        text = ("\n\n" if self.sent and not self._last.endswith("\n") else "") + text.lstrip()
        self._last, self.sent = text, True
        return text
