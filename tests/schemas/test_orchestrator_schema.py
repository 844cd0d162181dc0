"""The orchestrator's additions to the wire types: old readers keep working."""

from __future__ import annotations

import msgspec

from schemas import SessionSnapshot, Turn, decode, encode
from schemas.events import (
    ContentDelta,
    Event,
    LoopEnd,
    Message,
    OrchestratorFallback,
    PlanUpdate,
    UnknownEvent,
    decode_event,
)
from schemas.messages import OrchestratorState, PlanStep

COMMON = {"tenant": "acme", "session": "s1", "turn_id": "t1", "iteration": 3, "ts": 5.0}


class OldPlanStep(msgspec.Struct, frozen=True, kw_only=True):
    """``PlanStep`` before steps carried an id and a result."""

    title: str
    status: str = "pending"


class OldPlanUpdate(Event, tag="plan_update", frozen=True, kw_only=True):
    plan: tuple[OldPlanStep, ...] = ()


OldEvent = ContentDelta | Message | OldPlanUpdate | LoopEnd


def test_an_old_reader_reads_orchestrator_fallback_as_a_generic_event() -> None:
    data = encode(
        OrchestratorFallback(**COMMON, reason="step_failed", message="no", step="2", finished=1)
    )
    event = decode_event(data, OldEvent)
    assert isinstance(event, UnknownEvent) and event.type == "orchestrator_fallback"
    assert event.fields == {"reason": "step_failed", "message": "no", "step": "2", "finished": 1}
    assert isinstance(decode_event(data), OrchestratorFallback)


def test_an_old_reader_reads_plan_steps_that_carry_results() -> None:
    step = PlanStep(title="count", status="done", id="1", result="6 apples")
    event = decode_event(encode(PlanUpdate(**COMMON, plan=(step,))), OldEvent)
    assert isinstance(event, OldPlanUpdate) and event.plan == (
        OldPlanStep(title="count", status="done"),
    )


def test_old_turns_and_snapshots_decode_with_the_new_fields_defaulted() -> None:
    turn = decode(b'{"id": "t1", "tenant": "acme", "session": "s1", "input": "hi"}', Turn)
    assert (turn.mode, turn.planner_model, turn.executor_model) == (None, None, None)
    snapshot = decode(
        b'{"tenant": "acme", "session": "s1", "plan": [{"title": "x"}]}', SessionSnapshot
    )
    assert snapshot.orchestrator is None and snapshot.plan[0].result == ""
    state = OrchestratorState(step=2, attempt=1)
    again = decode(
        encode(SessionSnapshot(tenant="a", session="b", orchestrator=state)), SessionSnapshot
    )
    assert again.orchestrator == state
