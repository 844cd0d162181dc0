"""Conversation memory: prune to a token budget, summarise what was evicted, truncate.

``prune`` evicts whole *units*, oldest first: an assistant message that made tool calls
travels with the tool messages answering it, so the prompt never shows a call without
its result or a result without its call. System messages, the last user message (the
turn's input) and the newest unit (the last assistant message with its results) are
never evicted; everything else may go, including the earlier iterations of the turn
in progress, so a long turn can prune its own history. ``summarize`` turns evicted
messages into a short text for the next prompt, with a deterministic fallback when no
LLM helps.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import msgspec

from schemas import ChatMessage

from .protocols import LLM
from .tokens import TokenCounter


class PruneResult(msgspec.Struct, frozen=True, kw_only=True):
    kept: tuple[ChatMessage, ...]
    evicted: tuple[ChatMessage, ...]
    tokens_before: int
    tokens_after: int
    over_budget: bool  # even the messages that must stay exceed the budget


def _units(messages: Sequence[ChatMessage]) -> list[list[int]]:
    """Indices of the non-system messages, grouped into units that go together."""
    units: list[list[int]] = []
    unit_of_call: dict[str, list[int]] = {}
    for i, m in enumerate(messages):
        if m.role == "system":
            continue
        if m.role == "tool":
            unit = unit_of_call.get(m.tool_call_id or "")
            if unit is None and units:  # an orphan result goes with what precedes it
                unit = units[-1]
            if unit is not None:
                unit.append(i)
                continue
        units.append([i])
        for call in m.tool_calls:
            unit_of_call[call.id] = units[-1]
    return units


def _last_user(messages: Sequence[ChatMessage]) -> int:
    """Index of the last user message, or -1."""
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].role == "user":
            return i
    return -1


async def prune(
    messages: Sequence[ChatMessage],
    budget: int,
    counter: TokenCounter,
    *,
    keep_last_units: int = 1,
) -> PruneResult:
    """Evict the oldest units until the prompt fits ``budget`` tokens.

    System messages, the last user message and the newest ``keep_last_units`` units
    stay; any other unit may go, before or after the last user message.
    """
    total = await counter.count_all(messages)
    if total <= budget:
        kept = tuple(messages)
        return PruneResult(
            kept=kept, evicted=(), tokens_before=total, tokens_after=total, over_budget=False
        )
    user = _last_user(messages)
    units = _units(messages)
    newest = len(units) - max(keep_last_units, 0)
    evict: set[int] = set()
    after = total
    for n, unit in enumerate(units):
        if after <= budget or n >= newest:
            break
        if user in unit:  # the unit holding the last user message stays whole
            continue
        for i in unit:
            after -= await counter.count(messages[i])
        evict.update(unit)
    return PruneResult(
        kept=tuple(m for i, m in enumerate(messages) if i not in evict),
        evicted=tuple(m for i, m in enumerate(messages) if i in evict),
        tokens_before=total,
        tokens_after=after,
        over_budget=after > budget,
    )


def truncate(text: str, max_chars: int) -> tuple[str, bool]:
    """Cut ``text`` to ``max_chars`` and say so at the end; returns (text, was_cut)."""
    if len(text) <= max_chars:
        return text, False
    marker = f"\n[truncated: {len(text)} characters, showing the first {max_chars}]"
    return text[:max_chars] + marker, True


_SPACES = re.compile(r"\s+")
_THINKING = re.compile(r"<thinking>.*?(?:</thinking>|$)", re.DOTALL)


def _clip(text: str, limit: int) -> str:
    text = _SPACES.sub(" ", text).strip()
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _lines(evicted: Sequence[ChatMessage], *, clip: int) -> list[str]:
    """One line per message (one per tool call), oldest first."""
    tool_names = {c.id: c.name for m in evicted for c in m.tool_calls}
    lines: list[str] = []
    for m in evicted:
        if m.role == "tool":
            name = m.name or tool_names.get(m.tool_call_id or "", "?")
            lines.append(f"tool {name} returned: {_clip(m.content, clip)}")
            continue
        if m.content.strip():
            lines.append(f"{m.role}: {_clip(m.content, clip)}")
        for call in m.tool_calls:
            lines.append(f"{m.role} called tool {call.name}({_clip(call.arguments, clip // 2)})")
    return lines


def fallback_summary(
    evicted: Sequence[ChatMessage], *, previous: str = "", max_chars: int = 2_000
) -> str:
    """The previous summary plus a clipped line per evicted message, newest lines kept."""
    lines = [line for line in previous.splitlines() if line.strip()]
    lines += _lines(evicted, clip=200)
    kept: list[str] = []
    size = 0
    for line in reversed(lines):
        if size + len(line) + (1 if kept else 0) > max_chars:
            if not kept:  # the newest line alone is too long: keep its start
                kept.append(line[:max_chars])
            break
        size += len(line) + (1 if kept else 0)
        kept.append(line)
    return "\n".join(reversed(kept))


SUMMARY_INSTRUCTION = (
    "You keep the memory of an agent. Summarise the conversation below so the agent can "
    "continue without it: the user's goals and constraints, decisions made, facts learned "
    "from tools (names, numbers, paths, errors), and what is still open. Merge in the "
    "previous summary. Be concise: plain sentences or bullets, at most {max_chars} characters."
)


def _render(evicted: Sequence[ChatMessage], limit: int = 24_000) -> str:
    """The evicted messages as text for the summariser, newest kept within ``limit``."""
    text = "\n".join(_lines(evicted, clip=1_000))
    return text if len(text) <= limit else "…\n" + text[-limit:]


async def summarize(
    evicted: Sequence[ChatMessage],
    *,
    previous: str = "",
    llm: LLM | None = None,
    max_chars: int = 2_000,
) -> str:
    """A concise summary of ``evicted`` (and ``previous``) written by ``llm``.

    Falls back to :func:`fallback_summary` without an LLM, when it fails, or when it
    answers with nothing. Cancellation is not swallowed.
    """
    if llm is not None and evicted:
        prompt = (
            f"Previous summary:\n{previous or '(none)'}\n\n"
            f"Conversation to summarise:\n{_render(evicted)}"
        )
        try:
            completion = await llm.complete(
                (
                    ChatMessage(
                        role="system", content=SUMMARY_INSTRUCTION.format(max_chars=max_chars)
                    ),
                    ChatMessage(role="user", content=prompt),
                ),
                tools=(),
            )
        except Exception:
            completion = None
        if completion is not None:
            text = _THINKING.sub("", completion.content).strip()
            if text:
                return text[:max_chars]
    return fallback_summary(evicted, previous=previous, max_chars=max_chars)
