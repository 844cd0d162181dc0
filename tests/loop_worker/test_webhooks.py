"""Webhooks on a real mesh: a turn published to NATS with a webhook the egress policy
refuses is refused; an allowed one (the turn's own, or its agent's) is recorded in the
turn's ``loop_start`` and gets its ``loop_end`` from the webhooks service."""

from __future__ import annotations

from typing import Any

import msgspec

from loopmesh.agents import apply_agents
from loopmesh.testing.durable import SUBJECTS
from schemas import AgentSpec, Webhook
from schemas.events import Error, LoopEnd, LoopStart
from tests.loop_worker.durable import Watch, mesh_on, send_turn, turn
from tests.webhooks.conftest import SECRET, delivering, documented_verify, settings
from tests.webhooks.receiver import receiving


async def test_a_turn_whose_webhook_is_private_is_refused_naming_the_field(nats_server: Any):
    async with mesh_on(nats_server.url, workers=True) as mesh, Watch(mesh.nc) as watch:
        hook = Webhook(url="https://10.1.2.3/hook")
        await send_turn(mesh.nc, turn("t1", "say hi", webhook=hook))
        error = await watch.wait("error", "t1")
        end = await watch.wait("loop_end", "t1")
    assert isinstance(error, Error) and error.code == "invalid_webhook" and error.fatal
    assert "`webhook.url`: 10.1.2.3 is a private address" in error.message
    assert "[webhooks] allowlist" in error.message
    assert isinstance(end, LoopEnd) and end.reason == "error"
    assert watch.of("loop_start") == []
    assert mesh.fake is not None and mesh.fake.requests == []  # the model was never asked


async def test_a_turns_webhook_and_an_agents_default_get_their_loop_end(nats_server: Any):
    config = settings()  # http to 127.0.0.1 allowed, for the loop worker and the service
    verify = documented_verify()
    async with (
        receiving() as receiver,
        mesh_on(nats_server.url) as mesh,
        delivering(nats_server.url, config),
        Watch(mesh.nc) as watch,
    ):
        agent_hook = Webhook(url=receiver.url + "/agent", events=("loop_start", "loop_end"))
        await apply_agents(
            mesh.nc.jetstream(), SUBJECTS, [AgentSpec(name="hooked", webhook=agent_hook)]
        )
        await mesh.tool_worker()
        await mesh.loop_worker(webhooks=config)
        own = Webhook(url=receiver.url)
        await send_turn(mesh.nc, turn("t1", "say hi", webhook=own))
        await receiver.wait(lambda r: len(r.delivered) == 1, "t1's loop_end")
        await send_turn(mesh.nc, turn("t2", "say hi", session="s2", agent="hooked"))
        await receiver.wait(lambda r: len(r.delivered) == 3, "t2's loop_start and loop_end")
        start = await watch.wait("loop_start", "t1")
    assert isinstance(start, LoopStart) and start.webhook == own
    bodies = [msgspec.json.decode(r.body) for r in receiver.delivered]
    paths = [r.path for r in receiver.delivered]
    assert [(p, b["turn_id"], b["type"]) for p, b in zip(paths, bodies, strict=True)] == [
        ("/hook", "t1", "loop_end"),
        ("/hook/agent", "t2", "loop_start"),
        ("/hook/agent", "t2", "loop_end"),
    ]
    assert bodies[0]["reason"] == "task_completion"
    assert bodies[1]["webhook"]["url"] == agent_hook.url  # the agent's, recorded
    assert all(verify(SECRET, r.headers, r.body) for r in receiver.delivered)
