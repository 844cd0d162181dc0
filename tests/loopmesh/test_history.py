"""The session as of a turn, cut from its snapshot by what its events say
(:mod:`loopmesh.history`): the cases a live mesh reaches only slowly (pruning, a
rolled-back turn, the loop's own messages between turns)."""

from __future__ import annotations

from typing import Any

import pytest

from loopmesh.errors import BranchRefused
from loopmesh.history import cut, fold
from schemas import ChatMessage, PlanStep, SessionSnapshot
from schemas.events import (
    Event,
    Forked,
    MemoryPruned,
    PlanUpdate,
    RolledBack,
    ToolResultEvent,
    ToolTimeout,
    TurnAccepted,
)

LOOP = "loopmesh"  # the name the loop's own user-side messages carry


def ev(type_: type[Event], turn: str, **fields: Any) -> Event:
    return type_(tenant="acme", session="s1", turn_id=turn, **fields)


def user(text: str, name: str | None = None) -> ChatMessage:
    return ChatMessage(role="user", content=text, name=name)


def reply(text: str) -> ChatMessage:
    return ChatMessage(role="assistant", content=text)


def snapshot(*messages: ChatMessage, summary: str = "") -> SessionSnapshot:
    return SessionSnapshot(tenant="acme", session="s1", messages=messages, summary=summary)


CONVERSATION = (
    user("one"), reply("1"), user("a reminder", name=LOOP), reply("1 again"),
    user("two"), reply("2"),
    user("three"), reply("3"),
)  # fmt: skip
TURNS = [ev(TurnAccepted, t, input=text) for t, text in (("t1", "one"), ("t2", "two"))]


def test_a_turn_ends_where_the_next_turns_input_begins():
    t = fold([*TURNS, ev(TurnAccepted, "t3", input="three")])
    s = snapshot(*CONVERSATION)
    assert cut(s, t, "t1", before=False).messages == CONVERSATION[:4]  # the reminder too
    assert cut(s, t, "t2", before=True).messages == CONVERSATION[:4]
    assert cut(s, t, "t1", before=True).messages == ()
    last = cut(s, t, "t3", before=False)
    assert last.messages == CONVERSATION and last.later == ()
    assert cut(s, t, "t2", before=False).later == ("t3",)


def test_a_rolled_back_turn_holds_no_messages_and_cannot_be_named():
    events = [
        TURNS[0], ev(TurnAccepted, "tx", input="gone"), ev(RolledBack, "tx", by_turn="t2"),
        TURNS[1], ev(TurnAccepted, "t3", input="three"),
    ]  # fmt: skip
    t = fold(events)
    assert t.live == ["t1", "t2", "t3"]
    made = cut(snapshot(*CONVERSATION), t, "t1", before=False)
    assert made.messages == CONVERSATION[:4] and made.later == ("t2", "t3")
    with pytest.raises(BranchRefused, match="undone"):
        cut(snapshot(*CONVERSATION), t, "tx", before=True)


def test_each_cut_keeps_the_last_plan_of_its_turns_and_names_the_calls_after_it():
    plan = (PlanStep(title="look"),)
    events = [
        TURNS[0], ev(PlanUpdate, "t1", plan=plan),
        TURNS[1], ev(ToolResultEvent, "t2", call_id="c1", tool="count", worker="tw"),
        ev(ToolResultEvent, "t2", call_id="c2", tool="task_completion"),  # the loop's own
        ev(ToolTimeout, "t2", call_id="c3", tool="slow"),
        ev(TurnAccepted, "t3", input="three"),
    ]  # fmt: skip
    t = fold(events)
    made = cut(snapshot(*CONVERSATION), t, "t2", before=True)
    assert made.plan == plan
    assert [(c.call_id, c.status) for c in made.calls] == [("c1", "ok"), ("c3", "timeout")]
    assert cut(snapshot(*CONVERSATION), t, "t1", before=True).plan == ()


def test_a_point_before_the_last_pruning_is_refused_and_one_after_keeps_the_summary():
    events = [*TURNS, ev(MemoryPruned, "t2", removed=2), ev(TurnAccepted, "t3", input="three")]
    t = fold(events)
    pruned = snapshot(*CONVERSATION[4:], summary="they said one")
    with pytest.raises(BranchRefused, match="no longer in the session's memory") as info:
        cut(pruned, t, "t1", before=False)
    assert info.value.field == "at_turn"
    with pytest.raises(BranchRefused, match="pruned the session's memory"):
        cut(pruned, t, "t2", before=True)
    made = cut(pruned, t, "t2", before=False)
    assert made.messages == CONVERSATION[4:6] and made.summary == "they said one"


def test_a_forks_inherited_turns_come_first_and_match_whatever_their_input():
    events = [
        ev(Forked, "op", source="s0", at_turn="t2", turns=("t1", "t2")),
        ev(TurnAccepted, "t3", input="three"),
    ]
    t = fold(events)
    assert t.live == ["t1", "t2", "t3"] and t.source == ("s0", ("t1", "t2"))
    assert cut(snapshot(*CONVERSATION), t, "t2", before=True).messages == CONVERSATION[:4]
    with pytest.raises(BranchRefused, match="has no turn"):
        cut(snapshot(*CONVERSATION), t, "t9", before=True)
