"""A session's history by turn, for fork and rewind (:mod:`loopmesh.branching`):
which turns its conversation holds, where each begins in the snapshot's messages, and
the session as it was at the end of any of them.

Built from what is stored, without a copy per turn: the snapshot holds the messages
exactly as the model was sent them (tool-call arguments as the model wrote them, results
as truncated, the loop's reminders, images), and they only grow while turns run, so the
session as of the end of a turn is a prefix of them. The events name the turns in order
(``turn_accepted``), the turns no longer in the conversation (``rolled_back``,
``rewound``), a fork's inherited turns (``forked``: their facts are folded from the
source session's events), each turn's last plan (``plan_update``), its memory pruning
(``memory_pruned``) and the tool calls that ran. A turn's first message is the user
message holding its input (a user message without a ``name``: the loop's own reminders
carry one), matched from the newest back.

Pruning is the one change that is not an append: it replaces old messages by a summary.
The session before the last turn that pruned cannot be rebuilt from the snapshot, so a
cut there is refused (:class:`~loopmesh.errors.BranchRefused`, kind ``invalid``); any cut
at or after its end keeps the snapshot's summary.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from schemas import ChatMessage, PlanStep, SessionSnapshot
from schemas.events import (
    Event,
    Forked,
    MemoryPruned,
    PlanUpdate,
    RanCall,
    Rewound,
    RolledBack,
    ToolErrorEvent,
    ToolResultEvent,
    ToolTimeout,
    TurnAccepted,
)

from .errors import BranchRefused


@dataclass
class TurnMark:
    """What the events say of one turn. ``input``: ``None`` when not known (a fork's
    inherited turn whose source events are gone); ``plan``: its last ``plan_update``."""

    turn_id: str
    input: str | None = None
    pruned: bool = False
    plan: tuple[PlanStep, ...] | None = None
    calls: dict[str, RanCall] = field(default_factory=dict)


@dataclass
class Timeline:
    """A session's turns as its events tell them. ``live``: the turns whose messages the
    conversation holds, oldest first; ``marks``: every turn seen (undone ones too);
    ``source``: the session it was forked from, and the turns it took from there."""

    live: list[str] = field(default_factory=list)
    marks: dict[str, TurnMark] = field(default_factory=dict)
    source: tuple[str, tuple[str, ...]] | None = None

    def inherit(self, source: Timeline) -> None:
        """Take the facts of the inherited turns from the source session's timeline."""
        assert self.source is not None
        for turn_id in self.source[1]:
            if turn_id in source.marks:
                self.marks[turn_id] = source.marks[turn_id]


def fold(events: Iterable[Event]) -> Timeline:
    """The timeline of one session's events, in their stream order."""
    t = Timeline()
    for e in events:
        mark = t.marks.get(e.turn_id)
        match e:
            case Forked(source=source, turns=turns):
                t.source = (source, turns)
                for turn_id in turns:
                    t.marks.setdefault(turn_id, TurnMark(turn_id))
                    t.live.append(turn_id)
            case TurnAccepted(input=text) if mark is None:
                t.marks[e.turn_id] = TurnMark(e.turn_id, input=text)
                t.live.append(e.turn_id)
            case RolledBack():
                _drop(t, (e.turn_id,))
            case Rewound(turns=turns):
                _drop(t, turns)
            case MemoryPruned() if mark is not None:
                mark.pruned = True
            case PlanUpdate(plan=plan) if mark is not None:
                mark.plan = plan
            case ToolResultEvent(worker=worker) if mark is not None and worker:
                mark.calls[e.call_id] = RanCall(call_id=e.call_id, server=e.server, tool=e.tool)
            case ToolErrorEvent(worker=worker) if mark is not None and worker:
                mark.calls[e.call_id] = RanCall(
                    call_id=e.call_id, server=e.server, tool=e.tool, status="error"
                )
            case ToolTimeout() if mark is not None:
                mark.calls.setdefault(
                    e.call_id,
                    RanCall(call_id=e.call_id, server=e.server, tool=e.tool, status="timeout"),
                )
            case _:
                pass
    return t


def _drop(t: Timeline, turns: Iterable[str]) -> None:
    gone = set(turns)
    t.live = [turn_id for turn_id in t.live if turn_id not in gone]


@dataclass(frozen=True)
class Cut:
    """The session as of a point: its conversation, plan and summary, the turns it
    holds (``kept``) and the live turns after the point (``later``) with the tool calls
    of those that ran."""

    messages: tuple[ChatMessage, ...]
    plan: tuple[PlanStep, ...]
    summary: str
    kept: tuple[str, ...]
    later: tuple[str, ...]
    calls: tuple[RanCall, ...]

    @property
    def last(self) -> str | None:
        """The last turn the cut holds (``None``: none)."""
        return self.kept[-1] if self.kept else None


def starts(messages: tuple[ChatMessage, ...], t: Timeline) -> dict[str, int]:
    """Where each live turn's messages begin: its input message's index, matched from
    the newest back (a turn whose input is not there, pruned, has none)."""
    inputs = [i for i, m in enumerate(messages) if m.role == "user" and m.name is None]
    found: dict[str, int] = {}
    for turn_id in reversed(t.live):
        if not inputs:
            break
        known = t.marks[turn_id].input
        if known is None or messages[inputs[-1]].content == known:
            found[turn_id] = inputs.pop()
    return found


def cut(snapshot: SessionSnapshot, t: Timeline, turn_id: str, *, before: bool) -> Cut:
    """The session at the end of ``turn_id`` (``before``: at its start). Raises
    :class:`~loopmesh.errors.BranchRefused` (``invalid``, naming the field) for a turn it
    never ran, one undone, one whose messages were pruned, and a point before the last
    pruning."""
    name = "before_turn" if before else "at_turn"
    if turn_id not in t.live:
        if turn_id in t.marks:
            raise _unreachable(
                f"turn {turn_id!r} was undone (rewound or rolled back); "
                "name a turn the session holds (GET .../events shows them)",
                name,
            )
        raise _unreachable(f"session {snapshot.session!r} has no turn {turn_id!r}", name)
    messages = snapshot.messages
    begin = starts(messages, t)
    at = t.live.index(turn_id)
    kept = t.live[:at] if before else t.live[: at + 1]
    later = t.live[len(kept) :]
    if turn_id not in begin:
        raise _unreachable(
            f"turn {turn_id!r} is no longer in the session's memory (pruned into its "
            "summary); name a later turn",
            name,
        )
    end = next((begin[x] for x in later if x in begin), len(messages))
    pruned = [x for x in t.live if t.marks[x].pruned]
    if pruned and pruned[-1] not in kept:
        raise _unreachable(
            f"turn {pruned[-1]!r} pruned the session's memory (older messages became a "
            f"summary), so the session before its end is not kept; name turn "
            f"{pruned[-1]!r} (at_turn) or a later one",
            name,
        )
    plan = next((p for x in reversed(kept) if (p := t.marks[x].plan) is not None), ())
    calls = [c for x in later for c in t.marks[x].calls.values()]
    return Cut(
        messages=messages[: begin[turn_id] if before else end],
        plan=plan,
        summary=snapshot.summary,
        kept=tuple(kept),
        later=tuple(later),
        calls=tuple(calls),
    )


def _unreachable(message: str, field: str) -> BranchRefused:
    return BranchRefused("invalid", message, field=field)
