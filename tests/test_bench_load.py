"""``python -m bench.load`` keeps working: its smallest configuration (one nats-server, one
loop worker, a few seconds of back-to-back turns) runs end to end, as a user runs it, and
prints sane figures."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.benches import run_bench

SMALLEST = [
    "--servers", "r1", "--workers", "1", "--loads", "back-to-back", "--sessions", "4",
    "--turns", "24", "--turns-per-session", "3", "--watched", "2",
    "--ttft-ms", "50", "--tokens", "5",
]  # fmt: skip


def bench(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return run_bench("bench.load", *args, timeout=timeout)


@pytest.mark.slow
@pytest.mark.serial  # it measures: a load beside it skews its figures
def test_the_smallest_configuration_runs_end_to_end_with_sane_figures(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    run = bench(*SMALLEST, "--json", str(out), timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    for line in (
        "== R1, 1 loop worker, back-to-back: 4 sessions of 3 turns, 24 turns ==",
        "turns/s",
        "turn latency over the model's time",
        "stalls (over 1 s more than the model's time): 0",
        "added latency per token",
        "loop workers + nats-server:",
        "LOOPMESH_EVENTS",
        "| R1 | 1 | back-to-back |",
    ):
        assert line in run.stdout, run.stdout
    [figures] = json.loads(out.read_text())
    assert figures["turns"] == 24 and figures["turns_per_s"] > 0
    assert figures["reasons"] == {"task_completion": 24}
    assert figures["stalls"] == 0
    assert 0 <= figures["over_ms"][0] <= figures["over_ms"][1] <= figures["over_ms"][2] < 1000
    # two watched sessions of three turns: two replies of five tokens each turn
    assert figures["watched"] == 4  # two clients, each two sessions (3 turns, then 3)
    sent, received = figures["tokens_sent_received"]
    assert sent == received == 4 * 3 * 2 * 5 and figures["text_equal"]
    assert 0 < figures["token_ms"][0] <= figures["token_ms"][1] < 1000
    assert figures["retracts"] == 0
    assert figures["events_per_turn"] > 0 and figures["kb_per_turn"] > 0
    assert figures["cpu_us_per_token_workers_nats"] > 0


def test_a_configuration_it_cannot_run_is_refused_with_why() -> None:
    run = bench("--servers", "r2", timeout=60)
    assert run.returncode == 2
    assert "--servers: r1 or r3, not 'r2'" in run.stderr
