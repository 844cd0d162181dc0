"""Worker processes (``python -m tool_worker``) sharing a pool."""

from __future__ import annotations

import asyncio
import os
import signal
from collections import Counter
from pathlib import Path

import pytest
from nats.js import JetStreamContext

from loopmesh.server import NatsServer
from loopmesh.shutdown import REPEAT_S

from .harness import SUBJECTS, Requester, WorkerProcess

pytestmark = [pytest.mark.slow, pytest.mark.serial]

ENV = {"LOOPMESH_TOOL_WORKER__ACK_WAIT_S": "2", "LOOPMESH_TOOL_WORKER__BUILTINS": "calculator"}


def args(log: Path, i: int) -> dict[str, object]:
    return {"path": str(log), "tag": f"c{i}", "seconds": 0.05}


def worker(server: NatsServer, concurrency: int = 4) -> WorkerProcess:
    return WorkerProcess(
        server.url,
        "--module", "tests.tool_worker.sample_tools",
        "--concurrency", str(concurrency),
        "--no-provision",
        env=ENV,
    )  # fmt: skip


async def test_several_workers_share_the_backlog_and_each_call_runs_once(
    nats_server: NatsServer, js: JetStreamContext, requester: Requester, tmp_path: Path
) -> None:
    procs = [await worker(nats_server).start() for _ in range(3)]
    try:
        for p in procs:
            await p.ready()
        log = tmp_path / "runs.txt"
        reqs = [
            requester.request(
                "local", "record", {"path": str(log), "tag": f"c{i}", "seconds": 0.05}
            )
            for i in range(60)
        ]
        for req in reqs:
            await requester.publish(req)
        results = [await requester.result(r.call_id, timeout=30) for r in reqs]
    finally:
        for p in procs:
            p.terminate()
        codes = [await p.wait() for p in procs]
    assert codes == [0, 0, 0]
    assert all(r.status == "ok" for r in results)
    runs = Counter(line.split()[0] for line in log.read_text().splitlines())
    assert runs == {f"c{i}": 2 for i in range(60)}  # a start and a done line each: one run
    by_worker = Counter(r.worker for r in results)
    assert len(by_worker) == 3, by_worker
    assert len(requester.replies) == 60


async def test_a_call_of_a_killed_worker_is_redelivered_and_completed_by_another(
    nats_server: NatsServer, js: JetStreamContext, requester: Requester, tmp_path: Path
) -> None:
    first = await worker(nats_server).start()
    second = worker(nats_server)
    try:
        await first.ready()
        marker = tmp_path / "stalled"
        req = requester.request("local", "stall_first", {"path": str(marker)})
        await requester.publish(req)
        await first.wait_for_line("stall_first: stalling")  # in the middle of the call
        first.kill()
        assert await first.wait() == -9
        await second.start()
        await second.ready()
        result = await requester.result(req.call_id, timeout=20)  # after AckWait (2 s)
    finally:
        await first.stop()
        second.terminate()
        await second.wait()
    assert result.status == "ok"
    assert result.content == f"finished by {second.pid}"
    assert result.worker.endswith(f"-{second.pid}")
    info = await js.consumer_info(SUBJECTS.tools_stream, SUBJECTS.pool_consumer("default"))
    assert info.num_redelivered == 0 and info.num_ack_pending == 0


async def test_sigterm_finishes_in_flight_calls_and_exits_zero(
    nats_server: NatsServer, js: JetStreamContext, requester: Requester
) -> None:
    proc = await worker(nats_server).start()
    try:
        await proc.ready()
        req = requester.request("local", "nap", {"seconds": 1.0})
        await requester.publish(req)
        await proc.wait_for_line("nap: started")
        proc.terminate()
        result = await requester.result(req.call_id, timeout=10)
        code = await proc.wait()
    finally:
        await proc.stop()
    assert result.content == "napped 1.0"
    assert code == 0
    assert any("finishing 1 in-flight calls" in line for line in proc.lines)


async def test_a_second_signal_during_the_drain_stops_at_once_with_one_line(
    nats_server: NatsServer, requester: Requester
) -> None:
    """SIGTERM starts the drain; a SIGINT past ``REPEAT_S`` (a second press) stops the
    worker at once: exit 130, one line that says what happened, no traceback. (A repeat
    within ``REPEAT_S`` is tested in ``tests/loopmesh/test_shutdown.py``: two signals
    sent to a process at once may reach it as one.)"""
    proc = await worker(nats_server).start()
    try:
        await proc.ready()
        await requester.publish(requester.request("local", "nap", {"seconds": 60.0}))
        await proc.wait_for_line("nap: started")
        proc.terminate()
        await proc.wait_for_line("finishing 1 in-flight calls")
        await asyncio.sleep(REPEAT_S + 0.5)
        os.kill(proc.pid, signal.SIGINT)
        code = await proc.wait()
    finally:
        await proc.stop()
    assert code == 130, proc.lines
    assert proc.lines[-1] == (
        "loopmesh tool-worker: stopped at once on a second SIGINT: "
        "what was in flight was not drained"
    ), proc.lines
    assert not any("Traceback" in line for line in proc.lines), proc.lines
