"""What to say when the model answers without calling a tool.

A reply without tool calls is one of: a deflection ("I can't do that"), an incomplete
answer ("done 3, 4 remaining"), or plain text. Each kind gets its nudge, a bounded
number of times (:class:`Nudger` counts per turn); when the nudges are spent, the text
is taken as the reply to the user, unless it only repeats the loop's own reminders
(:func:`echoes_loop`): that is never an answer.
"""

from __future__ import annotations

import re
from functools import cache
from typing import Literal

from .prompt import Prompts, compiled_patterns
from .settings import LoopSettings

ReplyKind = Literal["deflection", "incomplete", "plain"]


def classify(text: str, prompts: Prompts) -> ReplyKind:
    incomplete, deflection = compiled_patterns(prompts.patterns)
    if deflection.search(text):
        return "deflection"
    if incomplete.search(text):
        return "incomplete"
    return "plain"


class Nudger:
    def __init__(self, settings: LoopSettings, prompts: Prompts) -> None:
        self.prompts = prompts
        self.limits = {
            "deflection": settings.max_deflection_nudges,
            "incomplete": settings.max_continuation_nudges,
            "plain": settings.max_no_tool_reminders,
        }
        self.used = {"deflection": 0, "incomplete": 0, "plain": 0}

    def nudge(self, text: str) -> tuple[ReplyKind, str | None]:
        """The reply's kind and the message to send back, or ``None`` when the
        nudges for it are spent (take the text as the answer)."""
        kind = classify(text, self.prompts)
        n = self.prompts.nudges
        for k in (kind, "plain"):  # a spent deflection / continuation falls back
            if self.used[k] < self.limits[k]:
                self.used[k] += 1
                return kind, {
                    "deflection": n.deflection,
                    "incomplete": n.continuation,
                    "plain": n.no_tool_call,
                }[k].strip()
        return kind, None


#: A reply whose word 4-grams come at least this much from the loop's own texts
#: only repeats them.
ECHO_SHARE = 0.5


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9_]+", text.lower())


def _grams(words: list[str]) -> set[tuple[str, ...]]:
    return {tuple(words[i : i + 4]) for i in range(len(words) - 3)}


def _loop_grams(prompts: Prompts) -> frozenset[tuple[str, ...]]:
    n = prompts.nudges
    return _grams_of(
        (
            n.no_tool_call, n.continuation, n.deflection, n.forced_summary,
            n.iteration_warning, n.final_iteration, n.tool_format_error,
        )
    )  # fmt: skip


@cache
def _grams_of(texts: tuple[str, ...]) -> frozenset[tuple[str, ...]]:
    return frozenset(g for t in texts for g in _grams(_words(t)))


def echoes_loop(text: str, prompts: Prompts) -> bool:
    """Whether ``text`` only repeats the loop's own reminders and nudges (a small model
    does): it is then never taken as the answer."""
    grams = _grams(_words(text))
    if not grams:
        return False
    shared = len(grams & _loop_grams(prompts))
    return shared / len(grams) >= ECHO_SHARE
