"""The partition run's own checks on records made by hand: a write for a turn after
it ended, a snapshot that goes back, and an ask answered by two leaders are named; a
clean record passes."""

import msgspec

from schemas import SessionSnapshot
from schemas.limits import LimitSettle

from .checker import Accepted
from .observed import Cut, two_leaders, zombies
from .test_checker import turn_events

CUT = Cut("cut_loop_worker", "lw0-1", 1.0, 5.0, turns=(("c0", "t0"),))


def snap(turn: str, status: str, turns: int) -> tuple[str, SessionSnapshot]:
    s = SessionSnapshot(tenant="chaos", session="c0", turn_id=turn, status=status, turns=turns)
    return ("chaos.c0", s)


def test_a_clean_record_has_no_zombie():
    snaps = [snap("t0", "running", 0), snap("t0", "idle", 1), snap("t1", "running", 1)]
    assert zombies([CUT], {"c0": turn_events()}, snaps) == []


def test_an_event_stored_after_its_turns_loop_end_is_a_zombie_write():
    events = turn_events()
    start = msgspec.structs.replace(events[0][0], worker="lw0-1")
    events.append((start, "c0.t0:loop_start:r2"))
    assert zombies([], {"c0": events}, []) == [
        "c0/t0: ['loop_start c0.t0:loop_start:r2 by lw0-1'] stored after its loop_end"
    ]
    assert zombies([CUT], {"c0": events}, []) == [
        "c0/t0 (running on lw0-1 when it was cut): ['loop_start c0.t0:loop_start:r2 by "
        "lw0-1'] stored after its loop_end"
    ]


def test_a_call_started_after_its_turns_loop_end_is_a_zombie_write():
    events = turn_events()
    end = events[-1][0]
    assert end.type == "loop_end"
    events[-1] = (msgspec.structs.replace(end, ts=10.0), events[-1][1])
    turn = Accepted("c0", "t0", "c0-t0")
    before = {"label": "c0-t0", "pid": 7, "start": 9.0, "end": 9.5}
    assert zombies([], {"c0": events}, [], [turn], [before]) == []
    after = before | {"start": 10.5, "end": 11.0}
    assert zombies([], {"c0": events}, [], [turn], [after]) == [
        "c0-t0: a call started 0.500s after its turn's loop_end (pid 7)"
    ]


def test_a_snapshot_that_goes_back_is_a_zombie_write():
    back = [snap("t0", "idle", 1), snap("t0", "running", 0)]
    assert zombies([], {}, back) == [
        "chaos.c0: snapshot of 0 turns after one of 1",
        "chaos.c0: turn t0 running again after it ended",
    ]


def grant(ident: str, leader: str, term: int, at: float, sent: bool = True) -> LimitSettle:
    return LimitSettle(id=ident, leader=leader, term=term, granted_at=at, sent=sent)


def test_grants_of_two_leaders_at_once_are_named_and_a_handover_is_not():
    handover = [grant("a", "lw0", 3, 1.0), grant("b", "lw0", 3, 2.0), grant("c", "lw1", 9, 2.5)]
    assert two_leaders(handover) == []
    late = [*handover, grant("d", "lw0", 3, 2.75)]  # the old leader still granting
    assert two_leaders(late) == ["ask d granted by lw0 (term 3) 0.250s after lw1 granted in term 9"]
    refused = [*handover, grant("d", "lw0", 3, 2.75, sent=False)]  # never let go
    assert two_leaders(refused) == []
    shared = [*handover, grant("e", "lw2", 9, 3.0)]
    assert two_leaders(shared) == ["term 9 granted by both lw1 and lw2"]
    unlimited = [LimitSettle(id="f", tokens=5)]  # no grant to judge
    assert two_leaders(unlimited) == []


def test_an_effect_run_again_under_its_idempotency_key_is_excused_in_a_partition_run():
    from .checker import check
    from .test_checker import TURN, run, snapshot

    again = [run(pid=7, end=10.0) | {"key": "k"}, run(pid=8, end=14.0) | {"key": "k"}]
    v = check([TURN], {"c0": turn_events()}, again, [], {"c0": snapshot()}, same_key=True)
    assert v.ok and v.reruns == 1
    other = [again[0], again[1] | {"key": "k2"}]
    v = check([TURN], {"c0": turn_events()}, other, [], {"c0": snapshot()}, same_key=True)
    assert not v.ok and "applied 2 times" in v.duplicates[0]
