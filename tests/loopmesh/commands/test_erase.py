"""``loopmesh erase`` (and :meth:`Client.delete_session` under it), over NATS and through
the gateway, on a session whose turn waits for a person: the turn is cancelled first,
then nothing of the session is left; a second erase finds nothing."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gateway.server import GatewayServer
from loopmesh.testing.durable import SUBJECTS, Proc, kv_read, stream_events
from tests.loop_worker.durable import Mesh, Watch
from tests.loopmesh.commands.test_commands import (  # noqa: F401 (fixtures: mesh, gateway)
    TRANSPORTS,
    gateway,
    guarded_task,
    loopmesh,
    mesh,
    via,
)

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_erase_cancels_the_running_turn_and_leaves_nothing_of_the_session(
    transport: str,
    mesh: Mesh,  # noqa: F811
    gateway: GatewayServer,  # noqa: F811
    tmp_path: Path,
):
    async with Watch(mesh.nc, tenant="local", session="s1") as watch:
        run = await Proc(
            "-m", "loopmesh", "run", "--nats-url", mesh.url, "--session", "s1",
            guarded_task(tmp_path / "g"),
        ).start()  # fmt: skip
        try:
            await watch.wait("approval_required", timeout=30)  # it waits for a person
            code, lines = await loopmesh("erase", *via(transport, mesh, gateway), "--session", "s1")
            assert code == 0, lines
            assert lines[0].startswith("session s1 erased (") and "events " in lines[0], lines
            end = await watch.wait("loop_end", timeout=30)
            assert end.reason == "cancelled"  # type: ignore[attr-defined]
            assert await asyncio.wait_for(run.proc.wait(), 30) == 1  # type: ignore[union-attr]
        finally:
            await run.close()
    assert not (tmp_path / "g").exists()  # the tool never ran
    assert await stream_events(mesh.nc, "local", "s1") == []
    assert await kv_read(mesh.nc, SUBJECTS.sessions_bucket, "local.s1") is None
    code, lines = await loopmesh("erase", *via(transport, mesh, gateway), "--session", "s1")
    assert code == 1 and "no session 's1'" in "\n".join(lines), lines
