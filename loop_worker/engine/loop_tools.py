"""The loop's own tools as a turn runs them: ``update_plan``, the loop-breaking tools
(``task_completion``, ``ask_question``, ``converse``: they end the turn with their text)
and the agents a turn may call (``agents.<name>``); and the error result of a call the
turn refuses or never runs.
"""

from __future__ import annotations

from typing import Any

import msgspec

from schemas import AGENTS_SERVER, AgentSpec, PlanStep, ToolResult, ToolSpec, WireError
from schemas.events import EndReason

from .tooling import Call, Outcome

#: Loop-breaking tools: name -> (end reason, the argument carrying the text).
LOOP_BREAKING: dict[str, tuple[EndReason, str]] = {
    "task_completion": ("task_completion", "result"),
    "ask_question": ("ask_question", "question"),
    "converse": ("converse", "message"),
}


#: What an agent called as a tool takes.
CALLEE_INPUT: dict[str, object] = {
    "type": "object",
    "properties": {
        "input": {
            "type": "string",
            "description": "What to ask the agent: the whole request, in words.",
        }
    },
    "required": ["input"],
    "additionalProperties": False,
}

#: The error a loop-breaking call gets when its text only repeats the loop's reminders.
NOT_AN_ANSWER = "this only repeats the loop's reminder; give your own answer for the user"


def callee_spec(name: str, spec: AgentSpec, timeout_s: float) -> ToolSpec:
    """The agent ``name`` offered as a tool, taking ``input``."""
    return ToolSpec(
        server=AGENTS_SERVER,
        name=name,
        description=spec.description or f"Ask the agent {name}.",
        input_schema=CALLEE_INPUT,
        timeout_s=timeout_s,
    )


def plan_steps(args: dict[str, Any]) -> tuple[PlanStep, ...]:
    """``update_plan``'s steps, each a title or a step; raises
    ``msgspec.ValidationError`` or ``TypeError`` for arguments that are neither."""
    return msgspec.convert(
        [{"title": s} if isinstance(s, str) else s for s in args.get("steps", [])],
        tuple[PlanStep, ...],
    )


def error_result(call: Call, code: str, message: str) -> ToolResult:
    return ToolResult(
        call_id=call.call_id,
        status="error",
        error=WireError(code=code, message=message),
        server=call.server,
        tool=call.tool,
    )


def failed(call: Call, code: str, message: str) -> Outcome:
    return Outcome(call, error_result(call, code, message), f"Error ({code}): {message}")
