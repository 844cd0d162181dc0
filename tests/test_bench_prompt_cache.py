"""``python -m bench.prompt_cache`` keeps working: a small session prints each turn's share
of cached prompt tokens, and the share grows from the first turn to the last."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("fmt", ["native", "text"])
def test_a_small_session_prints_a_growing_cached_share(fmt: str) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "bench.prompt_cache", "--turns", "3", "--format", fmt],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    shares = [
        float(s)
        for s in re.findall(
            r"^  turn +\d+: +\d+ prompt tokens, +([\d.]+)% cached$", run.stdout, re.M
        )
    ]
    assert len(shares) == 3 and 0 < shares[0] < shares[1] < shares[2] < 100, run.stdout
    assert re.search(r"^  all turns: \d+ prompt tokens, \d+ cached: [\d.]+%$", run.stdout, re.M)
