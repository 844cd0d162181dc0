"""The examples in examples/ run as the README shows them: a real nats-server, a real
loop worker and tool worker, the fake OpenAI server as the model, and the real gateway
for the client's example through it."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from loopmesh.agents import apply_agents
from loopmesh.testing.durable import ROOT, SUBJECTS, Proc
from schemas import AgentSpec
from tests.gateway.conftest import ACME_KEY, KEYS
from tests.loop_worker.durable import Mesh, count_task, gateway_on, mesh_on


@pytest.fixture
async def mesh(nats_server) -> AsyncIterator[Mesh]:
    async with mesh_on(nats_server.url, workers=True) as mesh:
        yield mesh


async def test_the_nats_py_example_publishes_a_turn_and_prints_its_events_to_the_end(mesh: Mesh):
    task = 'call local__echo {"text": "hi there"}'
    proc = Proc(
        str(ROOT / "examples" / "publish_turn.py"), "--url", mesh.url,
        "--tenant", "acme", "--session", "ex1", "--timeout", "60", task,
    )  # fmt: skip
    await proc.start()
    assert proc.proc is not None
    assert await asyncio.wait_for(proc.proc.wait(), 90) == 0, proc.output()
    await proc.close()
    types = [line.split()[0] for line in proc.lines[1:-1]]
    assert proc.lines[0].startswith("publishing turn ")
    assert types[:2] == ["turn_accepted", "loop_start"] and types[-1] == "loop_end", types
    assert "tool_call" in types and "tool_result" in types
    end = json.loads(proc.lines[-2].split(" ", 1)[1])
    assert end["reason"] == "task_completion"
    assert proc.lines[-1] == "done: hi there"


async def test_the_example_runs_a_turn_of_a_named_agent(mesh: Mesh):
    assert mesh.fake is not None
    echo = AgentSpec(name="echoer", instructions="You echo.", model="echo-model")
    await apply_agents(mesh.nc.jetstream(), SUBJECTS, [echo])
    assert await mesh.running[-1].service.agents.wait_for(lambda b: b.get("echoer"), 10)
    proc = Proc(
        str(ROOT / "examples" / "publish_turn.py"), "--url", mesh.url, "--tenant", "acme",
        "--session", "ex2", "--agent", "echoer", "--timeout", "60",
        'call local__echo {"text": "hi"}',
    )  # fmt: skip
    await proc.start()
    assert proc.proc is not None
    assert await asyncio.wait_for(proc.proc.wait(), 90) == 0, proc.output()
    await proc.close()
    start = json.loads(
        next(li for li in proc.lines if li.startswith("loop_start")).split(" ", 1)[1]
    )
    assert start["agent"] == "echoer" and start["model"] == "echo-model"
    assert "You echo." in mesh.fake.requests_for("echo-model")[0]["messages"][0]["content"]


def test_the_example_needs_only_nats_py():
    source = (ROOT / "examples" / "publish_turn.py").read_text()
    imports = {line.split()[1].split(".")[0] for line in source.splitlines()
               if line.startswith(("import ", "from "))}  # fmt: skip
    assert imports - set(sys.stdlib_module_names) == {"nats"}


@pytest.mark.parametrize("transport", ["nats", "gateway"])
async def test_the_client_example_runs_a_turn_and_decides_its_approval(
    transport: str, mesh: Mesh, tmp_path: Path
):
    target = tmp_path / "g"
    task = count_task(target, "ok", tool="guarded")  # its call waits for a person
    async with gateway_on(mesh.url, api_keys=KEYS) as gw:
        where = (
            ["--gateway", gw.url, "--api-key", ACME_KEY]
            if transport == "gateway"
            else ["--url", mesh.url, "--tenant", "acme"]
        )
        proc = Proc(
            str(ROOT / "examples" / "run_turn.py"), *where, "--session", "ex1", "--approve",
            "--timeout", "60", task,
        )  # fmt: skip
        await proc.start()
        assert proc.proc is not None
        assert await asyncio.wait_for(proc.proc.wait(), 90) == 0, proc.output()
        await proc.close()
    assert target.read_text() == "ok\n"  # approved, so it ran
    assert proc.lines[0] == "turn_accepted" and proc.lines[1] == "loop_start"
    assert any(li.startswith("tool_call local.guarded ") for li in proc.lines), proc.lines
    assert "approval_required guarded: approving" in proc.lines
    assert proc.lines[-1].startswith("loop_end task_completion: done: ")


async def test_the_a2a_example_streams_an_agents_answer_through_the_gateway(mesh: Mesh):
    from gateway.server import GatewayServer
    from gateway.settings import GatewayConfig, GatewaySettings
    from loopmesh.settings import NatsSettings

    config = GatewayConfig(
        nats=NatsSettings(url=mesh.url), gateway=GatewaySettings(port=0, no_auth=True)
    )
    async with GatewayServer(config) as gw:
        proc = Proc(
            str(ROOT / "examples" / "a2a_client.py"), "--url", f"{gw.url}/a2a/default",
            'call local__echo {"text": "hi over A2A"}',
        )  # fmt: skip
        await proc.start()
        assert proc.proc is not None
        assert await asyncio.wait_for(proc.proc.wait(), 90) == 0, proc.output()
        await proc.close()
    assert proc.lines[0].startswith("task ")
    assert "done: hi over A2A" in proc.output()
    assert proc.lines[-1] == "[TASK_STATE_COMPLETED]"


async def test_the_a2a_snippet_in_agents_md_works(mesh: Mesh, capsys: pytest.CaptureFixture[str]):
    import re

    from gateway.auth import key_hash
    from gateway.server import GatewayServer
    from gateway.settings import ApiKey, GatewayConfig, GatewaySettings
    from loopmesh.settings import NatsSettings

    section = (ROOT / "docs" / "AGENTS.md").read_text().split("**A client**", 1)[1]
    block = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert block is not None
    keys = (ApiKey(sha256=key_hash("k-1"), tenant="acme"),)
    config = GatewayConfig(
        nats=NatsSettings(url=mesh.url), gateway=GatewaySettings(port=0, api_keys=keys)
    )
    await apply_agents(mesh.nc.jetstream(), SUBJECTS, [AgentSpec(name="calc")])
    assert await mesh.running[-1].service.agents.wait_for(lambda b: b.get("calc"), 10)
    async with GatewayServer(config) as gw:
        code = block.group(1).replace("http://127.0.0.1:8080", gw.url)
        namespace: dict[str, object] = {"KEY": "k-1"}
        exec(compile(code, "AGENTS.md", "exec"), namespace)
        await namespace["ask"]('call local__echo {"text": "from the docs"}')  # type: ignore[operator]
    printed = capsys.readouterr().out
    assert "done: from the docs" in printed and "TASK_STATE_COMPLETED" in printed
