"""Tools from installed packages' ``loopmesh.tools`` entry points, and the refusals."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from loopmesh.testing.durable import ROOT
from tool_worker.entrypoints import load_entry_points
from tool_worker.errors import EntryPointError

GROUP = "loopmesh.tests.tools"  # not the real group: what the environment installs is not ours

MODULE = '''
from tool_worker import tool

@tool(server="pkg")
def shout(text: str) -> str:
    """Upper-case a text."""
    return text.upper()

@tool(server="pkg")
async def whisper(text: str) -> str:
    """Lower-case a text."""
    return text.lower()

def plain(text: str) -> str:
    return text

TOOLS = [shout, whisper]
NOT_A_LIST = 3
'''


@pytest.fixture
def packages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An installed distribution (a dist-info on sys.path) with entry points of GROUP."""
    (tmp_path / "pkgtools.py").write_text(MODULE)
    (tmp_path / "broken.py").write_text("raise RuntimeError('bad import')\n")
    info = tmp_path / "pkgtools-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: pkgtools\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        f"[{GROUP}]\n"
        "module = pkgtools\n"
        "one = pkgtools:shout\n"
        "listed = pkgtools:TOOLS\n"
        "plain = pkgtools:plain\n"
        "number = pkgtools:NOT_A_LIST\n"
        "broken = broken\n"
        "missing = pkgtools:nothing_here\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def names(tools: list) -> list[str]:
    return sorted(f"{t.server}.{t.name}" for t in tools)


async def test_a_module_a_function_and_a_list_load_their_tools(packages: Path) -> None:
    assert names(load_entry_points(["module"], group=GROUP)) == ["pkg.shout", "pkg.whisper"]
    (shout,) = load_entry_points(["one"], group=GROUP)
    assert await shout.invoke({"text": "hi"}) == "HI"
    assert names(load_entry_points(["listed"], group=GROUP)) == ["pkg.shout", "pkg.whisper"]
    assert load_entry_points([], group=GROUP) == []


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("nope", r"no installed package provides it \(installed: broken, listed, missing"),
        ("broken", "RuntimeError: bad import"),
        ("missing", "AttributeError"),
        ("plain", "is not decorated with @tool"),
        ("number", "is a int, not a @tool function or a list"),
    ],
)
def test_a_missing_or_broken_entry_point_is_refused(packages: Path, name: str, message: str):
    with pytest.raises(EntryPointError, match=message) as caught:
        load_entry_points(["module", name], group=GROUP)
    assert caught.value.name == name


def test_all_means_every_entry_point_and_nothing_else(packages: Path) -> None:
    with pytest.raises(EntryPointError, match="name nothing else"):
        load_entry_points(["*", "module"], group=GROUP)
    with pytest.raises(EntryPointError, match="broken"):  # every one, the broken one too
        load_entry_points(["*"], group=GROUP)
    with pytest.raises(EntryPointError, match="no installed package has"):
        load_entry_points(["*"], group="loopmesh.tests.nothing")


def test_two_packages_with_one_name_are_refused(packages: Path) -> None:
    info = packages / "other-2.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: other\nVersion: 2.0\n")
    (info / "entry_points.txt").write_text(f"[{GROUP}]\none = pkgtools:whisper\n")
    with pytest.raises(EntryPointError, match="several installed packages provide it"):
        load_entry_points(["one"], group=GROUP)


def test_the_worker_refuses_to_start_without_an_entry_point_it_was_told_to_serve() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "loopmesh", "tool-worker", "--entry-point", "no-such-tools",
         "--nats-url", "nats://127.0.0.1:9"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert "cannot load tool entry point 'no-such-tools': no installed package provides it" in (
        done.stderr
    )
    assert "Traceback" not in done.stderr
