"""`loopmesh up` watches what it started: a child process killed as a crash would is
reported and comes back; one that keeps dying stops `up`, which says why. Real
processes: `up`, its nats-server, `loopmesh run`, and the fake LLM."""

import asyncio
import os
import re
import signal

import pytest

from loopmesh.testing.fake_llm import FakeLLM
from loopmesh.testing.fake_replies import auto
from tests.e2e.test_up_run import descendants, llm_env, run, stop_and_check_nothing_left, up

pytestmark = pytest.mark.slow


def nats_server_of(pid: int) -> int:
    """The nats-server process below ``pid``."""
    found = []
    for child in descendants(pid):
        try:
            with open(f"/proc/{child}/comm") as f:
                if f.read().strip() == "nats-server":
                    found.append(child)
        except OSError:
            continue
    assert len(found) == 1, found
    return found[0]


async def test_a_killed_nats_server_is_reported_and_restarted_and_turns_run_again(tmp_path):
    async with FakeLLM(default=auto()) as llm:
        proc, url = await up(tmp_path, **llm_env(llm))
        try:
            await proc.wait_line("loop worker ready")
            os.kill(nats_server_of(proc.proc.pid), signal.SIGKILL)
            await proc.wait_line("error     nats-server was killed by SIGKILL; the end of its log:")
            await proc.wait_line("restart   nats-server in 1 s (1 of 3 in a row)")
            back = await proc.wait_line("restart   nats-server is back (pid ")
            assert back.endswith(", restart 1 of 3)")
            assert int(re.search(r"pid (\d+)", back).group(1)) == nats_server_of(proc.proc.pid)
            # a turn: the loop worker and the streams are back (the tool worker's pull
            # requests died with the server: it pulls again once it notices, see
            # tool_worker/service.py, so a tool call may wait for that)
            code, out = await run(url, "say hello")
            assert code == 0, out
            assert "✔ task_completion" in out
            assert proc.proc.returncode is None
        finally:
            await stop_and_check_nothing_left(proc)


async def test_a_nats_server_that_keeps_dying_stops_up_which_says_why(tmp_path):
    async with FakeLLM(default=auto()) as llm:
        proc, _ = await up(tmp_path, **llm_env(llm))
        try:
            await proc.wait_line("loop worker ready")
            for restart in (1, 2, 3):
                os.kill(nats_server_of(proc.proc.pid), signal.SIGKILL)
                await proc.wait_line(f"restart {restart} of 3)", timeout=60)
            os.kill(nats_server_of(proc.proc.pid), signal.SIGKILL)
            code = await asyncio.wait_for(proc.proc.wait(), 60)
        finally:
            await proc.close()
    out = proc.output()
    assert code == 1, out
    said = "error     nats-server: nats-server was killed by SIGKILL, 3 restarts in a row"
    assert any(said in line for line in proc.lines), out  # out: the last 60 lines only
    # the reason, alone: what failed after it (services that lost the server) is not
    # (found inside a line: under load a service's log may share the line it starts)
    stopped = [line[line.index("stopped: ") :] for line in proc.lines if "stopped: " in line]
    assert stopped == [
        "stopped: nats-server: nats-server was killed by SIGKILL, 3 restarts in a row"
    ], "\n".join(proc.lines)  # every line: what up printed after the reason, if anything
