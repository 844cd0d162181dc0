"""A turn's limits and tool policy: the turn's own values over the deployment's defaults.

The turn may set each (``Turn.tools``, ``deadline_s``, ``max_tool_calls``,
``max_parallel_tools``, ``tool_failure``); what it leaves ``None`` comes from
``[loop]`` as the turn's named agent sets it (``agents.py``). Tool allowlists only
narrow: a tool must be on the deployment's list (if any), the agent's (if any) *and*
the turn's (if any). Loop tools (``task_completion`` and the rest) are
always allowed.

:meth:`Limits.police` marks the calls of one iteration that must not run — a tool
outside the allowlist (``not_allowed``) or past the turn's tool-call cap
(``max_tool_calls``) — before they are checkpointed, so a resumed turn refuses them
again and counts from where it was.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

from schemas import AGENTS_SERVER, MEMORY_SERVER, ToolSpec, Turn, WireError

from .prompt import BUILTIN_SERVER
from .scope import End
from .settings import LoopSettings
from .tooling import Call, Outcome

T = TypeVar("T")

#: Error codes of calls refused by a limit.
NOT_ALLOWED = "not_allowed"
OVER_CAP = "max_tool_calls"


@dataclass(frozen=True)
class Limits:
    allowlists: tuple[tuple[str, ...], ...]  # every list that applies; empty: all allowed
    deadline_s: float | None
    max_tool_calls: int | None
    max_parallel_tools: int
    tool_failure: str

    @classmethod
    def of(cls, turn: Turn, settings: LoopSettings, agent: Sequence[str] | None = None) -> Limits:
        """``agent``: the allowlist of the turn's named agent, if it has one."""
        lists = tuple(tuple(x) for x in (settings.tools, agent, turn.tools) if x is not None)
        return cls(
            allowlists=lists,
            deadline_s=_pick(turn.deadline_s, settings.deadline_s),
            max_tool_calls=_pick(turn.max_tool_calls, settings.max_tool_calls),
            max_parallel_tools=_pick(turn.max_parallel_tools, settings.max_parallel_tools),
            tool_failure=_pick(turn.tool_failure, settings.tool_failure),
        )

    def allows(self, spec: ToolSpec) -> bool:
        if spec.server in (BUILTIN_SERVER, AGENTS_SERVER, MEMORY_SERVER):  # the agent's own
            return True
        names = {f"{spec.server}.{spec.name}", spec.name}
        return all(names.intersection(allow) for allow in self.allowlists)

    def police(self, calls: Sequence[Call], used: int) -> int:
        """Refuse the calls no limit lets run; return how many calls count against the
        cap (``used`` is the count so far)."""
        for call in calls:
            if call.error is not None or call.builtin or call.spec is None:
                continue
            if not self.allows(call.spec):
                allowed = ", ".join(sorted({n for a in self.allowlists for n in a})) or "(none)"
                call.error = WireError(
                    code=NOT_ALLOWED,
                    message=f"the tool {call.server}.{call.tool} is not allowed in this turn; "
                    f"allowed: {allowed} (Turn.tools, the agent's tools, [loop] tools)",
                )
            elif self.max_tool_calls is not None and used >= self.max_tool_calls:
                call.error = WireError(
                    code=OVER_CAP,
                    message=f"not run: the turn's limit of {self.max_tool_calls} tool calls "
                    "is reached (Turn.max_tool_calls, [loop] max_tool_calls)",
                )
            else:
                used += 1
        return used

    def over_cap(self, calls: Sequence[Call]) -> str | None:
        """The message that ends the turn when calls were refused for the cap."""
        refused = sum(1 for c in calls if c.error is not None and c.error.code == OVER_CAP)
        if not refused:
            return None
        return (
            f"The turn reached its limit of {self.max_tool_calls} tool calls; {refused} more "
            "were asked for and not run. Raise Turn.max_tool_calls (or [loop] max_tool_calls) "
            "or ask for less work in one turn."
        )

    def failed(self, outcomes: Sequence[Outcome]) -> str | None:
        """In ``fail`` mode, the message that ends the turn after a failed tool call."""
        if self.tool_failure != "fail":
            return None
        for o in outcomes:
            if o.call.builtin or o.result.status == "ok":
                continue
            if o.result.error is not None and o.result.error.code == OVER_CAP:
                continue
            error = o.result.error
            what = f"{error.code}: {error.message}" if error else o.result.status
            tool = f"{o.call.server}.{o.call.tool}" if o.call.server else o.call.name
            return (
                f"The tool call {tool} failed ({what}), and this turn's tool_failure mode is "
                "'fail'. Set Turn.tool_failure (or [loop] tool_failure) to 'continue' to let "
                "the model see tool errors and carry on."
            )
        return None

    def end_after(self, calls: Sequence[Call], outcomes: Sequence[Outcome]) -> End | None:
        """How the turn ends once ``calls`` ran with ``outcomes``: a failed call in ``fail``
        mode (:meth:`failed`), else calls refused for the cap (:meth:`over_cap`); ``None``
        when it goes on."""
        if (text := self.failed(outcomes)) is not None:
            return End("tool_failed", content=text, error=text)
        if (text := self.over_cap(calls)) is not None:
            return End("max_tool_calls", content=text, error=text)
        return None

    def deadline_message(self) -> str:
        return (
            f"The turn ran out of time: its deadline of {self.deadline_s:g} s passed. Raise "
            "Turn.deadline_s (or [loop] deadline_s), or split the task into smaller turns."
        )


def _pick(own: T | None, default: T) -> T:
    return default if own is None else own
