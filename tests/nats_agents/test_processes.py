"""The host as people run it: inside ``loopmesh up`` (tenant ``local`` on its own
loopback server), and alone as ``loopmesh nats-agents``, which needs a tenant (and, in
a pod, serves ``/healthz`` for its probes)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from synadia_ai.agents import Agents, ResponseChunk

from loopmesh.ports import free_port
from loopmesh.provision import provision_all
from loopmesh.settings import NatsSettings
from loopmesh.testing.durable import Proc, connect_fast, wait_for
from loopmesh.testing.fake_llm import FakeLLM
from loopmesh.testing.fake_replies import auto
from tests.e2e.test_up_run import llm_env, stop_and_check_nothing_left, up

pytestmark = pytest.mark.slow


async def test_loopmesh_up_serves_its_agents_on_the_protocol_in_tenant_local(tmp_path: Path):
    async with FakeLLM(default=auto()) as llm:
        proc, url = await up(tmp_path, **llm_env(llm))
        try:
            line = await proc.wait_line("agents    on the NATS Agent Protocol")
            assert "tenant local" in line
            await proc.wait_line("loop worker ready")
            nc = await connect_fast(url, name="caller")
            agents = Agents(nc=nc)
            try:
                [default] = [a for a in await agents.discover() if a.agent == "loopmesh"]
                assert (default.owner, default.session_name) == ("local", "default")
                chunks = [c async for c in default.prompt("say hi")]
            finally:
                await agents.close()
                await nc.close()
            texts = [c.text for c in chunks if isinstance(c, ResponseChunk)]
            assert "".join(texts).startswith("done: ")  # auto() answers by task_completion
        finally:
            await stop_and_check_nothing_left(proc)


async def test_nats_agents_alone_refuses_to_start_without_a_tenant(nats_server: object):
    proc = Proc("-m", "loopmesh", "nats-agents", "--nats-url", nats_server.url)  # type: ignore[attr-defined]
    await proc.start()
    code = await asyncio.wait_for(proc.proc.wait(), 60)
    await proc.close()
    out = "\n".join(proc.lines)
    assert code != 0 and "[nats_agents] tenant" in out and "carries no tenant" in out, out


async def test_sigterm_withdraws_the_agents_and_exits_0(nats_server: object):
    url: str = nats_server.url  # type: ignore[attr-defined]
    nc = await connect_fast(url)
    await provision_all(nc, NatsSettings(url=url))
    proc = Proc("-m", "loopmesh", "nats-agents", "--nats-url", url, "--tenant", "acme")
    agents = Agents(nc=nc)
    try:
        await proc.start()
        assert "tenant acme" in await proc.wait_line("nats-agents serving")
        await wait_for(lambda: served(agents), what="the default agent to be discovered")
        assert await proc.terminate(60) == 0, proc.output()
        assert not await served(agents)  # withdrawn, not left to time out
    finally:
        await proc.close()
        await agents.close()
        await nc.close()


async def test_healthz_answers_200_once_the_agents_are_served_and_503_before(
    nats_server: object,
):
    """As a pod's probes see it: the agents bucket is not there yet (the loop workers
    provision it), so the host serves nothing and is not healthy; once it is, it is."""
    url: str = nats_server.url  # type: ignore[attr-defined]
    port = free_port()
    args = ("--nats-url", url, "--tenant", "acme", "--metrics-port", str(port))
    proc = Proc("-m", "loopmesh", "nats-agents", *args)
    nc = await connect_fast(url)
    healthz = f"http://127.0.0.1:{port}/healthz"
    try:
        await proc.start()
        assert f":{port}/metrics" in await proc.wait_line("nats-agents metrics at")
        async with httpx.AsyncClient() as http:
            assert (await http.get(healthz)).status_code == 503
            await provision_all(nc, NatsSettings(url=url))

            async def healthy() -> bool:
                return (await http.get(healthz)).status_code == 200

            await wait_for(healthy, timeout=60, what="/healthz to answer 200")
        assert await proc.terminate(60) == 0, proc.output()
    finally:
        await proc.close()
        await nc.close()


async def served(agents: Agents) -> bool:
    return any(a.agent == "loopmesh" for a in await agents.discover())
