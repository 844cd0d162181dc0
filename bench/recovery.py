"""Recovery from kill -9 mid-turn, for loopmesh and the two durable peers.

Each run is one session of one tool call and then the finish. The tool appends a line to
a file as it starts, so the bench sees it start, and then waits until the bench
releases it. Once the tool runs, a standby for the process running the session is
started and is ready, then that process gets SIGKILL, the tool is released at once (so
it finishes with the kill: the figure is the recovery's, not the tool's), and the clock
runs from the kill to the session's end:

- **loopmesh**: the loop worker dies (the tool worker lives on and records the call's
  effect); the turn stays unacked in the work queue, is redelivered after AckWait to the
  standby loop worker, which waits for the session's lease to lapse (its TTL), resumes
  from the checkpoint holding the pending call and reads the call's effect record
  instead of calling again. Nothing outside notices: JetStream redelivers.
- **Temporal** (the dev server on its SQLite file): the workflow worker (workflow and
  LLM activities) dies; the tool activity goes on in its own worker process. The
  workflow task its completion makes is first offered on the dead worker's sticky
  queue, and moves to the shared queue when the sticky queue's schedule-to-start
  timeout passes (the SDK's default, 5 s); the standby worker takes it, replays the
  history and goes on. Nothing outside notices: the server reschedules.
- **LangGraph + Postgres**: the process running the graph dies, tool and all. Nothing
  in LangGraph notices: an outside supervisor (here the bench, which knows at once) has
  to start ``ainvoke(None, same thread_id)`` elsewhere; it resumes from the last
  checkpoint (the agent step's), so the tools node runs again, whole (here at once,
  being released; a real tool takes its whole time again).

The loop worker's and the standby's time to start is not counted for any of them (the
standby is running when the kill comes).
"""

from __future__ import annotations

import asyncio
import json
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from bench.common import Missing
from bench.harness import Ends, Mesh, S, publish, turn
from bench.peers.langgraph import Postgres
from bench.peers.temporal import AGENT_QUEUE, Temporal
from loop_worker.config import ServiceSettings
from loopmesh.testing.durable import Proc
from loopmesh.testing.fake_llm import FakeLLM
from loopmesh.testing.fake_replies import auto

DEFAULTS = ServiceSettings()
TUNED_S = 1.0  # AckWait and lease TTL of the tuned loopmesh run


@dataclass(frozen=True)
class Kill:
    recovery_s: float  # kill -9 -> the session finished
    tool_starts: int  # times the tool started for the session (2: it ran again)


@dataclass
class Recovery:
    name: str
    how: str
    short: str = ""  # the name in the goals table
    kills: list[Kill] = field(default_factory=list)
    error: str = ""

    def median(self, attr: str) -> float:
        return statistics.median(getattr(k, attr) for k in self.kills)

    def line(self) -> str:
        if self.error:
            return f"| {self.name} | {self.error} | | | |"
        times = ", ".join(f"{k.recovery_s:.2f}" for k in self.kills)
        starts = sorted({k.tool_starts for k in self.kills})
        return (
            f"| {self.name} | {self.median('recovery_s'):.2f} ({times}) "
            f"| {'/'.join(map(str, starts))} | {self.how} |"
        )


def table(results: list[Recovery]) -> str:
    return "\n".join(
        [
            "kill -9 of the process running the session while its tool call runs; the tool "
            "is released right after the kill, a standby is already running "
            "(`bench/recovery.py`)",
            "",
            "| system | kill -9 -> session finished, s: median (each run) "
            "| tool starts per session | how it resumes |",
            "| --- | --- | --- | --- |",
            *(r.line() for r in results),
        ]
    )


def _lines(path: Path) -> int:
    try:
        return len(path.read_text().splitlines())
    except FileNotFoundError:
        return 0


async def _tool_started(path: Path, before: int, timeout: float = 60) -> float:
    """When ``path`` got a line more than ``before`` (polled every 10 ms)."""
    async with asyncio.timeout(timeout):
        while True:
            if _lines(path) > before:
                return time.perf_counter()
            await asyncio.sleep(0.01)


def _kill_and_release(kill: Callable[[], object], release: Path) -> float:
    """Kill, then release the held tool call; when the kill was sent."""
    killed = time.perf_counter()
    kill()
    release.touch()
    return killed


# -- loopmesh ---------------------------------------------------------------------------


async def loopmesh(
    store: Path, runs: int, *, timers_s: float | None = None, nodes: int = 1
) -> Recovery:
    """``timers_s``: AckWait and lease TTL both (``None``: the loop worker's defaults);
    ``nodes``: 3 for a cluster with every stream and bucket on three replicas."""
    ack_wait_s = DEFAULTS.ack_wait_s if timers_s is None else timers_s
    lease_ttl_s = DEFAULTS.lease_ttl_s if timers_s is None else timers_s
    how = (
        f"JetStream redelivers the unacked turn after AckWait ({ack_wait_s:g} s) to the "
        "standby loop worker, which looks for such turns every third of AckWait; it takes "
        f"the session's lease once its TTL ({lease_ttl_s:g} s) "
        "lapses, resumes from the checkpoint with the pending call and reads its effect record"
    )
    label = "defaults: " if timers_s is None else ""
    where = ", R3 cluster" if nodes > 1 else ""
    short = "loopmesh, defaults" if timers_s is None else f"loopmesh, {timers_s:g} s"
    name = f"loopmesh ({label}AckWait {ack_wait_s:g} s, lease TTL {lease_ttl_s:g} s{where})"
    out = Recovery(name, how, short)
    mark = store / "mark"
    async with (
        Mesh(store, ack_wait_s=ack_wait_s, lease_ttl_s=lease_ttl_s, nodes=nodes) as mesh,
        FakeLLM(default=auto()) as llm,
    ):
        await mesh.tool_worker(concurrency=64, module="bench.held")
        ends = Ends(mesh.nc)
        await ends.start()
        alive = await mesh.loop_worker_process(llm.base_url, "k0")
        for r in range(runs):
            release = store / f"release{r}"
            args = json.dumps({"path": str(mark), "release": str(release)})
            t = turn(f"k{r}", f"k{r}", f"call local__hold {args}")
            done = ends.expect(t.id)
            before = _lines(mark)
            await publish(mesh.nc, t)
            await _tool_started(mark, before)
            standby = await mesh.loop_worker_process(llm.base_url, f"k{r + 1}")
            killed = _kill_and_release(alive.kill, release)
            await asyncio.wait_for(done, 120)
            out.kills.append(Kill(time.perf_counter() - killed, _lines(mark) - before))
            await alive.close()
            alive = standby
    return out


@dataclass(frozen=True)
class Upkeep:
    """What one worker sends to keep its running turns, per active turn and second."""

    turns: int
    seconds: float
    progress_acks: int  # in-progress acks on the turns consumers
    lease_writes: int  # lease renewals (KV writes)

    def line(self) -> str:
        per = self.turns * self.seconds
        return (
            f"upkeep with the defaults (AckWait {DEFAULTS.ack_wait_s:g} s, lease TTL "
            f"{DEFAULTS.lease_ttl_s:g} s), {self.turns} turns held in a tool call for "
            f"{self.seconds:g} s: {self.progress_acks / per:.2f} in-progress acks and "
            f"{self.lease_writes / per:.2f} lease writes per active turn per second"
        )


async def upkeep(store: Path, turns: int = 32, seconds: float = 10.0) -> Upkeep:
    """Count what a loop worker with the default timers sends while ``turns`` turns wait
    on a tool: the in-progress acks to the turns stream (every message to ``$JS.ACK``
    for it, seen by a subscriber beside the server) and the writes to the leases bucket
    (its stream's sequence)."""
    mark, release = store / "mark", store / "release"
    async with (
        Mesh(store, ack_wait_s=DEFAULTS.ack_wait_s, lease_ttl_s=DEFAULTS.lease_ttl_s) as mesh,
        FakeLLM(default=auto()) as llm,
    ):
        await mesh.tool_worker(concurrency=turns, module="bench.held")
        ends = Ends(mesh.nc)
        await ends.start()
        await mesh.loop_worker_process(llm.base_url, "u0")
        args = json.dumps({"path": str(mark), "release": str(release)})
        batch = [turn(f"u{i}", f"u{i}", f"call local__hold {args}") for i in range(turns)]
        done = [ends.expect(t.id) for t in batch]
        for t in batch:
            await publish(mesh.nc, t)
        await _tool_started(mark, turns - 1, timeout=120)  # every call runs
        acks = 0

        async def count(msg: Any) -> None:
            nonlocal acks
            acks += msg.data == b"+WPI"

        sub = await mesh.nc.subscribe(f"$JS.ACK.{S.turns_stream}.>", cb=count)
        js = mesh.nc.jetstream()
        leases = f"KV_{S.leases_bucket}"
        first = (await js.stream_info(leases)).state.last_seq
        await asyncio.sleep(seconds)
        writes = (await js.stream_info(leases)).state.last_seq - first
        await sub.unsubscribe()
        release.touch()
        await asyncio.wait_for(asyncio.gather(*done), 120)
    return Upkeep(turns=turns, seconds=seconds, progress_acks=acks, lease_writes=writes)


# -- Temporal ---------------------------------------------------------------------------


async def temporal(
    llm_url: str, store: Path, runs: int, task_timeout_s: float | None = None
) -> Recovery:
    how = (
        "the tool's completion makes a workflow task for the dead worker's sticky queue: "
        "it moves to the shared queue after the sticky schedule-to-start timeout, or, if "
        "the server handed it to the dead worker's open poll, is retried after the workflow "
        "task timeout; the standby then replays the history and goes on"
    )
    if task_timeout_s is None:
        name = "Temporal (defaults: sticky schedule-to-start 10 s, workflow task 10 s)"
    else:
        name = (
            f"Temporal (sticky schedule-to-start and workflow task timeouts {task_timeout_s:g} s)"
        )
    short = "Temporal, defaults" if task_timeout_s is None else f"Temporal, {task_timeout_s:g} s"
    out = Recovery(name, how, short)
    extra: dict[str, Any] = {}
    sticky: list[str] = []
    if task_timeout_s is not None:
        extra["task_timeout"] = timedelta(seconds=task_timeout_s)
        sticky = ["--sticky-s", str(task_timeout_s)]
    system = Temporal(llm_url, store, local=True)
    await system.start_server()
    mark = store / "mark"
    try:
        await system.start_tools(str(mark), str(store / "release"))
        alive = await system.spawn("agent", "--llm", llm_url, *sticky)
        for r in range(runs):
            (store / "release").unlink(missing_ok=True)
            before = _lines(mark)
            handle = await system.client.start_workflow(
                "Agent", args=[f"rec{r} echo 1", True], id=f"rec{r}", task_queue=AGENT_QUEUE,
                **extra,
            )  # fmt: skip
            await _tool_started(mark, before)
            standby = await system.spawn("agent", "--llm", llm_url, *sticky)
            killed = _kill_and_release(alive.kill, store / "release")
            await asyncio.wait_for(handle.result(), 120)
            out.kills.append(Kill(time.perf_counter() - killed, _lines(mark) - before))
            await alive.wait()
            alive = standby
    finally:
        await system.stop_processes()
    return out


# -- LangGraph --------------------------------------------------------------------------


async def langgraph(llm_url: str, store: Path, runs: int) -> Recovery:
    how = (
        "nothing notices the death: a supervisor (here the bench, at once) must run "
        "ainvoke(None, same thread_id) elsewhere; it resumes from the agent step's "
        "checkpoint, so the tools node runs again whole"
    )
    out = Recovery("LangGraph + Postgres (resumed at once)", how, "LangGraph, ideal supervisor")
    mark = store / "mark"
    async with Postgres(store) as pg:
        for r in range(runs):
            args = ["--pg", pg.url, "--llm", llm_url, "--thread", f"rec{r}"]
            release = store / f"release{r}"
            args += ["--mark", str(mark), "--hold", str(release)]
            before = _lines(mark)
            runner = await Proc("-m", "bench.peers.langgraph", "run", *args).start("ready")
            try:
                await _tool_started(mark, before)
                standby = await Proc("-m", "bench.peers.langgraph", "resume", *args).start("ready")
                try:
                    killed = _kill_and_release(runner.kill, release)
                    await runner.close()
                    assert standby.proc is not None
                    standby.proc.send_signal(signal.SIGUSR1)  # the supervisor: resume it
                    await standby.wait_line("done", 120)
                    out.kills.append(Kill(time.perf_counter() - killed, _lines(mark) - before))
                finally:
                    await standby.close()
            finally:
                await runner.close()
    return out


async def run_all(llm_url: str, runs: int) -> list[Recovery]:
    results = []
    for name, go in (
        ("loopmesh", lambda d: loopmesh(d, runs)),
        ("loopmesh", lambda d: loopmesh(d, runs, timers_s=TUNED_S)),
        ("Temporal", lambda d: temporal(llm_url, d, runs)),
        ("Temporal", lambda d: temporal(llm_url, d, runs, task_timeout_s=2.0)),
        ("LangGraph + Postgres", lambda d: langgraph(llm_url, d, runs)),
    ):
        print(f"recovery: {name} ...", file=sys.stderr, flush=True)
        try:
            with tempfile.TemporaryDirectory(prefix="loopmesh-bench-") as tmp:
                results.append(await go(Path(tmp)))
        except Missing as e:
            results.append(Recovery(name, "", error=f"not run: {e}"))
        except Exception as e:
            results.append(Recovery(name, "", error=f"failed: {type(e).__name__}: {e}"))
    return results


async def main(runs: int, peers: bool, nodes: int) -> None:
    """loopmesh with the defaults beside the tuned timers, and what the defaults cost;
    with ``peers``, Temporal and LangGraph too (as ``python -m bench`` runs them)."""
    if peers:
        async with FakeLLM(default=auto()) as llm:
            results = await run_all(llm.base_url, runs)
    else:
        results = []
        for timers in (None, TUNED_S):
            with tempfile.TemporaryDirectory(prefix="loopmesh-bench-") as tmp:
                results.append(await loopmesh(Path(tmp), runs, timers_s=timers, nodes=nodes))
    with tempfile.TemporaryDirectory(prefix="loopmesh-bench-") as tmp:
        cost = await upkeep(Path(tmp))
    print(table(results))
    print()
    print(f"- {cost.line()}")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="kill -9 runs per system")
    parser.add_argument("--peers", action="store_true", help="Temporal and LangGraph too")
    parser.add_argument("--nodes", type=int, default=1, help="3: loopmesh on an R3 cluster")
    args = parser.parse_args()
    asyncio.run(main(args.runs, args.peers, args.nodes))
