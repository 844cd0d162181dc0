"""``python -m bench.stream_parse`` keeps working: a small run reads the same stream every
way, in memory and over HTTP from the paced bench server, and prints a figure for each."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SMALL = [
    "--chunks", "50", "--repeats", "1",
    "--sessions", "4", "--tokens", "5", "--tokens-per-s", "50", "--seconds", "1",
]  # fmt: skip


@pytest.mark.slow
def test_a_small_run_prints_cpu_per_chunk_for_every_path() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "bench.stream_parse", *SMALL],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    for path in ("typed", "sse", "engine"):
        assert re.search(rf"^  {path} +[\d.]+ us +\(sse: [\d.]+x this\)$", run.stdout, re.M)
    for path in ("socket", "bytes", "sse", "engine"):
        line = re.search(
            rf"^  {path} +([\d.]+) us CPU per chunk .* (\d+) chunks/s", run.stdout, re.M
        )
        assert line is not None, run.stdout
        assert float(line.group(1)) > 0 and int(line.group(2)) > 0
    assert "sessions per core at 50 tok/s" in run.stdout
    assert re.search(r"engine: [\d.]+x less CPU per chunk than sse", run.stdout)
