"""The cost of running the loop durably on NATS, against the in-process engine.

    python bench/distributed.py [--iterations 200] [--sessions 1,64,256] [--turns 2048]
                                [--turns-per-session 4] [--repeats 3]
                                [--memory-sessions 256]

Both paths run the same zero-latency model (``bench.instant_worker.InstantLLM``: a
turn whose input ends in "echo N" makes N echo calls, any other turn one, then
``task_completion``) and an async echo tool, with the same loop settings. In-process,
the engine, model and tool run in this process with in-memory events and store.
Distributed, the engine and model run in a separate loop-worker process
(``python -m bench.instant_worker``: the real ``LoopWorker``, only the LLM swapped), the
echo in a tool-worker process, and this process is only the load generator: it
publishes turns to JetStream and waits for their ``loop_end`` events. Prints, in one
run (so every ratio is a same-run comparison):

1. per-iteration cost: three turns of ``--iterations`` echo calls each; the time between
   consecutive ``loop_iteration`` events. Distributed adds the tool call over JetStream
   to the tool worker, the events to the events stream, the checkpoint to KV and the
   lease (goal: p50 within +1.5 ms);
2. throughput (turns/s) at each of ``--sessions`` concurrent clients, turns of one echo
   call. Each client runs sessions of ``--turns-per-session`` turns back to back, then
   starts a fresh session, until it has run its share of ``--turns`` (at least one
   session), so history stays short and the figure is the system's, not history
   growth's. The two paths alternate, ``--repeats`` runs each, and the ratio is the
   median of each distributed run over the in-process run just before it (a shared
   machine's speed drifts by tens of percent within a minute). Goal: distributed >=
   50% of in-process at 256 sessions with one loop-worker process. A scale-out line:
   the largest run again with two loop-worker processes on the same consumer. Then
   the CPU time per turn of each process during the largest runs
   (``/proc/<pid>/stat``), and of the rest of the machine (``/proc/stat``): other work
   there disturbs the figures, and the bench says so;
3. loop-worker memory per active session: a ``python -m loop_worker`` process with N
   sessions waiting on a slow tool, RSS over an idle baseline (goal: <= 100 KB);
4. the time from kill -9 of a loop worker mid-turn to the turn finishing on another
   (AckWait and lease TTL 2 s here; ``bench/recovery.py``).

Everything is local: an embedded nats-server, tool and loop workers as processes, and
for sections 3 and 4 the fake OpenAI-compatible server (``loopmesh.testing.fake_llm``). Sections 1
and 2 provision AckWait and lease TTL at 30 s (``bench.harness.QUIET_S``: far above
any wait the bench measures, so a turn left to them stands out).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import recovery  # noqa: E402
from bench.harness import (  # noqa: E402
    TENANT,
    CpuMeter,
    Ends,
    Load,
    Mesh,
    local_engine,
    pid_of,
    publish,
    rss_kb,
    turn,
)
from loop_worker.engine import Engine  # noqa: E402
from loopmesh.aio import run  # noqa: E402
from loopmesh.testing.durable import stream_events  # noqa: E402
from schemas.events import Event  # noqa: E402

#: Turns of ``--iterations`` echo calls measured per path (one turn is about 0.3 s of
#: samples, too few to be steady on a shared machine).
ITERATION_TURNS = 3


def iteration_gaps(events: Sequence[Event]) -> list[float]:
    ts = [e.ts for e in events if e.type == "loop_iteration"]
    return [(b - a) * 1000 for a, b in itertools.pairwise(ts)]


def pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# -- in-process ---------------------------------------------------------------------------


async def inprocess_iteration(iterations: int) -> list[float]:
    engine, events = local_engine(iterations)
    await engine.run(turn("warm", "warm", f"echo {iterations}"))
    gaps: list[float] = []
    for k in range(ITERATION_TURNS):
        events.events.clear()
        await engine.run(turn(f"t{k}", f"s{k}", f"echo {iterations}"))
        gaps += iteration_gaps(events.events)
    return gaps


# -- distributed ------------------------------------------------------------------------


async def distributed_iteration(mesh: Mesh, ends: Ends, iterations: int) -> list[float]:
    await ends.run(turn("warm", "warm", f"echo {iterations}"))
    gaps: list[float] = []
    for k in range(ITERATION_TURNS):
        await ends.run(turn(f"t{k}", f"s{k}", f"echo {iterations}"))
        gaps += iteration_gaps([e for e, _ in await stream_events(mesh.nc, TENANT, f"s{k}")])
    return gaps


async def memory(store: Path, sessions: int) -> float:
    """KB of loop-worker RSS per active session: ``sessions`` turns waiting on a slow
    tool, over the worker's RSS once warm."""
    from loopmesh.testing.fake_llm import FakeLLM
    from loopmesh.testing.fake_replies import auto

    async with Mesh(store) as mesh, FakeLLM(default=auto()) as llm:
        await mesh.tool_worker(concurrency=max(64, sessions + 8), module="bench.tools")
        worker = await mesh.loop_worker_process(llm.base_url, "m1")
        ends = Ends(mesh.nc)
        await ends.start()
        counter = store / "count"

        def slow(seconds: float) -> str:
            args = {"path": str(counter), "seconds": seconds}
            return f"call local__count {json.dumps(args)}"

        for k in range(3):  # warm up: imports, connections, caches
            await ends.run(turn(f"warm{k}", f"warm{k}", slow(0)), 30)
        assert worker.proc is not None
        base = rss_kb(worker.proc.pid)
        for i in range(sessions):
            await publish(mesh.nc, turn(f"m{i}", f"m{i}", slow(30)))
        await _until(lambda: _lines(counter) >= sessions, 60)
        active = rss_kb(worker.proc.pid)
        worker.kill()
        await worker.close()
    return (active - base) / sessions


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


@dataclass(frozen=True)
class Figures:
    local_gaps: list[float]
    dist_gaps: list[float]
    runs: dict[int, Pairs]  # per concurrency: in-process and one loop-worker process
    local_cpu: CpuMeter  # the largest runs, in-process
    one_cpu: CpuMeter  # the largest runs, one loop-worker process
    scaled: Pairs  # the largest runs, two loop-worker processes
    two_cpu: CpuMeter


async def measure(args: argparse.Namespace, store: Path) -> Figures:
    """Sections 1 and 2. The workers start first; then every in-process run is paired
    with the distributed run after it, so each ratio compares runs seconds apart."""
    sessions = [int(s) for s in args.sessions.split(",")]
    top = max(sessions)
    load = Load(args.turns_per_session, args.turns)

    async with Mesh(store, ack_wait_s=30, lease_ttl_s=30) as mesh:
        tools = await mesh.tool_worker()
        first = await mesh.instant_worker("i1", args.iterations)
        ends = Ends(mesh.nc)
        await ends.start()
        local_gaps = await inprocess_iteration(args.iterations)
        dist_gaps = await distributed_iteration(mesh, ends, args.iterations)

        assert mesh.server.pid is not None
        others = {
            "tool worker": pid_of(tools),
            "nats-server": mesh.server.pid,
            "load generator (bench)": os.getpid(),
        }
        engine, _ = local_engine(1)
        await load.warm_up(engine.run, "w")
        await load.warm_up(ends.run, "w")
        local_cpu = CpuMeter({"in-process engine": os.getpid()})
        one_cpu = CpuMeter({"loop worker 1": pid_of(first), **others})
        runs: dict[int, Pairs] = {}
        for c in sessions:
            meters = (local_cpu, one_cpu) if c == top else (None, None)
            runs[c] = await paired(load, engine, ends, c, args.repeats, *meters)

        second = await mesh.instant_worker("i2", args.iterations)
        await load.warm_up(ends.run, "w2_")
        two_cpu = CpuMeter(
            {"loop worker 1": pid_of(first), "loop worker 2": pid_of(second), **others}
        )
        scaled = await paired(load, engine, ends, top, args.repeats, None, two_cpu, "x")
        for worker in (second, first):
            await worker.terminate()
    return Figures(
        local_gaps=local_gaps, dist_gaps=dist_gaps, runs=runs, local_cpu=local_cpu,
        one_cpu=one_cpu, scaled=scaled, two_cpu=two_cpu,
    )  # fmt: skip


@dataclass(frozen=True)
class Pairs:
    """Runs of each path at one concurrency, alternating: in-process, distributed, ..."""

    local: list[float]  # turns/s
    dist: list[float]

    @property
    def ratio(self) -> float:
        """The median of each distributed run over the in-process run before it."""
        return statistics.median(d / lo for lo, d in zip(self.local, self.dist, strict=True))


async def paired(
    load: Load,
    engine: Engine,
    ends: Ends,
    clients: int,
    repeats: int,
    local_cpu: CpuMeter | None,
    dist_cpu: CpuMeter | None,
    tag: str = "",
) -> Pairs:
    """An in-process run then a distributed run, ``repeats`` times; the meters given
    add up their path's runs."""
    pairs = Pairs([], [])
    for r in range(repeats):
        for path, run_turn, meter, out in (
            ("l", engine.run, local_cpu, pairs.local),
            ("d", ends.run, dist_cpu, pairs.dist),
        ):
            if meter is not None:
                meter.start()
            out.append(await load.run(run_turn, clients, f"{tag}{path}{r}c{clients}_"))
            if meter is not None:
                meter.stop()
    return pairs


ALL = "all of the above"


def report(args: argparse.Namespace, f: Figures) -> None:
    lp50, dp50 = statistics.median(f.local_gaps), statistics.median(f.dist_gaps)
    print(f"\nper-iteration cost ({len(f.dist_gaps)} iterations, zero-latency LLM, echo tool)")
    print(f"  in-process   p50 {lp50:7.3f} ms   p95 {pct(f.local_gaps, 0.95):7.3f} ms")
    print(f"  distributed  p50 {dp50:7.3f} ms   p95 {pct(f.dist_gaps, 0.95):7.3f} ms")
    print(f"  overhead     p50 {dp50 - lp50:+7.3f} ms   (goal <= +1.5 ms)")

    load = Load(args.turns_per_session, args.turns)
    top = max(f.runs)
    print(
        f"\nthroughput (turns/s; each turn: echo call + task_completion; sessions of "
        f"{load.per_session} turns, {args.turns} turns per run; medians of "
        f"{args.repeats} runs of each path, alternating)"
    )

    def line(c: int, label: str, pairs: Pairs) -> None:
        local, dist = statistics.median(pairs.local), statistics.median(pairs.dist)
        spread = f"{min(pairs.dist):.0f}-{max(pairs.dist):.0f}"
        print(
            f"  {c:4d} sessions  in-process {local:7.0f}   {label:>14s} {dist:7.0f}"
            f" ({spread:>9s})   {pairs.ratio:6.1%}"
        )

    for c, pairs in f.runs.items():
        line(c, "distributed", pairs)
    print("  (the ratio: the median of each distributed run over the in-process run before")
    print("   it; goal at 256: >= 50%, with one loop-worker process)")
    line(top, "2 loop workers", f.scaled)

    turns = top * load.turns_each(top)
    print(
        f"\nCPU time per turn at {top} sessions, ms (and % of one core over the run; "
        f"{os.cpu_count()} cores)"
    )
    print(f"  {'':24s}{'one loop worker':>20s}{'two loop workers':>20s}")

    def cell(meter: CpuMeter, name: str) -> str:
        if name not in meter.spent:
            return f"{'-':>20s}"
        spent = meter.spent[name]
        return f"{spent / (turns * meter.runs) * 1000:12.3f} ({spent / meter.wall:4.0%})"

    for meter in (f.one_cpu, f.two_cpu):
        meter.spent[ALL] = sum(v for k, v in meter.spent.items() if k != CpuMeter.OTHERS)
    for name in dict.fromkeys([*f.two_cpu.pids, ALL, CpuMeter.OTHERS]):
        print(f"  {name:24s}{cell(f.one_cpu, name)}{cell(f.two_cpu, name)}")
    local, rest = f.local_cpu.spent["in-process engine"], f.local_cpu.spent[CpuMeter.OTHERS]
    print(
        f"  (in-process: {local / (turns * f.local_cpu.runs) * 1000:.3f} ms per turn, "
        f"{local / f.local_cpu.wall:.0%} of one core; rest of the machine "
        f"{rest / f.local_cpu.wall:.0%})"
    )
    busy = max(m.spent[CpuMeter.OTHERS] / m.wall for m in (f.local_cpu, f.one_cpu, f.two_cpu))
    if busy > 0.2:
        print(
            f"  note: other processes on the machine used up to {busy:.0%} of a core during "
            "these runs; the throughput figures are disturbed"
        )


async def main(args: argparse.Namespace) -> None:
    import logging

    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="loopmesh-bench-") as tmp:
        store = Path(tmp)
        figures = await measure(args, store / "a")
        report(args, figures)  # before the last section, which a loaded machine can fail
        n = args.memory_sessions
        per_session = await memory(store / "b", n)
        print(
            f"\nloop-worker memory: {per_session:.1f} KB per active session "
            f"({n} sessions waiting on a tool; goal <= 100 KB)"
        )
        kills = await recovery.loopmesh(store / "c", runs=1)
    print(
        f"kill -9 mid-turn -> resumed turn finished: {kills.kills[0].recovery_s:.2f} s "
        "(AckWait 2 s, lease TTL 2 s)"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--sessions", default="1,64,256", help="concurrent clients per run")
    parser.add_argument("--turns", type=int, default=2048, help="turns per throughput run")
    parser.add_argument("--turns-per-session", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each path per line")
    parser.add_argument("--memory-sessions", type=int, default=256)
    run(main(parser.parse_args()))
