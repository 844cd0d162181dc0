"""What a turn writes into its conversation and reads back from it: the results of its
tool calls after the message that asked for them, and, for a rollback that kept no copy
of the session from before the turn, where the turn began and the calls it ran.
"""

from __future__ import annotations

import msgspec

from schemas import ChatMessage, SessionSnapshot
from schemas.events import RanCall

from .prompt import Prompts, loop_message
from .tooling import Outcome


def add_results(messages: list[ChatMessage], outcomes: list[Outcome], prompts: Prompts) -> None:
    """The results of the pending calls, after the assistant message that made them
    (in the text format, that message has no native ``tool_calls``)."""
    if messages and messages[-1].tool_calls:
        for o in outcomes:
            messages.append(ChatMessage(role="tool", content=o.text, tool_call_id=o.call.call_id))
        return
    template = prompts.nudges.text_result.strip()
    blocks = [
        template.format(
            server=o.call.server or "?",
            tool=o.call.tool or o.call.name,
            status=o.result.status,
            content=o.text,
        )
        for o in outcomes
    ]
    messages.append(loop_message("\n\n".join(blocks)))


def turn_start(messages: list[ChatMessage], user_input: str) -> int:
    """The index of the turn's input message (the first it added), else the end."""
    for i in range(len(messages) - 1, -1, -1):
        m = messages[i]
        if m.role == "user" and m.name is None and m.content == user_input:
            return i
    return len(messages)


def calls_in(messages: list[ChatMessage]) -> list[RanCall]:
    """The calls that got a result in ``messages`` (how they ended is not known)."""
    names = {c.id: c.name for m in messages for c in m.tool_calls}
    out = []
    for m in messages:
        if m.role == "tool" and m.tool_call_id in names:
            server, _, tool = names[m.tool_call_id].rpartition("__")
            out.append(RanCall(call_id=m.tool_call_id, server=server, tool=tool, status="unknown"))
    return out


def before_turn(
    snapshot: SessionSnapshot, messages: list[ChatMessage], user_input: str
) -> tuple[SessionSnapshot, list[RanCall]]:
    """The session as it was before the turn whose input is ``user_input``, for a run that
    resumed the turn after a crash and so kept no copy of it: the conversation cut back
    to before the input (the summary and plan stay as they are), and the calls that got
    a result since."""
    start = turn_start(messages, user_input)
    cut = msgspec.structs.replace(snapshot, messages=tuple(messages[:start]))
    return cut, calls_in(messages[start:])
