"""Prompt assembly.

The order puts what changes least first, so that a provider's prompt cache (a cache of
the longest prefix it has seen) covers as much of each request as it can::

    system     user instructions · agent-loop rules · capabilities · chain-of-thought ·
               tool schemas and calling rules · summary of evicted history
    history    earlier turns, then this turn's assistant / tool messages
    current    planning context · retrieved context · the user's input
                                           (takes the place of this turn's user message)
    warning    an iteration warning as the limit nears (not stored)

A request then begins as the session's previous ones did up to the last turn's user
message (stored as the user wrote it, sent with the plan and context around it): the
system message, while the offered tools and the summary stay, and every earlier turn.

The static sections are data in ``prompts.toml``, read once.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import cache
from importlib import resources
from typing import Any

import msgspec

from schemas import BUILTIN_SERVER, ChatMessage, ContentPart, PlanStep, ToolSpec

#: ``name`` of the messages the loop itself adds (reminders, nudges, text-format results),
#: so they are never taken for the user's input.
LOOP_NAME = "loopmesh"


class SystemSections(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    agent_loop: str
    capabilities: str
    chain_of_thought: str
    summary: str


class TurnSections(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    tools_heading: str
    tool_line: str
    tool_text: str
    no_tools: str
    native_rules: str
    text_rules: str
    plan_heading: str
    plan_step: str
    plan_empty: str
    context_heading: str
    input_heading: str


class Nudges(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    no_tool_call: str
    continuation: str
    deflection: str
    forced_summary: str
    empty_fallback: str
    iteration_warning: str
    final_iteration: str
    tool_format_error: str
    text_result: str
    circuit_open: str
    max_iterations: str
    budget_exceeded: str


class Patterns(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    incomplete: tuple[str, ...]
    deflection: tuple[str, ...]


class Builtin(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    description: str
    parameters: dict[str, Any]


class OrchestratorPrompts(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    planner: str
    executor: str
    step: str
    no_results: str
    result_line: str
    synthesis: str
    results: str
    fallback: str


class Prompts(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    system: SystemSections
    turn: TurnSections
    nudges: Nudges
    patterns: Patterns
    builtin: tuple[Builtin, ...]
    orchestrator: OrchestratorPrompts


@cache
def load_prompts() -> Prompts:
    """The packaged ``prompts.toml``, read and checked once."""
    data = resources.files(__package__).joinpath("prompts.toml").read_bytes()
    return msgspec.toml.decode(data, type=Prompts)


def builtin_specs(prompts: Prompts) -> tuple[ToolSpec, ...]:
    """The loop's own tools (server ``loop``): completion, questions, conversation, plan."""
    return tuple(
        ToolSpec(
            server=BUILTIN_SERVER,
            name=b.name,
            description=b.description,
            input_schema=b.parameters,
        )
        for b in prompts.builtin
    )


@cache
def compiled_patterns(patterns: Patterns) -> tuple[re.Pattern[str], re.Pattern[str]]:
    """(incomplete, deflection), each one case-insensitive alternation."""

    def join(parts: Sequence[str]) -> re.Pattern[str]:
        return re.compile("|".join(f"(?:{p})" for p in parts), re.IGNORECASE)

    return join(patterns.incomplete), join(patterns.deflection)


# -- the system message ------------------------------------------------------------------


def system_message(
    prompts: Prompts, *, instructions: Sequence[str], tools: str = "", summary: str
) -> ChatMessage:
    """``tools``: :func:`tools_section`'s text."""
    parts = [i.strip() for i in instructions if i and i.strip()]
    s = prompts.system
    parts += [s.agent_loop.strip(), s.capabilities.strip(), s.chain_of_thought.strip()]
    if tools:
        parts.append(tools)
    if summary:
        parts.append(s.summary.strip().format(summary=summary))
    return ChatMessage(role="system", content="\n\n".join(parts))


def tools_section(
    prompts: Prompts, tools: Sequence[tuple[str, ToolSpec]], *, text_format: bool
) -> str:
    """Tool list and calling rules. ``tools`` are (function name, spec) pairs.

    Native calling sends full schemas in ``tools=``, so the prompt lists names and
    descriptions; the text format puts each schema in the prompt.
    """
    t = prompts.turn
    lines = [t.tools_heading]
    for name, spec in tools:
        description = " ".join(spec.description.split()) or "(no description)"
        if text_format:
            schema = msgspec.json.encode(spec.input_schema).decode()
            lines.append(
                t.tool_text.format(
                    server=spec.server, tool=spec.name, description=description, schema=schema
                )
            )
        else:
            lines.append(
                t.tool_line.format(
                    name=name, server=spec.server, tool=spec.name, description=description
                )
            )
    if not tools:
        lines.append(t.no_tools)
    lines.append((t.text_rules if text_format else t.native_rules).strip())
    return "\n".join(lines)


# -- the current-turn message ------------------------------------------------------------


def plan_section(prompts: Prompts, plan: Sequence[PlanStep]) -> str:
    t = prompts.turn
    if not plan:
        return f"{t.plan_heading}\n{t.plan_empty}"
    steps = [
        t.plan_step.format(number=n, status=step.status, title=step.title)
        for n, step in enumerate(plan, 1)
    ]
    return "\n".join([t.plan_heading, *steps])


def turn_message(
    prompts: Prompts,
    *,
    plan: str,
    context: Sequence[str],
    user_input: str,
    parts: Sequence[ContentPart] = (),
) -> ChatMessage:
    t = prompts.turn
    sections = [plan]
    retrieved = [c.strip() for c in context if c and c.strip()]
    if retrieved:
        sections.append("\n\n".join([t.context_heading, *retrieved]))
    sections.append(f"{t.input_heading}\n{user_input}")
    return ChatMessage(role="user", content="\n\n".join(sections), parts=tuple(parts))


def iteration_warning(prompts: Prompts, *, iteration: int, limit: int, warn_at: int) -> str:
    """The warning for this iteration, or ``""`` while the limit is far."""
    remaining = limit - iteration
    if remaining <= 0:
        return prompts.nudges.final_iteration.strip()
    if remaining <= warn_at:
        return prompts.nudges.iteration_warning.strip().format(remaining=remaining)
    return ""


def loop_message(text: str) -> ChatMessage:
    """A message the loop adds on the user's side (a reminder, a nudge, a result)."""
    return ChatMessage(role="user", content=text, name=LOOP_NAME)


def is_turn_input(message: ChatMessage, user_input: str) -> bool:
    return message.role == "user" and message.name is None and message.content == user_input


def assemble(
    *,
    system: ChatMessage,
    history: Sequence[ChatMessage],
    current: ChatMessage,
    user_input: str,
    warning: str = "",
) -> list[ChatMessage]:
    """The prompt: ``current`` replaces this turn's user message in ``history`` (the
    last one equal to ``user_input``), or goes first when pruning evicted it."""
    at = -1
    for i in range(len(history) - 1, -1, -1):
        if is_turn_input(history[i], user_input):
            at = i
            break
    if at < 0:
        out = [system, current, *history]
    else:
        out = [system, *history[:at], current, *history[at + 1 :]]
    if warning:
        out.append(loop_message(warning))
    return out
