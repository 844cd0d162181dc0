"""``loopmesh agents`` and ``loopmesh run --agent`` as a person types them: real processes
against a real nats-server, a loop worker and a tool worker, the fake OpenAI server as
the model, and the real gateway for ``--gateway``."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from gateway.server import GatewayServer
from loopmesh.agents import apply_agents
from loopmesh.testing.durable import SUBJECTS
from schemas import AgentSpec
from tests.loop_worker.durable import Mesh, mesh_on
from tests.loopmesh.commands.test_commands import TRANSPORTS, count_task, gateway, loopmesh, via

pytestmark = pytest.mark.slow

__all__ = ["gateway"]  # the fixture, shared

CALC = AgentSpec(
    name="calc",
    description="Counts with the count tool.",
    instructions="You are a careful counter.\nCount once.",
    model="calc-model",
    tools=("local.count",),
)


@pytest.fixture
async def mesh(nats_server) -> AsyncIterator[Mesh]:
    async with mesh_on(nats_server.url, workers=True) as mesh:
        await apply_agents(mesh.nc.jetstream(), SUBJECTS, [CALC])
        assert await mesh.running[-1].service.agents.wait_for(
            lambda b: b.get("calc") is not None, 10
        )
        yield mesh


async def test_agents_lists_them_and_shows_one(mesh: Mesh):
    code, lines = await loopmesh("agents", "--nats-url", mesh.url)
    assert code == 0, lines
    assert lines[0].split() == ["AGENT", "REVISION", "MODEL", "TOOLS", "DESCRIPTION"]
    assert [line.split()[0] for line in lines[1:]] == ["default", "calc"]
    calc = lines[2].split()
    assert calc[2:5] == ["calc-model", "local.count", "Counts"] and int(calc[1]) > 0

    code, lines = await loopmesh("agents", "--nats-url", mesh.url, "calc")
    assert code == 0, lines
    shown = {line.split()[0]: line.split(None, 1)[1] for line in lines if line[:1] != " "}
    assert shown["name"] == "calc" and shown["model"] == "calc-model"
    assert shown["instructions"] == "You are a careful counter."  # and its next line
    assert shown["fallback_models"] == "(the deployment's [llm] fallback_models)"

    code, lines = await loopmesh("agents", "--nats-url", mesh.url, "calc", "--json")
    assert code == 0 and json.loads(lines[0])["tools"] == ["local.count"]

    code, lines = await loopmesh("agents", "--nats-url", mesh.url, "nobody")
    assert code == 1 and "no agent 'nobody' (defined: default, calc)" in "\n".join(lines)


async def test_agents_apply_provisions_the_configured_agents_and_workers_take_them(
    mesh: Mesh, tmp_path: Path
):
    config = tmp_path / "loopmesh.toml"
    config.write_text(
        '[[agents]]\nname = "calc"\ninstructions = "You count twice."\n'
        'tools = ["local.count"]\n\n'
        '[[agents]]\nname = "clock"\ndescription = "Tells the time."\n'
        'tools = ["local.clock"]\n'
    )
    code, lines = await loopmesh(
        "agents", "--nats-url", mesh.url, "--config", str(config), "--apply"
    )
    assert code == 0, lines
    assert [line.split(" (")[0] for line in lines if line.startswith(("created", "updated"))] == [
        "updated agent calc", "created agent clock",
    ]  # fmt: skip
    assert "warning: agent clock.tools[0]: 'local.clock' matches no tool in the catalog" in (
        "\n".join(lines)
    )
    book = mesh.running[-1].service.agents
    assert await book.wait_for(lambda b: b.get("clock") is not None, 10)
    assert book.get("calc").instructions == "You count twice."

    config.write_text('[[agents]]\nname = "calc"\nagents = ["nobody"]\n')
    code, lines = await loopmesh(
        "agents", "--nats-url", mesh.url, "--config", str(config), "--apply"
    )
    assert code == 1 and "agents[0].agents[0]" in "\n".join(lines)  # refused, nothing written
    assert book.get("clock") is not None


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_run_with_agent_runs_a_turn_of_that_agent(
    transport: str, mesh: Mesh, gateway: GatewayServer, tmp_path: Path
):
    assert mesh.fake is not None
    target = tmp_path / "n"
    code, lines = await loopmesh(
        "run", *via(transport, mesh, gateway), "--session", "s1", "--agent", "calc",
        count_task(target),
    )  # fmt: skip
    assert code == 0, lines
    out = "\n".join(lines)
    assert "· agent calc · model calc-model ·" in out
    assert target.read_text() == "a\n"
    [first, *_] = mesh.fake.requests_for("calc-model")
    assert "You are a careful counter." in first["messages"][0]["content"]

    code, lines = await loopmesh(
        "run", *via(transport, mesh, gateway), "--session", "s1", "--agent", "default", "hello"
    )
    assert code == 1, lines
    assert "fatal agent_mismatch: session 's1' belongs to agent 'calc'" in "\n".join(lines)
