"""``[loop] approval_tools``: names matched as users write them, and failing closed."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from pathlib import Path

import msgspec
import pytest

from loop_worker.config import LoopWorkerConfig
from loop_worker.engine.approvals import Approvals
from loop_worker.engine.settings import BudgetSettings
from loopmesh.nats import connect
from loopmesh.settings import load
from loopmesh.testing.durable import SUBJECTS
from loopmesh.testing.fake_llm import FakeLLM
from loopmesh.testing.fake_replies import tool_calls
from schemas import ApprovalDecision, ToolSpec, Turn
from schemas.events import ApprovalRequired, LoopEnd
from tests.conftest import BOTH_SHARED
from tests.loop_worker.durable import Mesh, Running, Watch, mesh_on, send_turn
from tests.loop_worker.scripted import Rig
from tool_worker.config import ToolWorkerConfig

CONFIGURATION = Path(__file__).resolve().parents[2] / "docs" / "CONFIGURATION.md"

FS = [ToolSpec(server="local", name=n) for n in ("fs_list", "fs_read", "fs_write")]


def test_a_name_matches_as_server_dot_tool_or_as_the_function_name_the_model_sees():
    for name in ("local.fs_write", "local__fs_write"):
        approvals = Approvals([name])
        assert approvals.unmatched(FS) == {}
        assert approvals.reason(FS[2], FS) is not None
        assert approvals.reason(FS[1], FS) is None


def test_a_name_that_matches_no_tool_names_the_closest_and_guards_every_tool():
    approvals = Approvals(["fs.fs_write", "local.fs_read"])
    unmatched = approvals.unmatched(FS)
    assert list(unmatched) == ["fs.fs_write"] and unmatched["fs.fs_write"][0] == "local.fs_write"
    assert approvals.reason(FS[0], FS) is not None  # fs_list: guarded, failing closed
    assert approvals.reason(FS[2], FS) is not None


def test_a_misspelt_approval_name_is_logged_with_the_closest_tools(caplog):
    caplog.set_level(logging.WARNING, logger="loopmesh.loop_worker.approvals")
    Approvals(["local.fs_wirte"]).report(FS)
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert "'local.fs_wirte'" in record.getMessage()
    assert "local.fs_write" in record.getMessage()


async def test_with_a_misspelt_name_the_engine_makes_every_tool_call_wait(
    fake_llm: FakeLLM,
) -> None:
    def delete(path: str) -> str:
        return f"deleted {path}"

    rig = Rig.openai(fake_llm, approval_tools=("local.delet",))
    rig.tools.add(delete)
    fake_llm.script(
        tool_calls(("local__echo", {"text": "hi"})),
        tool_calls(("task_completion", {"result": "done"})),
    )
    async with rig:
        task = asyncio.create_task(rig.run())
        asked = await rig.events.wait_for("approval_required")
        assert isinstance(asked, ApprovalRequired) and asked.tool == "echo"  # not listed
        assert rig.tools.runs == []
        await rig.control.decide(
            ApprovalDecision(tenant="acme", session="s1", call_id=asked.call_id, approved=True)
        )
        end = await asyncio.wait_for(task, 5)
    assert end.reason == "task_completion"
    assert [r.tool for r in rig.tools.runs] == ["echo"]


# -- the documented configuration, run as it is -----------------------------------------------


def readme_config(tmp_path: Path) -> Path:
    """The TOML block of docs/CONFIGURATION.md, as a file."""
    text = CONFIGURATION.read_text()
    section = text[text.index("# Configuration") :]
    block = re.search(r"```toml\n(.*?)```", section, re.DOTALL)
    assert block is not None
    path = tmp_path / "loopmesh.toml"
    path.write_text(block.group(1))
    return path


@pytest.fixture
async def mesh(durable):
    """The mesh on ``durable``: one server, or the module's cluster for the test that
    asks for it."""
    async with mesh_on(durable.url, replicas=durable.replicas) as mesh:
        yield mesh


async def start_tool_worker(mesh: Mesh, config: ToolWorkerConfig) -> Running:
    """A tool worker built from ``config`` as ``loopmesh tool-worker`` builds it."""
    from tool_worker.cli import build
    from tool_worker.service import ToolWorker

    settings = config.tool_worker
    registry, servers = build(settings)
    nats = msgspec.structs.replace(config.nats, url=mesh.url, reconnect_wait_s=0.05)
    client = await connect(nats, name="tools")
    worker = ToolWorker(client, registry, pool=settings.pool, mcp=servers, ack_wait_s=2.0)
    stop = asyncio.Event()
    running = Running(worker, client, asyncio.create_task(worker.run(stop)))
    running.stop_event = stop
    mesh.running.append(running)
    async with asyncio.timeout(15):
        await worker.ready.wait()
    return running


@pytest.mark.parametrize("durable", BOTH_SHARED, indirect=True)  # the decision is recorded
async def test_the_readme_example_makes_fs_write_wait_for_a_persons_approval(mesh, tmp_path):
    path = readme_config(tmp_path)
    loop_config = load(LoopWorkerConfig, path, env={})
    tool_config = load(ToolWorkerConfig, path, env={})
    assert loop_config.loop.approval_tools  # the example lists one
    root = tmp_path / "files"
    root.mkdir()
    tool_config = msgspec.structs.replace(
        tool_config, tool_worker=msgspec.structs.replace(tool_config.tool_worker, fs_root=str(root))
    )
    await start_tool_worker(mesh, tool_config)
    # the documented cost ceiling would refuse the fake model, which has no price
    loop = msgspec.structs.replace(loop_config.loop, max_iterations=4, budget=BudgetSettings())
    worker = await mesh.loop_worker(loop=loop)
    catalog = worker.service.tools.catalog
    await catalog.loaded()
    assert Approvals(loop.approval_tools).unmatched(catalog.specs()) == {}  # names that match
    mesh.fake.script(tool_calls(("local__fs_write", {"path": "notes.txt", "content": "hi"})))
    async with Watch(mesh.nc) as watch:
        turn = Turn(id="t1", tenant="acme", session="s1", input="write", created_at=time.time())
        await send_turn(mesh.nc, turn)
        asked = await watch.wait("approval_required", "t1")
        assert isinstance(asked, ApprovalRequired)
        assert (asked.server, asked.tool) == ("local", "fs_write")
        assert not (root / "notes.txt").exists()  # the call is held until a decision
        assert watch.of("tool_result", "t1") == []
        decision = ApprovalDecision(
            tenant="acme", session="s1", call_id=asked.call_id, approved=True
        )
        await mesh.nc.publish(SUBJECTS.control("acme", "s1"), msgspec.json.encode(decision))
        end = await watch.wait("loop_end", "t1")
    assert isinstance(end, LoopEnd) and end.reason == "task_completion"
    assert (root / "notes.txt").read_text() == "hi"


async def test_a_loop_worker_reports_a_misspelt_approval_name_when_the_catalog_loads(
    mesh, tmp_path, caplog
):
    caplog.set_level(logging.WARNING, logger="loopmesh.loop_worker.approvals")
    path = readme_config(tmp_path)
    tool_config = load(ToolWorkerConfig, path, env={})
    tool_config = msgspec.structs.replace(
        tool_config,
        tool_worker=msgspec.structs.replace(tool_config.tool_worker, fs_root=str(tmp_path)),
    )
    await start_tool_worker(mesh, tool_config)
    loop = msgspec.structs.replace(
        load(LoopWorkerConfig, path, env={}).loop,
        approval_tools=("local.fs_wirte",),
        budget=BudgetSettings(),  # the documented cost ceiling would refuse the fake model
    )
    worker = await mesh.loop_worker(loop=loop)
    await worker.service.tools.catalog.loaded()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("'local.fs_wirte'" in w and "local.fs_write" in w for w in warnings), warnings
