"""A bench run as a user runs it (``python -m bench.<name> ...``), for the tests that
check a bench still works end to end."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_bench(module: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """``python -m <module> <args>`` from the project's root: its exit status and output."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
