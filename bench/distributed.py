"""The cost of running the loop durably on NATS, against the in-process engine.

    python bench/distributed.py [--iterations 200] [--sessions 1,64,256] [--memory-sessions 256]

Prints, in one run:

1. per-iteration cost, distributed vs in-process: one turn of ``--iterations`` echo
   calls; the time between consecutive ``loop_iteration`` events. Both paths use the
   same zero-latency LLM (in this process) and an echo tool; the distributed path adds
   the tool call over JetStream to a tool-worker process, the events to the events
   stream, the checkpoint to KV and the lease (goal: p50 within +1.5 ms);
2. throughput at 1, 64 and 256 concurrent sessions, each running two-iteration turns
   back to back, against the in-process engine (goal: >= 50% at 256);
3. loop-worker memory per active session: a loop-worker process with N sessions waiting
   on a slow tool, RSS over an idle baseline (goal: <= 100 KB);
4. the time from kill -9 of a loop worker mid-turn to the turn finishing on another
   (AckWait and lease TTL 2 s here).

Everything is local: an embedded nats-server, tool and loop workers as processes, the
fake OpenAI-compatible server (``tests.fake_llm``) for the loop-worker processes.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loop_worker.config import LoopWorkerConfig, ServiceSettings  # noqa: E402
from loop_worker.engine import Engine  # noqa: E402
from loop_worker.inmemory import InMemoryEvents, InMemoryStore, LocalTools  # noqa: E402
from loop_worker.protocols import Completion, OnDelta, OnRetry  # noqa: E402
from loop_worker.service import LoopWorker  # noqa: E402
from loop_worker.settings import LoopSettings  # noqa: E402
from loopmesh.nats import connect  # noqa: E402
from loopmesh.server import NatsServer  # noqa: E402
from loopmesh.settings import NatsSettings  # noqa: E402
from schemas import ChatMessage, Subjects, ToolCall, Turn, decode, encode  # noqa: E402
from schemas.events import AnyEvent, Event, LoopEnd  # noqa: E402
from tests.loop_worker.durable import Proc, provision_short, stream_events  # noqa: E402

S = Subjects()
TENANT = "bench"


class InstantLLM:
    """A zero-latency model: calls echo until the turn has ``n`` tool results, then
    ``task_completion``. Stateless (reads the messages), so sessions can share it."""

    def __init__(self, n: int, echo_name: str) -> None:
        self.n = n
        self.echo_name = echo_name
        self.calls = 0

    async def complete(
        self,
        messages: Sequence[ChatMessage],
        *,
        tools: Sequence[dict[str, Any]] = (),
        model: str | None = None,
        on_delta: OnDelta | None = None,
        on_retry: OnRetry | None = None,
    ) -> Completion:
        self.calls += 1
        results = 0  # echo results since the last task_completion
        for m in messages:
            if m.role == "tool":
                results += 1
            elif any(c.name == "task_completion" for c in m.tool_calls):
                results = -1  # its own result follows
        done = results >= self.n
        name, args = (
            ("task_completion", {"result": "ok"}) if done else (self.echo_name, {"text": "hi"})
        )
        call = ToolCall(id=f"c{self.calls}", name=name, arguments=json.dumps(args))
        return Completion(
            content="", tool_calls=(call,), finish_reason="tool_calls", model="instant"
        )


def loop_settings(iterations: int) -> LoopSettings:
    return LoopSettings(
        max_iterations=iterations + 2, context_budget_tokens=1_000_000, summarize_with_llm=False
    )


def turn(turn_id: str, session: str, text: str = "go") -> Turn:
    return Turn(id=turn_id, tenant=TENANT, session=session, input=text, created_at=time.time())


def iteration_gaps(events: Sequence[Event]) -> list[float]:
    ts = [e.ts for e in events if e.type == "loop_iteration"]
    return [(b - a) * 1000 for a, b in itertools.pairwise(ts)]


def pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# -- in-process ---------------------------------------------------------------------------


def local_engine(iterations: int) -> tuple[Engine, InMemoryEvents]:
    tools = LocalTools()

    @tools.tool(description="Return the text.")
    async def echo(text: str) -> str:
        return text

    events = InMemoryEvents()
    engine = Engine(
        settings=loop_settings(iterations),
        llm=InstantLLM(iterations, "local__echo"),
        tools=tools,
        events=events,
        store=InMemoryStore(),
    )
    return engine, events


async def inprocess_iteration(iterations: int) -> list[float]:
    engine, events = local_engine(iterations)
    await engine.run(turn("warm", "warm"))
    events.events.clear()
    await engine.run(turn("t", "s"))
    return iteration_gaps(events.events)


async def inprocess_throughput(sessions: int, turns_each: int) -> float:
    engine, _ = local_engine(1)

    async def session(i: int) -> None:
        for k in range(turns_each):
            await engine.run(turn(f"t{i}x{k}", f"s{i}"))

    await session(-1)
    started = time.perf_counter()
    await asyncio.gather(*(session(i) for i in range(sessions)))
    return sessions * turns_each / (time.perf_counter() - started)


# -- distributed ------------------------------------------------------------------------


class Mesh:
    def __init__(self, store: Path) -> None:
        self.server = NatsServer(store)
        self.procs: list[Proc] = []

    async def __aenter__(self) -> Mesh:
        await self.server.start()
        self.nc = await connect(NatsSettings(url=self.server.url), name="bench")
        await provision_short(self.nc)
        return self

    async def __aexit__(self, *exc: object) -> None:
        for proc in reversed(self.procs):
            await proc.close()
        await self.nc.close()
        await self.server.stop()

    async def tool_worker(self, concurrency: int = 512, module: str = "bench.tools") -> Proc:
        proc = Proc(
            "-m", "tool_worker", "--nats-url", self.server.url, "--no-provision",
            "--module", module, "--concurrency", str(concurrency),
            env={"LOOPMESH_TOOL_WORKER__ACK_WAIT_S": "2", "LOOPMESH_LOG_LEVEL": "WARNING"},
        )  # fmt: skip
        self.procs.append(proc)
        return await proc.start("serving pool=")

    async def loop_worker_process(self, llm_url: str, name: str) -> Proc:
        env = {
            "LOOPMESH_NATS__URL": self.server.url,
            "LOOPMESH_LLM__BASE_URL": llm_url,
            "LOOPMESH_LLM__API_KEY": "bench",
            "LOOPMESH_LLM__MODEL": "fake-model",
            "LOOPMESH_LOOP_WORKER__ACK_WAIT_S": "2",
            "LOOPMESH_LOOP_WORKER__LEASE_TTL_S": "2",
            "LOOPMESH_LOOP_WORKER__FETCH_TIMEOUT_S": "0.5",
            "LOOPMESH_LOOP_WORKER__NAME": name,
        }
        proc = Proc("-m", "loop_worker", env=env)
        self.procs.append(proc)
        return await proc.start("loop worker ready")

    async def run_local_worker(self, iterations: int, stop: asyncio.Event) -> LoopWorker:
        config = LoopWorkerConfig(
            nats=NatsSettings(url=self.server.url),
            loop=loop_settings(iterations),
            loop_worker=ServiceSettings(
                ack_wait_s=30, lease_ttl_s=30, max_active_turns=512, name="bench"
            ),
        )
        self.worker_nc = await connect(config.nats, name="bench-loop-worker")
        worker = LoopWorker(self.worker_nc, config, llm=InstantLLM(iterations, "local__echo"))
        self.worker_task = asyncio.create_task(worker.run(stop))
        await worker.ready.wait()
        return worker


class Ends:
    """Core subscription to every loop_end of the bench tenant."""

    def __init__(self, nc: Any) -> None:
        self.nc = nc
        self.waiters: dict[str, asyncio.Future[LoopEnd]] = {}

    async def start(self) -> None:
        self.sub = await self.nc.subscribe(f"{S.prefix}.events.{TENANT}.*.loop_end", cb=self._on)

    async def _on(self, msg: Any) -> None:
        event = decode(msg.data, AnyEvent)
        future = self.waiters.pop(event.turn_id, None)
        if future is not None and not future.done():
            future.set_result(event)

    def expect(self, turn_id: str) -> asyncio.Future[LoopEnd]:
        future: asyncio.Future[LoopEnd] = asyncio.get_running_loop().create_future()
        self.waiters[turn_id] = future
        return future


async def publish(nc: Any, t: Turn) -> None:
    await nc.jetstream().publish(
        S.turn(t.tenant, t.session), encode(t), headers={"Nats-Msg-Id": t.id}
    )


async def distributed_iteration(mesh: Mesh, ends: Ends, iterations: int) -> list[float]:
    for tid, session in (("warm", "warm"), ("t", "s")):
        done = ends.expect(tid)
        await publish(mesh.nc, turn(tid, session))
        await asyncio.wait_for(done, 120)
    stored = [e for e, _ in await stream_events(mesh.nc, TENANT, "s")]
    return iteration_gaps(stored)


async def distributed_throughput(
    mesh: Mesh, ends: Ends, sessions: int, turns_each: int, tag: str
) -> float:
    async def session(i: int) -> None:
        for k in range(turns_each):
            tid = f"{tag}{i}x{k}"
            done = ends.expect(tid)
            await publish(mesh.nc, turn(tid, f"{tag}{i}"))
            await asyncio.wait_for(done, 300)

    started = time.perf_counter()
    await asyncio.gather(*(session(i) for i in range(sessions)))
    return sessions * turns_each / (time.perf_counter() - started)


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


async def memory_and_kill(store: Path, sessions: int) -> tuple[float, int, float]:
    """(KB per active session, sessions, seconds from kill -9 to the resumed end)."""
    from tests.fake_llm import FakeLLM
    from tests.fake_replies import auto

    async with Mesh(store) as mesh, FakeLLM(default=auto()) as llm:
        await mesh.tool_worker(concurrency=max(64, sessions + 8), module="tests.loop_worker.tools")
        worker = await mesh.loop_worker_process(llm.base_url, "m1")
        ends = Ends(mesh.nc)
        await ends.start()
        tmp = Path(tempfile.mkdtemp())
        counter = tmp / "count"

        def slow(seconds: float) -> str:
            args = {"path": str(counter), "seconds": seconds}
            return f"call local__count {json.dumps(args)}"

        for k in range(3):  # warm up: imports, connections, caches
            done = ends.expect(f"warm{k}")
            await publish(mesh.nc, turn(f"warm{k}", f"warm{k}", slow(0)))
            await asyncio.wait_for(done, 30)
        assert worker.proc is not None
        base = rss_kb(worker.proc.pid)
        for i in range(sessions):
            await publish(mesh.nc, turn(f"m{i}", f"m{i}", slow(30)))
        await _until(lambda: _lines(counter) >= sessions, 60)
        active = rss_kb(worker.proc.pid)
        per_session = (active - base) / sessions
        worker.kill()
        await worker.close()

        # kill -9 mid-turn: w2 already runs when w1 dies
        await mesh.nc.jetstream().purge_stream(S.turns_stream)
        w1 = await mesh.loop_worker_process(llm.base_url, "k1")
        done = ends.expect("k")
        before = _lines(counter)
        await publish(mesh.nc, turn("k", "k", slow(2.5)))
        await _until(lambda: _lines(counter) > before, 30)
        await mesh.loop_worker_process(llm.base_url, "k2")
        assert not done.done(), "the turn ended before the kill; use a slower tool"
        killed = time.perf_counter()
        w1.kill()
        await asyncio.wait_for(done, 60)
        recovery = time.perf_counter() - killed
    return per_session, sessions, recovery


def _lines(path: Path) -> int:
    try:
        return len(path.read_text().splitlines())
    except FileNotFoundError:
        return 0


async def _until(probe: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        result = probe()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise TimeoutError("benchmark step timed out")
        await asyncio.sleep(0.02)


async def main(args: argparse.Namespace) -> None:
    import logging

    logging.basicConfig(level=logging.WARNING)
    sessions = [int(s) for s in args.sessions.split(",")]
    store = Path(tempfile.mkdtemp(prefix="loopmesh-bench-"))

    local_gaps = await inprocess_iteration(args.iterations)
    local_tp = {c: await inprocess_throughput(c, max(3, args.turns // c)) for c in sessions}

    async with Mesh(store / "a") as mesh:
        await mesh.tool_worker()
        stop = asyncio.Event()
        await mesh.run_local_worker(args.iterations, stop)
        ends = Ends(mesh.nc)
        await ends.start()
        dist_gaps = await distributed_iteration(mesh, ends, args.iterations)
        # throughput: one-echo turns (the worker's LLM decides per turn from its messages)
        stop.set()
        await mesh.worker_task
        await mesh.worker_nc.close()
        stop = asyncio.Event()
        await mesh.run_local_worker(1, stop)
        await distributed_throughput(mesh, ends, 4, 2, "w")  # warm up
        dist_tp = {}
        for c in sessions:
            dist_tp[c] = await distributed_throughput(
                mesh, ends, c, max(3, args.turns // c), f"c{c}_"
            )
        stop.set()
        await mesh.worker_task
        await mesh.worker_nc.close()

    per_session, n, recovery = await memory_and_kill(store / "b", args.memory_sessions)

    lp50, dp50 = statistics.median(local_gaps), statistics.median(dist_gaps)
    print(f"\nper-iteration cost ({len(dist_gaps)} iterations, zero-latency LLM, echo tool)")
    print(f"  in-process   p50 {lp50:7.3f} ms   p95 {pct(local_gaps, 0.95):7.3f} ms")
    print(f"  distributed  p50 {dp50:7.3f} ms   p95 {pct(dist_gaps, 0.95):7.3f} ms")
    print(f"  overhead     p50 {dp50 - lp50:+7.3f} ms   (goal <= +1.5 ms)")
    print("\nthroughput (turns/s; each turn: echo call + task_completion)")
    for c in sessions:
        ratio = dist_tp[c] / local_tp[c]
        print(
            f"  {c:4d} sessions  in-process {local_tp[c]:8.1f}"
            f"   distributed {dist_tp[c]:8.1f}   {ratio:6.1%}"
        )
    print("  (goal at 256: >= 50%)")
    print(
        f"\nloop-worker memory: {per_session:.1f} KB per active session "
        f"({n} sessions waiting on a tool; goal <= 100 KB)"
    )
    print(
        f"kill -9 mid-turn -> resumed turn finished: {recovery:.2f} s (AckWait 2 s, lease TTL 2 s)"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--sessions", default="1,64,256")
    parser.add_argument("--turns", type=int, default=512, help="turns per throughput run (about)")
    parser.add_argument("--memory-sessions", type=int, default=256)
    asyncio.run(main(parser.parse_args()))
