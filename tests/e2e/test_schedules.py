"""A schedule fires exactly once per tick with 3 loop workers and 2 gateways running as
processes (each runs a scheduler), one loop worker and one gateway killed (SIGKILL)
meanwhile: checked on the turns that ran (their ``loop_end`` events, by turn id) and on
the schedulers' own claims (their log lines), never on a clock."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import httpx
import pytest
from nats.aio.client import Client
from nats.js.errors import NotFoundError

from gateway.auth import key_hash
from loopmesh.testing.durable import (
    SUBJECTS,
    Proc,
    connect_fast,
    kv_read,
    provision_short,
    wait_for,
    worker_env,
)
from loopmesh.testing.fake_llm import FakeLLM
from loopmesh.testing.fake_replies import auto
from schemas import decode
from schemas.events import AnyEvent
from schemas.schedules import ScheduleState, state_key

pytestmark = [pytest.mark.slow, pytest.mark.serial]

KEY = "schedules-key"
_URL = re.compile(r"gateway\s+(http://\S+)")
_CLAIM = re.compile(r"schedule tick claimed schedule=acme\.every tick=(\d+) outcome=(\w+)")


async def ended_turns(nc: Client) -> Counter[str]:
    """How many ``loop_end`` events each turn of tenant acme has in the events stream."""
    js, seq, ends = nc.jetstream(), 0, Counter[str]()
    subject = f"{SUBJECTS.prefix}.events.acme.*.loop_end"
    while True:
        try:
            msg = await js.get_msg(SUBJECTS.events_stream, seq=seq + 1, subject=subject, next=True)
        except NotFoundError:
            return ends
        seq = msg.seq or seq + 1
        ends[decode(msg.data or b"", AnyEvent).turn_id] += 1


async def state(nc: Client) -> ScheduleState | None:
    value = await kv_read(nc, SUBJECTS.schedules_bucket, state_key("acme", "every"))
    return decode(value, ScheduleState) if value else None


async def test_a_schedule_fires_once_per_tick_while_a_worker_and_a_gateway_are_killed(
    nats_server, tmp_path: Path
) -> None:
    nc = await connect_fast(nats_server.url)
    await provision_short(nc)
    procs: list[Proc] = []
    keys = f'[{{"sha256": "{key_hash(KEY)}", "tenant": "acme", "name": "ci"}}]'
    try:
        async with FakeLLM(default=auto()) as llm:
            env = [worker_env(nats_server.url, llm.base_url, name=f"w{i}") for i in range(3)]
            workers = [Proc("-m", "loop_worker", env=e) for e in env]
            command = ("-m", "loopmesh", "gateway", "--nats-url", nats_server.url, "--port", "0")
            config = tmp_path / "loopmesh.toml"  # schedules may tick every second
            config.write_text('[tenants."*"]\nmin_schedule_interval_s = 0\n')
            keyed = {"LOOPMESH_GATEWAY__API_KEYS": keys, "LOOPMESH_CONFIG": str(config)}
            gateways = [Proc(*command, env=keyed) for _ in range(2)]
            procs += workers + gateways
            for proc in procs:
                await proc.start()
            for worker in workers:
                await worker.wait_line("loop worker ready")
            urls = [_URL.search(await g.wait_line("gateway   http")).group(1) for g in gateways]  # type: ignore[union-attr]

            async with httpx.AsyncClient(
                base_url=urls[1], headers={"Authorization": f"Bearer {KEY}"}, timeout=30
            ) as api:
                body = {"id": "every", "cron": "* * * * * *", "input": "tick", "policy": "allow"}
                r = await api.post("/v1/schedules", json=body)
                assert r.status_code == 201, r.text

                async def fired(n: int) -> bool:
                    s = await state(nc)
                    return s is not None and sum(r.outcome == "fired" for r in s.runs) >= n

                await wait_for(lambda: fired(3), timeout=60, what="three runs")
                workers[0].kill()  # SIGKILL: its turns are redelivered, its scheduler gone
                gateways[0].kill()
                before = (await state(nc)).last_tick  # type: ignore[union-attr]

                async def past_the_kill() -> bool:
                    s = await state(nc)
                    return s is not None and s.last_tick >= before + 8

                await wait_for(past_the_kill, timeout=60, what="eight ticks after the kills")
                r = await api.post("/v1/schedules/every/pause")
                assert r.status_code == 200, r.text

            async def settled() -> bool:  # every run published, and every turn acked
                s = await state(nc)
                info = await nc.jetstream().stream_info(SUBJECTS.turns_stream)
                return (
                    s is not None
                    and all(r.published for r in s.runs if r.outcome == "fired")
                    and not info.state.messages
                )

            await wait_for(settled, timeout=60, what="the last runs to end")
            ends = await ended_turns(nc)
    finally:
        for proc in procs:
            await proc.close()
        await nc.close()

    # every tick from the first to the last ran once: one loop_end per turn, no gap
    ticks = sorted(int(turn.rsplit("-", 2)[1]) for turn in ends)
    assert ticks == list(range(ticks[0], ticks[-1] + 1)), ticks
    assert set(ends.values()) == {1}, ends
    # and was claimed by one scheduler at most (a claim whose scheduler died before its
    # log line is published again by another: its tick has no claim line)
    claims = Counter(
        int(m.group(1)) for p in procs for line in p.lines if (m := _CLAIM.search(line))
    )
    assert max(claims.values()) == 1, claims
    assert set(claims) <= set(ticks) and len(claims) >= len(ticks) - 1
    claimers = {p for p in procs for line in p.lines if _CLAIM.search(line)}
    assert len(claimers) >= 2  # the claims were spread, not one process's work
