"""A watched child process (:func:`loopmesh.process.keep_running`): real processes,
killed as a crash would kill them."""

from __future__ import annotations

import asyncio
import signal
import sys

import pytest

from loop_worker import cli as loop_cli
from loop_worker.config import LoopWorkerConfig
from loop_worker.engine.settings import LLMSettings
from loopmesh import process
from loopmesh.nats import connect
from loopmesh.process import ChildDied, exit_status, keep_running
from loopmesh.provision import provision_all
from loopmesh.server import NatsServer
from loopmesh.settings import NatsSettings
from loopmesh.testing.fake_llm import FakeLLM


class Sleeper:
    """A child that prints one line, then sleeps until killed."""

    def __init__(self) -> None:
        self.proc: asyncio.subprocess.Process | None = None
        self.starts = 0
        self.started = asyncio.Event()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    async def start(self) -> None:
        self.starts += 1
        code = f"print('run {self.starts}', flush=True); import time; time.sleep(600)"
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", code, stdout=asyncio.subprocess.PIPE
        )
        assert self.proc.stdout is not None
        self.line = (await self.proc.stdout.readline()).decode().strip()
        self.started.set()

    async def wait(self) -> int:
        assert self.proc is not None
        return await self.proc.wait()

    def log_tail(self) -> str:
        return self.line

    def kill(self) -> None:
        assert self.proc is not None
        self.started.clear()
        self.proc.kill()


@pytest.fixture(autouse=True)
def quick_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(process, "BACKOFF_S", 0.01)


def test_an_exit_status_says_the_code_or_the_signal() -> None:
    assert exit_status(3) == "exited with code 3"
    assert exit_status(-signal.SIGKILL) == "was killed by SIGKILL"
    assert exit_status(-signal.SIGSEGV) == "was killed by SIGSEGV"


async def test_a_killed_child_is_reported_with_its_log_and_started_again() -> None:
    child, said, stop = Sleeper(), [], asyncio.Event()
    await child.start()
    watch = asyncio.create_task(keep_running("sleeper", child, stop, said.append))
    first = child.pid
    child.kill()
    await child.started.wait()
    assert child.pid != first and child.line == "run 2"
    assert said[:3] == [
        "error     sleeper was killed by SIGKILL; the end of its log:",
        "          | run 1",
        "restart   sleeper in 0.01 s (1 of 3 in a row)",
    ]
    stop.set()
    await watch  # returns once stopped; the child is its owner's to stop
    assert child.proc is not None and child.proc.returncode is None
    child.kill()
    await child.wait()


async def test_a_child_that_keeps_dying_is_given_up_on() -> None:
    child, said = Sleeper(), []
    await child.start()
    watch = asyncio.create_task(keep_running("sleeper", child, asyncio.Event(), said.append))
    for _ in range(process.MAX_RESTARTS):
        child.kill()
        await child.started.wait()
    child.kill()
    with pytest.raises(ChildDied) as died:
        await watch
    assert (died.value.code, died.value.tail) == (-signal.SIGKILL, "run 4")
    assert str(died.value) == "sleeper was killed by SIGKILL, 3 restarts in a row"
    assert child.starts == 1 + process.MAX_RESTARTS


async def test_the_loop_worker_stops_when_its_model_server_keeps_dying(
    nats_server: NatsServer, fake_llm: FakeLLM
) -> None:
    """``up``'s loop worker beside the embedded model (here a stand-in process) serves
    through the restarts, and stops with ChildDied once the model server is given up on."""
    config = LoopWorkerConfig(
        nats=NatsSettings(url=nats_server.url),
        llm=LLMSettings(base_url=fake_llm.base_url, api_key="test"),
    )
    nc = await connect(config.nats)
    await provision_all(nc, config.nats)  # as `up` does before its services
    await nc.close()
    child = Sleeper()
    await child.start()
    stop = asyncio.Event()
    worker = asyncio.create_task(loop_cli.serve_beside(child, config, stop))  # type: ignore[arg-type]
    for _ in range(process.MAX_RESTARTS):
        child.kill()
        await child.started.wait()
        assert not worker.done()
    child.kill()
    with pytest.raises(ChildDied):
        await asyncio.wait_for(worker, 60)
    assert not stop.is_set()  # the worker stopped on its own account
