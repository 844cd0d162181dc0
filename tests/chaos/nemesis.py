"""The nemesis: a schedule of faults that a seed picks, and the hands that apply it.

    for action in schedule(seed, lease_ttl_s=2.0, span_s=20.0):
        ...  # at action.at seconds: kill, restart or pause action.target

Kinds: ``kill_loop_worker`` / ``kill_tool_worker`` (SIGKILL, started again after
``hold`` seconds), ``kill_leader_node`` (SIGKILL of the node leading the turns stream,
started again with its store), ``pause_node`` (SIGSTOP for ``hold`` seconds, longer
than the lease TTL, then SIGCONT) and ``rolling_restart`` (every node restarted, one
after another). Node faults never overlap, so a quorum stays up.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

#: How many of each fault one run applies.
FAULTS = {
    "kill_loop_worker": 3,
    "kill_tool_worker": 2,
    "kill_leader_node": 1,
    "pause_node": 1,
    "rolling_restart": 1,
}


@dataclass(frozen=True)
class Action:
    at: float  # seconds after the run starts
    kind: str
    target: int  # which worker (0 or 1) or node (0-2); the leader for kill_leader_node
    hold: float  # seconds down or paused

    def __str__(self) -> str:
        return f"{self.at:6.2f}s {self.kind} #{self.target} for {self.hold:.2f}s"


def schedule(seed: int, *, lease_ttl_s: float, span_s: float) -> list[Action]:
    """The faults of a run, in order: the same seed, the same schedule."""
    rng = random.Random(seed)
    kinds = [kind for kind, n in FAULTS.items() for _ in range(n)]
    rng.shuffle(kinds)
    step = span_s / len(kinds)
    actions, at = [], 0.5
    for kind in kinds:
        at += rng.uniform(0.2, step)
        if kind == "pause_node":
            hold = lease_ttl_s + rng.uniform(0.5, 2.0)
        else:
            hold = rng.uniform(0.1, 1.5)
        target = rng.randrange(3 if kind.endswith("node") else 2)
        actions.append(Action(round(at, 2), kind, target, round(hold, 2)))
    return actions


#: A partition run's faults, one of each (:mod:`.netsplit`): a node cut from the
#: other two; a loop worker, a tool worker and the rate-limit leader cut from everyone.
CUTS = ("cut_node", "cut_loop_worker", "cut_tool_worker", "cut_limiter_leader")


def cut_schedule(seed: int, *, longest_ttl_s: float, span_s: float) -> list[Action]:
    """The cuts of a partition run, in order. Each lasts longer than ``longest_ttl_s``
    (the lease TTL, AckWait, the limiter leader's TTL: the one that applies must lapse)
    and ends before the next starts."""
    rng = random.Random(seed)
    kinds = list(CUTS)
    rng.shuffle(kinds)
    step = span_s / len(kinds)
    actions = []
    for n, kind in enumerate(kinds):
        hold = longest_ttl_s + rng.uniform(0.5, 1.5)
        at = 1.0 + n * step + rng.uniform(0.0, max(0.0, step - hold - 1.0))
        target = rng.randrange(3 if kind == "cut_node" else 2)
        actions.append(Action(round(at, 2), kind, target, round(hold, 2)))
    return actions
