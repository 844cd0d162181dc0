"""``python -m bench.memory`` keeps working: a small namespace is written, loaded and
searched on a real nats-server, and a row of figures is printed for it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_a_small_run_prints_its_figures() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "bench.memory", "--sizes", "300", "--searches", "10"],
        cwd=ROOT, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    row = re.search(r"^ +300 +(\d+) +([\d.]+) +([\d.]+) +([\d.]+) +(-?[\d.]+)$", run.stdout, re.M)
    assert row is not None, run.stdout
    assert int(row.group(1)) > 0 and float(row.group(3)) > 0
