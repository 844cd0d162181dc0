"""What ``loopmesh nats-agents`` tells a person to run works as written."""

from __future__ import annotations

import inspect
import re

from nats.aio.client import Client
from synadia_ai.agents import Agents

import nats_agents
from nats_agents import cli


async def test_the_discovery_call_the_command_names_runs_as_written(nc: Client):
    said = cli.HELP + inspect.getsource(cli.up_service) + (nats_agents.__doc__ or "")
    calls = set(re.findall(r"Agents\([^)]*\)\.discover\(\)", said))
    assert calls == {"Agents(nc=nc).discover()"}
    made: list[Agents] = []

    def agents(*args: object, **kwargs: object) -> Agents:  # the real class, kept to close
        made.append(Agents(*args, **kwargs))  # type: ignore[arg-type]
        return made[-1]

    try:
        found = await eval(calls.pop(), {"Agents": agents, "nc": nc})
    finally:
        for client in made:
            await client.close()
    assert found == []  # nothing serves agents on this server
