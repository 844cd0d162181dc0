"""``loopmesh tool-worker`` and ``loopmesh up`` as a person runs them from a project's
folder: the ``loopmesh`` script (not ``python -m``, which puts the folder on the path
itself), a module of that folder, a pool named on the command line."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from nats.js import JetStreamContext

from loopmesh import up
from loopmesh.catalog import read_catalog
from loopmesh.server import NatsServer
from tool_worker.files import fs_tools

from .harness import ROOT, SUBJECTS

pytestmark = pytest.mark.slow

#: The console script people run: its own folder is on sys.path, not theirs.
LOOPMESH = str(Path(sys.executable).parent / "loopmesh")

TOOLS = '''
from tool_worker import tool


@tool
def lookup(term: str) -> str:
    """Look a term up."""
    return term


@tool
def shout(text: str) -> str:
    """Say it loudly."""
    return text.upper()
'''


def project(tmp_path: Path) -> Path:
    """A folder with the package ``myproject`` and its module ``myproject.tools``."""
    folder = tmp_path / "project"
    (folder / "myproject").mkdir(parents=True)
    (folder / "myproject" / "__init__.py").write_text("")
    (folder / "myproject" / "tools.py").write_text(TOOLS)
    return folder


def env() -> dict[str, str]:
    """This checkout's code, no LOOPMESH_ settings, an LLM endpoint so that ``up`` starts
    no embedded model; nothing that puts the current folder on the path."""
    out = {k: v for k, v in os.environ.items() if not k.startswith("LOOPMESH_")}
    out["PYTHONPATH"] = str(ROOT)
    out["LOOPMESH_LLM__BASE_URL"] = "http://127.0.0.1:9/v1"
    out["LOOPMESH_GATEWAY__PORT"] = "0"  # not 8080: another test's `up` may hold it
    return out


def tool_worker(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [LOOPMESH, "tool-worker", "--provision-only", *args], cwd=cwd, env=env(),
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


async def test_pool_and_module_serve_a_module_of_the_current_folder_in_that_pool(
    nats_server: NatsServer, js: JetStreamContext, tmp_path: Path
) -> None:
    folder = project(tmp_path)
    config = tmp_path / "loopmesh.toml"
    config.write_text('[tool_worker]\nassign = { "local.shout" = "loud" }\n')
    result = await asyncio.to_thread(
        tool_worker, folder, "--nats-url", nats_server.url, "--config", str(config),
        "--pool", "search", "--module", "myproject.tools",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "serves no tools" not in result.stderr
    served = {(s.pool, f"{s.server}.{s.name}") for s in await read_catalog(js, SUBJECTS)}
    assert ("search", "local.lookup") in served  # the module's tool, in the pool named
    assert not {name for pool, name in served if pool == "search"} - {"local.lookup"}
    assert ("search", "local.shout") not in served  # assign still puts it elsewhere


async def test_a_worker_that_serves_no_tools_says_so_and_what_to_set(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    proc = await asyncio.create_subprocess_exec(
        LOOPMESH, "tool-worker", "--nats-url", nats_server.url, "--pool", "search",
        cwd=tmp_path, env=env(), stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stderr is not None
    warning = ""
    try:
        async with asyncio.timeout(60):
            while "serving pool=" not in (line := (await proc.stderr.readline()).decode()):
                assert line, "the worker ended"
                if "serves no tools" in line:
                    warning = line
    finally:
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 60) == 0
    assert "level=warning" in warning and "pool search serves no tools" in warning
    assert "the tools loaded are in pool default" in warning
    assert "--pool search --module PKG.MODULE" in warning
    assert "[tool_worker] assign" in warning

    result = await asyncio.to_thread(
        tool_worker, tmp_path, "--nats-url", nats_server.url, "--pool", "search"
    )  # provisioning a pool ahead of its workers refuses an empty one
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "loopmesh tool-worker: error: cannot provision pool 'search': it has no tools: assign "
        "tools to it in [tool_worker] assign, or serve a module's tools in it with --pool "
        "search --module PKG.MODULE"
    ), result.stderr


def test_a_module_that_is_not_there_is_a_one_line_error(tmp_path: Path) -> None:
    result = tool_worker(tmp_path, "--pool", "search", "--module", "myproject.tools")
    assert result.returncode == 1
    said = "loopmesh tool-worker: error: cannot load tool module 'myproject.tools': ModuleNotFound"
    assert result.stderr.strip().splitlines()[-1].startswith(said), result.stderr


async def test_up_serves_the_tools_module_of_the_current_folder(tmp_path: Path) -> None:
    folder = project(tmp_path)
    proc = await asyncio.create_subprocess_exec(
        LOOPMESH, "up", "--port", "-1", "--monitor-port", "-1",
        "--store-dir", str(tmp_path / "store"), "--tools-module", "myproject.tools",
        cwd=folder, env=env(), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    lines = []
    try:
        async with asyncio.timeout(60):
            while not (lines and lines[-1].startswith("tools ")):
                line = (await proc.stdout.readline()).decode()
                assert line, f"loopmesh up ended: {(await proc.stderr.read()).decode()}"
                lines.append(line)
    finally:
        proc.send_signal(signal.SIGINT)
        await asyncio.wait_for(proc.wait(), 60)
    assert "local.lookup" in lines[-1] and "local.shout" in lines[-1]


def test_up_help_names_the_file_tools_as_they_are_served(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    up.configure(parser)
    said = " ".join(parser.format_help().split())
    names = [f"{t.server}.{t.name}" for t in fs_tools(tmp_path)]
    assert len(names) == 3 and all(name in said for name in names), said
    assert 'approval_tools = ["local.fs_write"]' in said
