"""``loopmesh schedules`` as a person types it: a real process against a real nats-server
(provisioned, no worker: the schedule is only stored, read and changed)."""

from __future__ import annotations

import json

import pytest

from loopmesh.testing.durable import connect_fast, provision_short
from tests.loopmesh.commands.test_commands import loopmesh

pytestmark = pytest.mark.slow


async def test_schedules_are_added_listed_shown_paused_resumed_and_deleted(nats_server):
    nc = await connect_fast(nats_server.url)
    await provision_short(nc)
    await nc.close()
    url = ("--nats-url", nats_server.url, "--tenant", "acme")
    code, lines = await loopmesh(
        "schedules", "add", "Summarise the day", "--cron", "0 18 * * 1-5",
        "--timezone", "Europe/Paris", "--id", "daily", "--session", "s1", *url,
    )  # fmt: skip
    assert code == 0, lines
    assert any("18:00 on Monday through Friday" in line for line in lines)

    code, lines = await loopmesh("schedules", *url)
    assert code == 0, lines
    assert lines[0].split()[:4] == ["ID", "CRON", "TIMEZONE", "POLICY"]
    assert lines[1].split()[0] == "daily" and "Europe/Paris" in lines[1]

    code, lines = await loopmesh("schedules", "pause", "daily", *url)
    assert code == 0 and lines == ["paused schedule daily"]
    code, lines = await loopmesh("schedules", "show", "daily", "--json", *url)
    assert code == 0 and json.loads(lines[0])["paused"] is True
    code, lines = await loopmesh("schedules", "resume", "daily", *url)
    assert code == 0 and lines == ["resumed schedule daily"]

    code, lines = await loopmesh(
        "schedules", "add", "x", "--cron", "0 25 * * *", "--id", "bad", *url
    )  # fmt: skip
    assert code == 1 and "`cron`" in lines[-1] and "Bad hour" in lines[-1]
    code, lines = await loopmesh(
        "schedules", "add", "x", "--cron", "0 1 * * *", "--agent", "no", *url
    )
    assert code == 1 and "`agent`: no agent 'no'" in lines[-1]

    code, lines = await loopmesh("schedules", "delete", "daily", *url)
    assert code == 0 and lines == ["deleted schedule daily"]
    code, lines = await loopmesh("schedules", "show", "daily", *url)
    assert code == 1 and "no schedule 'daily'" in lines[-1]
    code, lines = await loopmesh("schedules", "--json", *url)
    assert code == 0 and lines == []


async def test_add_past_max_per_tenant_is_refused_as_the_gateway_refuses_it(nats_server, tmp_path):
    nc = await connect_fast(nats_server.url)
    await provision_short(nc)
    await nc.close()
    config = tmp_path / "loopmesh.toml"
    config.write_text("[scheduler]\nmax_per_tenant = 1\n")
    url = ("--nats-url", nats_server.url, "--tenant", "acme", "--config", str(config))
    add = ("schedules", "add", "x", "--cron", "0 1 * * *")
    code, lines = await loopmesh(*add, "--id", "a", *url)
    assert code == 0, lines
    code, lines = await loopmesh(*add, "--id", "b", *url)
    assert code == 1 and lines[-1].endswith(
        "tenant acme has 1 schedule(s), the most allowed ([scheduler] max_per_tenant = 1): "
        "delete one first"
    ), lines
    code, lines = await loopmesh(*add, "--id", "b", *url, "--tenant", "globex")
    assert code == 0, lines
