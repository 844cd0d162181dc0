"""``python -m bench.fairness`` keeps working: its smallest configuration (one nats-server,
one loop worker of two turn slots, a flood of twenty turns) runs end to end, as a user runs
it, and prints every row of its tables and a verdict on every goal. What the figures are
is the bench's to say, not this test's."""

from __future__ import annotations

import re
import subprocess

import pytest

from tests.benches import run_bench

SMALLEST = [
    "--configs", "r1x1", "--max-active", "2", "--tenant-max-active", "1",
    "--flood-s", "1", "--alone-s", "1.5", "--back-to-back", "1",
    "--ttft-ms", "50", "--tokens", "3",
]  # fmt: skip
GOALS = [
    "goal: B's and C's p50 under the flood <= 1.5x alone",
    "goal: B's and C's p99 under the flood <= 3x alone",
    "goal: A alone >= 90% of the fleet's throughput",
    "goal: no turn of B or C > 1 s over the model's time",
]


def bench(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return run_bench("bench.fairness", *args, timeout=timeout)


@pytest.mark.slow
@pytest.mark.serial  # it measures: a load beside it skews its figures
def test_the_smallest_configuration_prints_every_row_and_a_verdict_on_every_goal() -> None:
    run = bench(*SMALLEST, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    assert (
        "== R1, 1 loop worker: 2 turn slots (max_active_turns 2 each, tenant_max_active 1)" in out
    )
    assert "A floods 20 turns at once" in out
    for tenant in ("B", "C", "A (floods)"):
        row = re.search(rf"^\| {re.escape(tenant)} \| (\d+) / (\d+) \|", out, re.M)
        assert row is not None, f"no row of {tenant}:\n{out}"
        assert int(row[1]) > 0 and int(row[2]) > 0, row[0]
    assert re.search(r"^A's throughput: alone [\d.]+ turns/s, beside B and C [\d.]+", out, re.M)
    for goal in GOALS:
        assert re.search(rf"^{re.escape(goal)} .* (PASS|FAIL)$", out, re.M), f"{goal}:\n{out}"
    assert re.search(r"^\| R1 \| 1 \| B .* \| \d of 4 \|$", out, re.M), out


def test_a_configuration_it_cannot_run_is_refused_with_why() -> None:
    run = bench("--configs", "r2x1", timeout=60)
    assert run.returncode == 2
    assert "--configs: r1xN or r3xN (N loop workers), not 'r2x1'" in run.stderr
