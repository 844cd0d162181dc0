"""The verdict of a chaos run: a plain function over what was recorded.

:func:`check` takes the accepted turns, every stored event of their sessions (stream
order, with msg ids), the tool's ledger of executions, the tool workers that were
killed and when, and the final session snapshots, and says what went wrong:

- **lost**: an accepted turn without a ``loop_end``, or whose end is not
  ``task_completion`` (every turn here can complete);
- **duplicates**: a ``loop_end`` or any other msg id stored twice; a tool effect applied
  twice, unless the extra execution was in flight at a tool-worker kill (it ran on a
  worker killed after it ran, before the call was recorded: the honest guarantee is once
  per call after completion, at least once for a call in flight at a crash);
- **gaps**: a turn whose iterations miss one of their events, a completed call whose
  effect never happened;
- **late** (counted, not a failure): events of a turn stored after its ``loop_end``,
  each under its own msg id. A worker on a paused node has publishes sitting in that
  node's socket; the node forwards them when it resumes, after another worker took the
  turn over and ended it (docs/ARCHITECTURE.md, "On a cluster");
- **checkpoints**: a session whose last snapshot is not idle at its last turn, with
  every turn counted and nothing pending.

A partition run (:mod:`.netsplit`, ``same_key=True``) excuses an effect applied again
under the call's idempotency key (a tool worker cut off during a call finishes it
unheard, and the call runs again elsewhere), and adds what :mod:`.observed` finds:
**zombies** (writes for a turn by a worker that no longer held it) and **leaders** (two
rate-limit leaders answering the same ask).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from schemas import SessionSnapshot
from schemas.events import Event

#: What every iteration of a turn stores; the first (the tool call's) also its call.
ITERATION = ("loop_iteration", "llm_request", "llm_response")
CALL = ("tool_call", "tool_result")


@dataclass(frozen=True)
class Accepted:
    """A turn the stream acknowledged, and the ledger label of its one tool call."""

    session: str
    turn_id: str
    label: str


@dataclass(frozen=True)
class Kill:
    """A tool-worker process killed with SIGKILL at ``at`` (wall clock)."""

    pid: int
    at: float


@dataclass
class Verdict:
    turns: int = 0
    ended: int = 0
    lost: list[str] = field(default_factory=list)
    duplicates: list[str] = field(default_factory=list)
    gaps: list[str] = field(default_factory=list)
    checkpoints: list[str] = field(default_factory=list)
    reruns: int = 0  # executions excused: in flight at a tool-worker kill
    late: list[str] = field(default_factory=list)
    crashes: list[str] = field(default_factory=list)  # workers that died unkilled (the run's)
    zombies: list[str] = field(default_factory=list)  # a partition run's
    leaders: list[str] = field(default_factory=list)  # a partition run's

    @property
    def ok(self) -> bool:
        return not self.problems()

    def summary(self) -> str:
        return (
            f"turns {self.turns}, ended {self.ended}, lost {len(self.lost)}, "
            f"duplicates {len(self.duplicates)}, gaps {len(self.gaps)}, "
            f"checkpoint mismatches {len(self.checkpoints)}, crashes {len(self.crashes)}, "
            f"reruns excused {self.reruns}, "
            f"late events after a loop_end {len(self.late)}, zombie writes "
            f"{len(self.zombies)}, asks answered by two leaders {len(self.leaders)}"
        )

    def problems(self) -> list[str]:
        return [
            *self.lost, *self.duplicates, *self.gaps, *self.checkpoints, *self.crashes,
            *self.zombies, *self.leaders,
        ]  # fmt: skip


def check(
    accepted: Sequence[Accepted],
    events: Mapping[str, Sequence[tuple[Event, str]]],
    ledger: Iterable[Mapping[str, Any]],
    kills: Iterable[Kill],
    snapshots: Mapping[str, SessionSnapshot | None],
    *,
    same_key: bool = False,
) -> Verdict:
    """The verdict over one run (see the module's docstring)."""
    v = Verdict(turns=len(accepted))
    runs: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for line in ledger:
        runs[str(line["label"])].append(line)
    killed = {k.pid: k.at for k in kills}
    for session, stored in events.items():
        for msg_id, n in Counter(m for _, m in stored).items():
            if n > 1:
                v.duplicates.append(f"{session}: msg id {msg_id} stored {n} times")
    for turn in accepted:
        stored = [e for e, _ in events.get(turn.session, ()) if e.turn_id == turn.turn_id]
        ends = [e for e in stored if e.type == "loop_end"]
        if not ends:
            v.lost.append(f"{turn.session}/{turn.turn_id}: no loop_end")
            continue
        v.ended += 1
        if len(ends) > 1:
            v.duplicates.append(f"{turn.session}/{turn.turn_id}: {len(ends)} loop_ends")
        if (reason := getattr(ends[0], "reason", "")) != "task_completion":
            v.lost.append(f"{turn.session}/{turn.turn_id}: ended with {reason}")
        after = stored[stored.index(ends[0]) + 1 :]
        if after:
            kinds = [e.type for e in after]
            v.late.append(f"{turn.session}/{turn.turn_id}: {kinds} after loop_end")
        last = max(e.iteration for e in stored)
        for k in range(1, last + 1):
            have = {e.type for e in stored if e.iteration == k}
            needed = ITERATION + (CALL if k == 1 else ())
            if missing := [t for t in needed if t not in have]:
                v.gaps.append(f"{turn.session}/{turn.turn_id}: iteration {k} lacks {missing}")
        completed = any(e.type == "tool_result" for e in stored)
        done = runs.get(turn.label, [])
        if completed and not done:
            v.gaps.append(f"{turn.session}/{turn.turn_id}: call completed, effect never seen")
        excused = [r for r in done[:-1] if _in_flight_at_kill(r, killed)]
        if same_key and len({r.get("key") for r in done}) == 1:
            excused = done[:-1]  # run again under one idempotency key
        v.reruns += len(excused)
        if len(done) - len(excused) > 1:
            pids = [r["pid"] for r in done]
            v.duplicates.append(
                f"{turn.session}/{turn.turn_id}: effect {turn.label} applied {len(done)} "
                f"times (pids {pids}), {len(excused)} in flight at a tool-worker kill"
            )
    by_session: dict[str, list[Accepted]] = defaultdict(list)
    for turn in accepted:
        by_session[turn.session].append(turn)
    for session, turns in by_session.items():
        snap = snapshots.get(session)
        want = (turns[-1].turn_id, "idle", len(turns), ())
        have = (snap.turn_id, snap.status, snap.turns, snap.pending) if snap else None
        if have != want:
            v.checkpoints.append(f"{session}: snapshot {have}, events say {want}")
    return v


def _in_flight_at_kill(run: Mapping[str, Any], killed: Mapping[int, float]) -> bool:
    """An execution whose worker was killed after it ran (before the call's record)."""
    at = killed.get(int(run["pid"]))
    return at is not None and at >= float(run["end"])
