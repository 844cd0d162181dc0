"""The chaos checker on recorded runs made by hand: it passes a clean one and names
each kind of failure."""

from schemas import SessionSnapshot
from schemas.events import (
    LLMRequest,
    LLMResponse,
    LoopEnd,
    LoopIteration,
    LoopStart,
    ToolCallEvent,
    ToolResultEvent,
)

from .checker import Accepted, Kill, check

TURN = Accepted("c0", "t0", "c0-t0")


def turn_events(turn: str = "t0", *, end: bool = True):
    base = {"tenant": "chaos", "session": "c0", "turn_id": turn}
    events = [
        LoopStart(**base),
        LoopIteration(**base, iteration=1),
        LLMRequest(**base, iteration=1),
        LLMResponse(**base, iteration=1),
        ToolCallEvent(**base, iteration=1, call_id="x"),
        ToolResultEvent(**base, iteration=1, call_id="x"),
        LoopIteration(**base, iteration=2),
        LLMRequest(**base, iteration=2),
        LLMResponse(**base, iteration=2),
    ]
    if end:
        events.append(LoopEnd(**base, iteration=2, reason="task_completion"))
    return [(e, f"{turn}:{n}") for n, e in enumerate(events)]


def snapshot(**kw):
    return SessionSnapshot(tenant="chaos", session="c0", turn_id="t0", turns=1, **kw)


def run(label="c0-t0", pid=7, end=10.0):
    return {"label": label, "pid": pid, "start": end - 1, "end": end}


def test_a_clean_run_passes():
    v = check([TURN], {"c0": turn_events()}, [run()], [], {"c0": snapshot()})
    assert v.ok and v.ended == 1, v.problems()


def test_a_turn_without_loop_end_is_lost():
    v = check([TURN], {"c0": turn_events(end=False)}, [run()], [], {"c0": snapshot()})
    assert v.lost == ["c0/t0: no loop_end"]


def test_an_effect_applied_twice_is_a_duplicate_unless_in_flight_at_a_tool_worker_kill():
    twice = [run(pid=7, end=10.0), run(pid=8, end=14.0)]
    v = check([TURN], {"c0": turn_events()}, twice, [], {"c0": snapshot()})
    assert len(v.duplicates) == 1 and "applied 2 times" in v.duplicates[0]
    killed_after = [Kill(pid=7, at=10.5)]
    v = check([TURN], {"c0": turn_events()}, twice, killed_after, {"c0": snapshot()})
    assert v.ok and v.reruns == 1
    killed_before = [Kill(pid=7, at=9.0)]  # it ran after its worker was gone: impossible
    v = check([TURN], {"c0": turn_events()}, twice, killed_before, {"c0": snapshot()})
    assert not v.ok


def test_a_missing_event_a_duplicate_msg_id_and_a_stale_checkpoint_are_named():
    events = turn_events()
    del events[3]  # iteration 1's llm_response
    events.append(events[0])  # loop_start stored twice
    v = check([TURN], {"c0": events}, [run()], [], {"c0": snapshot(status="running")})
    assert any("iteration 1 lacks ['llm_response']" in g for g in v.gaps)
    assert any("stored 2 times" in d for d in v.duplicates)
    assert v.late == ["c0/t0: ['loop_start'] after loop_end"]  # counted, not a failure
    assert v.checkpoints and not v.ok


def test_a_completed_call_whose_effect_never_happened_is_a_gap():
    v = check([TURN], {"c0": turn_events()}, [], [], {"c0": snapshot()})
    assert v.gaps == ["c0/t0: call completed, effect never seen"]
