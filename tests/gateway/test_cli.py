"""``loopmesh gateway`` and ``loopmesh up`` as processes."""

from __future__ import annotations

import asyncio
import re
import signal

import httpx
import pytest

from gateway.auth import key_hash
from loopmesh.testing.durable import Proc
from loopmesh.testing.fake_llm import FakeLLM
from loopmesh.testing.fake_replies import auto
from loopmesh.testing.sse import messages

pytestmark = pytest.mark.slow

_URL = re.compile(r"gateway\s+(http://\S+)")


async def test_the_gateway_command_serves_with_keys_from_the_environment(nats_url):
    keys = f'[{{"sha256": "{key_hash("k1")}", "tenant": "acme", "name": "ci"}}]'
    proc = Proc(
        "-m", "loopmesh", "gateway", "--nats-url", nats_url, "--port", "0",
        env={"LOOPMESH_GATEWAY__API_KEYS": keys},
    )  # fmt: skip
    await proc.start()
    try:
        url = _URL.search(await proc.wait_line("gateway   http")).group(1)  # type: ignore[union-attr]
        async with httpx.AsyncClient(base_url=url) as c:
            assert (await c.get("/v1/sessions")).status_code == 401
            r = await c.post("/v1/sessions", json={}, headers={"Authorization": "Bearer k1"})
            assert r.status_code == 201 and r.json()["tenant"] == "acme"
    finally:
        await proc.close()


async def test_the_gateway_command_refuses_no_auth_on_a_public_address(nats_url):
    proc = Proc(
        "-m", "loopmesh", "gateway", "--nats-url", nats_url, "--no-auth", "--host", "0.0.0.0"
    )
    await proc.start()
    assert await proc.proc.wait() == 1  # type: ignore[union-attr]
    await proc.close()
    out = "\n".join(proc.lines)
    assert "not a loopback address" in out and "no_auth_any_host" in out


async def test_up_starts_the_gateway_without_auth_on_loopback_and_a_turn_runs_through_it(tmp_path):
    async with FakeLLM(default=auto()) as llm:
        proc = Proc(
            "-m", "loopmesh", "up", "--port", "-1", "--monitor-port", "-1",
            "--store-dir", str(tmp_path / "nats"),
            env={
                "LOOPMESH_GATEWAY__PORT": "0", "LOOPMESH_LLM__BASE_URL": llm.base_url,
                "LOOPMESH_LLM__API_KEY": "test", "LOOPMESH_LLM__MODEL": "fake-model",
            },
        )  # fmt: skip
        await proc.start()
        try:
            line = await proc.wait_line("gateway   http")
            assert "no auth, tenant local" in line
            url = _URL.search(line).group(1)  # type: ignore[union-attr]
            assert url.startswith("http://127.0.0.1:")
            assert await proc.wait_line("web view  http") == f"web view  {url}/"
            await proc.wait_line("loop worker ready")
            async with httpx.AsyncClient(base_url=url, timeout=30) as c:
                assert "<title>loopmesh</title>" in (await c.get("/")).text
                r = await c.post("/v1/sessions/demo/turns", json={"input": "say hi"})
                assert r.status_code == 202
                async with c.stream("GET", r.json()["events_url"]) as s:
                    async for m in messages(s):
                        if m.event == "loop_end":
                            assert m.json()["reason"] in ("task_completion", "converse")
                            break
        finally:
            assert proc.proc is not None
            proc.proc.send_signal(signal.SIGINT)
            assert await asyncio.wait_for(proc.proc.wait(), 60) == 0
            await proc.close()


def test_the_keys_helper_prints_a_key_and_the_entry_that_accepts_it(capsys):
    import tomllib

    from gateway.auth import Keys
    from gateway.keys import main
    from gateway.settings import GatewayConfig

    assert main(["acme", "ci"]) == 0
    out = capsys.readouterr().out
    key = out.split("API key (shown once): ")[1].split()[0]
    entry = tomllib.loads(out.split("\n\n", 1)[1])
    config = __import__("msgspec").convert(entry, GatewayConfig)
    who = Keys(config.gateway).principal(f"Bearer {key}")
    assert (who.tenant, who.key) == ("acme", "ci")
    assert key not in out.split("\n\n", 1)[1]  # the entry holds only the hash


def test_command_line_values_are_checked_like_the_files(monkeypatch):
    import argparse

    from gateway.cli import config_of
    from loopmesh.errors import ConfigError

    monkeypatch.delenv("LOOPMESH_CONFIG", raising=False)
    args = argparse.Namespace(config=None, nats_url=None, host=None, port=70000, no_auth=False)
    with pytest.raises(ConfigError, match="the command line"):
        config_of(args)
    args.port = 9000
    assert config_of(args).gateway.port == 9000
