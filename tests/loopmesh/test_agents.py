"""Named agents in the configuration (checked as it loads, the error naming the field) and
in the agents bucket (provisioning makes it hold exactly the configured ones)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from loop_worker.config import LoopWorkerConfig
from loopmesh.agents import apply_agents, read_agents
from loopmesh.errors import ConfigError
from loopmesh.provision import provision_all
from loopmesh.settings import NatsSettings, load
from loopmesh.testing.durable import SUBJECTS, connect_fast
from loopmesh.up import UpConfig
from schemas import AgentSpec

CALC = """
[[agents]]
name = "calc"
description = "Does arithmetic with the calculator tool."
instructions = "You are a careful calculator. Use the calculator tool for every computation."
tools = ["local.calculator"]
"""


def config_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "loopmesh.toml"
    path.write_text(text)
    return path


def test_agents_are_read_from_the_configurations_agents_tables(tmp_path: Path):
    text = (
        CALC
        + """
[[agents]]
name = "planner"
mode = "orchestrator"
model = "big-model"
fallback_models = ["small-model"]
approval_tools = ["fs.fs_write"]
max_iterations = 12
agents = ["calc"]
"""
    )
    for type_ in (LoopWorkerConfig, UpConfig):
        config = load(type_, config_file(tmp_path, text), env={})
        calc, planner = config.agents
        assert (calc.name, calc.tools) == ("calc", ("local.calculator",))
        assert calc.instructions is not None and calc.instructions.startswith("You are a careful")
        assert (planner.mode, planner.model, planner.fallback_models) == (
            "orchestrator", "big-model", ("small-model",),
        )  # fmt: skip
        assert (planner.max_iterations, planner.agents) == (12, ("calc",))


@pytest.mark.parametrize(
    ("text", "field", "says"),
    [
        ('[[agents]]\nname = "a.b"', "$.agents[0].name", "matching regex"),
        ('[[agents]]\nname = "a"\ntool = ["x"]', "$.agents[0]", "unknown field `tool`"),
        ('[[agents]]\nname = "a"\ntools = ["a b"]', "$.agents[0].tools[0]", "matching regex"),
        (
            '[[agents]]\nname = "a"\nmode = "swarm"',
            "$.agents[0].mode",
            "Invalid enum value 'swarm'",
        ),
        ('[[agents]]\nname = "a"\nmax_iterations = 0', "$.agents[0].max_iterations", ">= 1"),
        (
            '[[agents]]\nname = "a"\nmax_active_turns = 0',
            "$.agents[0].max_active_turns",
            ">= 1",
        ),
        (CALC + CALC, "agents[1].name", "defined twice (first as agents[0])"),
        ('[[agents]]\nname = "a"\nagents = ["b"]', "agents[0].agents[0]", "'b', which is not"),
        ('[[agents]]\nname = "a"\nagents = ["a"]', "agents[0].agents[0]", "cannot call itself"),
        ('[[agents]]\nname = "a"\nrevision = 3', "agents[0].revision", "set by the agents"),
    ],
)
def test_a_bad_agent_is_refused_at_load_naming_the_field(
    tmp_path: Path, text: str, field: str, says: str
):
    with pytest.raises(ConfigError) as caught:
        load(LoopWorkerConfig, config_file(tmp_path, text), env={})
    message = str(caught.value)
    assert field in message and says in message, message
    assert str(tmp_path / "loopmesh.toml") in message


def test_an_agent_may_call_the_default_agent_without_defining_it(tmp_path: Path):
    text = '[[agents]]\nname = "a"\nagents = ["default"]'
    assert load(LoopWorkerConfig, config_file(tmp_path, text), env={}).agents[0].agents == (
        "default",
    )


async def test_provisioning_makes_the_bucket_hold_exactly_the_configured_agents(
    nats_server: Any,
):
    nc = await connect_fast(nats_server.url)
    try:
        settings = NatsSettings(url=nats_server.url)
        calc = AgentSpec(name="calc", tools=("local.calculator",))
        writer = AgentSpec(name="writer", instructions="Write.")
        actions = await provision_all(nc, settings, agents=[calc, writer])
        assert "created bucket loopmesh-agents" in actions
        assert [a.split(" (")[0] for a in actions if "agent " in a] == [
            "created agent default", "created agent calc", "created agent writer",
        ]  # fmt: skip
        first = await read_agents(nc.jetstream(), SUBJECTS)
        assert list(first) == ["default", "calc", "writer"]
        assert first["calc"].tools == ("local.calculator",) and first["calc"].revision > 0

        # again, unchanged: nothing written, revisions kept
        assert await provision_all(nc, settings, agents=[calc, writer]) == []
        assert await read_agents(nc.jetstream(), SUBJECTS) == first

        # changed and removed: one update, one delete
        calc2 = AgentSpec(name="calc", tools=("local.calculator", "local.echo"))
        actions = await apply_agents(nc.jetstream(), SUBJECTS, [calc2])
        assert [a.split(" (")[0] for a in actions] == ["updated agent calc", "deleted agent writer"]
        now = await read_agents(nc.jetstream(), SUBJECTS)
        assert list(now) == ["default", "calc"]
        assert now["calc"].revision > first["calc"].revision
        assert now["default"] == first["default"]

        # a service that does not configure agents leaves them alone
        assert await provision_all(nc, settings) == []
        assert await read_agents(nc.jetstream(), SUBJECTS) == now
    finally:
        await nc.close()


async def test_an_unprovisioned_bucket_reads_as_the_default_agent_alone(nats_server: Any):
    nc = await connect_fast(nats_server.url)
    try:
        await provision_all(nc, NatsSettings(url=nats_server.url))
        agents = await read_agents(nc.jetstream(), SUBJECTS)
        assert list(agents) == ["default"] and agents["default"].revision == 0
    finally:
        await nc.close()
