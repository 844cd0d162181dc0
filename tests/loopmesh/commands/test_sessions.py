"""``loopmesh erase`` (and :meth:`Client.delete_session` under it), over NATS and through
the gateway, on a session whose turn waits for a person: the turn is cancelled first,
then nothing of the session is left; a second erase finds nothing. ``loopmesh sessions``
(:meth:`Client.sessions`) lists them filtered by label and paged, both ways alike."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from gateway.server import GatewayServer
from loopmesh.testing.durable import SUBJECTS, kv_read, stream_events
from tests.loop_worker.durable import Mesh
from tests.loopmesh.commands.test_commands import (  # noqa: F401 (fixtures: mesh, gateway)
    TRANSPORTS,
    gateway,
    loopmesh,
    mesh,
    via,
    while_a_turn_waits,
)

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_erase_cancels_the_running_turn_and_leaves_nothing_of_the_session(
    transport: str,
    mesh: Mesh,  # noqa: F811
    gateway: GatewayServer,  # noqa: F811
    tmp_path: Path,
):
    remote = via(transport, mesh, gateway)
    lines, _ = await while_a_turn_waits(mesh, tmp_path, "erase", *remote, "--session", "s1")
    assert lines[0].startswith("session s1 erased (") and "events " in lines[0], lines
    assert not (tmp_path / "g").exists()  # the tool never ran
    assert await stream_events(mesh.nc, "local", "s1") == []
    assert await kv_read(mesh.nc, SUBJECTS.sessions_bucket, "local.s1") is None
    code, lines = await loopmesh("erase", *via(transport, mesh, gateway), "--session", "s1")
    assert code == 1 and "no session 's1'" in "\n".join(lines), lines


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_sessions_lists_by_label_and_pages_with_the_cursor_it_prints(
    transport: str,
    mesh: Mesh,  # noqa: F811
    gateway: GatewayServer,  # noqa: F811
):
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        for session, team in [("s1", "red"), ("s2", "blue"), ("s3", "red")]:
            body = {"session": session, "title": f"about {session}", "labels": {"team": team}}
            assert (await http.post("/v1/sessions", json=body)).status_code == 201
    remote = via(transport, mesh, gateway)
    code, lines = await loopmesh("sessions", *remote, "--label", "team=red", "--json")
    assert code == 0, lines
    *listed, cursor = [json.loads(line) for line in lines]
    assert [(s["session"], s["title"], s["labels"]) for s in listed] == [
        ("s3", "about s3", {"team": "red"}),
        ("s1", "about s1", {"team": "red"}),
    ]
    assert cursor == {"next_cursor": None}

    code, lines = await loopmesh("sessions", *remote, "--limit", "2")
    assert code == 0, lines
    assert [line.split()[0] for line in lines[:2]] == ["s3", "s2"]
    assert lines[0].split("  ")[1:5] == ["idle", "agent default", "0 turns", "0 tokens"]
    assert lines[0].endswith("'about s3'  team=red"), lines
    more = lines[2].removeprefix("more: --cursor ")
    code, lines = await loopmesh("sessions", *remote, "--limit", "2", "--cursor", more)
    assert code == 0 and [line.split()[0] for line in lines] == ["s1"], lines
    code, lines = await loopmesh("sessions", *remote, "--cursor", "nonsense")
    assert code == 1 and "`cursor` is not one this API gave" in "\n".join(lines), lines
