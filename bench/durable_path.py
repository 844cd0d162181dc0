"""The measures of ``python -m bench`` that are loopmesh's alone, run briefly from the
scripts that own them: loop-worker memory per active session (``bench/distributed.py``
section 3), the ``bench/floor.py`` bound beside the real loop worker's throughput
(``bench/distributed.py`` sections 1 and 2 at one concurrency), each on its own
embedded nats-server with a zero-latency model in the loop worker
(``bench.instant_worker``), as those scripts measure them."""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bench import distributed, floor, writes

TURNS_EACH = 4  # turns per client in the throughput runs (one session of 4 each)


@dataclass(frozen=True)
class Always:
    """One loop worker with ``sync_interval: always``."""

    gaps: list[float]  # per-iteration times, ms (as bench/distributed.py section 1)
    rate: float  # turns/s at the throughput runs' concurrency
    cpu: dict[str, float]  # CPU ms per turn, by process


@dataclass(frozen=True)
class DurablePath:
    memory_kb: float | None  # loop-worker RSS per active session
    memory_sessions: int
    floor: floor.Floor | None
    real: distributed.Figures | None
    sessions: int
    errors: list[str]
    writes: list[writes.Writes]
    stream_rates: dict[int, float]  # stored messages/s over 1, 2, 4 streams, sync always
    always: Always | None = None

    @property
    def real_ratio(self) -> float | None:
        """The real loop worker's throughput over the in-process engine's (median of
        paired runs) at ``sessions``."""
        return self.real.runs[self.sessions].ratio if self.real is not None else None

    @property
    def overhead_p50(self) -> float | None:
        """Per-iteration overhead over the in-process engine, zero-latency model in the
        loop worker (no HTTP), ms."""
        if self.real is None:
            return None
        return statistics.median(self.real.dist_gaps) - statistics.median(self.real.local_gaps)

    def markdown(self) -> str:
        lines = []
        if self.memory_kb is not None:
            lines.append(
                f"- loop-worker memory: {self.memory_kb:.1f} KB per active session "
                f"({self.memory_sessions} sessions waiting on a tool; RSS over the warm "
                "worker's)"
            )
        if self.real is not None:
            r = self.real
            lines.append(
                f"- per-iteration time, zero-latency model in the loop worker (no HTTP): "
                f"in-process p50 {statistics.median(r.local_gaps):.3f} ms, durable "
                f"p50 {statistics.median(r.dist_gaps):.3f} ms, overhead "
                f"{self.overhead_p50:+.3f} ms ({len(r.dist_gaps)} iterations)"
            )
            pairs = r.runs[self.sessions]
            lines.append(
                f"- throughput at {self.sessions} sessions, turns/s: in-process "
                f"{statistics.median(pairs.local):.0f}, one loop-worker process "
                f"{statistics.median(pairs.dist):.0f}: {pairs.ratio:.0%} of in-process "
                f"(median of {len(pairs.dist)} paired runs); two loop-worker processes "
                f"{statistics.median(r.scaled.dist):.0f}"
            )
            turns = self.sessions * TURNS_EACH * r.one_cpu.runs
            cpu = ", ".join(
                f"{name} {spent / turns * 1000:.3f}" for name, spent in r.one_cpu.spent.items()
            )
            local = r.local_cpu.spent["in-process engine"] / (
                turns / r.one_cpu.runs * r.local_cpu.runs
            )
            lines.append(
                f"- CPU per turn in those runs, ms: {cpu}; the in-process engine {local * 1000:.3f}"
            )
        if self.always is not None:
            a = self.always
            shares = ", ".join(f"{name} {ms:.3f}" for name, ms in a.cpu.items())
            over = ""
            if self.real is not None:
                local = statistics.median(self.real.local_gaps)
                over = f" (overhead {statistics.median(a.gaps) - local:+.3f} ms)"
            lines.append(
                f"- the same with `sync_interval: always`: per-iteration p50 "
                f"{statistics.median(a.gaps):.3f} ms{over}; one run at {self.sessions} "
                f"sessions: {a.rate:.0f} turns/s; CPU per turn, ms: {shares}"
            )
        if self.floor is not None:
            f = self.floor
            lines.append(
                f"- `bench/floor.py` ({f.turns} turns at {f.concurrency}): CPU per turn of "
                f"the messages alone {f.per_turn_ms[0]:.3f} ms (loop-worker side), "
                f"{f.per_turn_ms[1]:.3f} ms (nats-server), {f.per_turn_ms[2]:.3f} ms "
                f"(responder); in-process engine {f.engine_ms:.3f} ms per turn. Bound: at "
                f"most {f.one_process:.0%} of in-process throughput from one loop-worker "
                f"process, {f.shared:.0%} with every process sharing the cores"
            )
        if self.floor is not None and self.real_ratio is not None:
            lines.append(
                f"- real over bound: {self.real_ratio:.0%} / {self.floor.bound:.0%} = "
                f"{self.real_ratio / self.floor.bound:.0%} (goal >= 75%)"
            )
        if self.writes:
            lines += [
                "",
                "JetStream writes per turn with `sync_interval: always` (`python -m bench.writes`:"
                " turns of 1 and of 10 echo calls, one at a time, zero-latency model):",
                "",
                writes.markdown(self.writes),
            ]
        if self.stream_rates:
            rates = " / ".join(f"{r:.0f}" for r in self.stream_rates.values())
            events = next((w.per_turn.get("LOOPMESH_EVENTS", 0) for w in self.writes), 0)
            lines += [
                "",
                f"Messages/s one nats-server stores with `sync_interval: always`, 64 writers "
                f"of 16 messages each over 1 / 2 / 4 streams: {rates}. One stream's writes are "
                "fsynced one after another"
                + (
                    f", so the {events:.0f} events of a one-call turn bound it at "
                    f"{self.stream_rates[1] / events:.0f} turns/s on one events stream."
                    if events
                    else "."
                ),
            ]
        lines += [f"- {e}" for e in self.errors]
        return "\n".join(lines)


async def measure(memory_sessions: int = 256, sessions: int = 256) -> DurablePath:
    errors: list[str] = []
    memory_kb = real = bound = None
    with tempfile.TemporaryDirectory(prefix="loopmesh-bench-") as tmp:
        print("durable path: memory per session ...", file=sys.stderr, flush=True)
        try:
            memory_kb = await distributed.memory(Path(tmp) / "m", memory_sessions)
        except Exception as e:
            errors.append(f"memory: failed: {type(e).__name__}: {e}")
        print("durable path: bench/distributed.py sections 1-2 ...", file=sys.stderr, flush=True)
        args = argparse.Namespace(
            iterations=50, sessions=str(sessions), turns=sessions * TURNS_EACH,
            turns_per_session=4, repeats=3,
        )  # fmt: skip
        try:
            real = await distributed.measure(args, Path(tmp) / "d")
        except Exception as e:
            errors.append(f"distributed: failed: {type(e).__name__}: {e}")
    print("durable path: sync always ...", file=sys.stderr, flush=True)
    always = None
    try:
        with tempfile.TemporaryDirectory(prefix="loopmesh-bench-") as tmp:
            always = await sync_always(Path(tmp), sessions)
    except Exception as e:
        errors.append(f"sync always: failed: {type(e).__name__}: {e}")
    print("durable path: bench/floor.py ...", file=sys.stderr, flush=True)
    try:
        bound = await floor.measure(argparse.Namespace(turns=8192, concurrency=sessions))
    except Exception as e:
        errors.append(f"floor: failed: {type(e).__name__}: {e}")
    print("durable path: writes per turn ...", file=sys.stderr, flush=True)
    counted: list[writes.Writes] = []
    rates: dict[int, float] = {}
    try:
        counted = await writes.measure(30)
        rates = await writes.stream_rates()
    except Exception as e:
        errors.append(f"writes: failed: {type(e).__name__}: {e}")
    return DurablePath(
        memory_kb, memory_sessions, bound, real, sessions, errors, counted, rates, always
    )


async def sync_always(store: Path, sessions: int) -> Always:
    """One loop-worker process (zero-latency model) with ``sync_interval: always``: its
    per-iteration time, its turns/s at ``sessions`` and each process's CPU per turn."""
    import os

    from bench.harness import CpuMeter, Ends, Load, Mesh, pid_of
    from loopmesh.server import NatsServer

    conf = store / "sync.conf"
    conf.write_text("jetstream { sync_interval: always }\n")
    mesh = Mesh(store, ack_wait_s=30, lease_ttl_s=30)
    mesh.server = NatsServer(store, extra_args=("-c", str(conf)))
    async with mesh:
        tools = await mesh.tool_worker()
        worker = await mesh.instant_worker("a1", 50)
        ends = Ends(mesh.nc)
        await ends.start()
        gaps = await distributed.distributed_iteration(mesh, ends, 50)
        load = Load(TURNS_EACH, sessions * TURNS_EACH)
        await load.warm_up(ends.run, "w")
        assert mesh.server.pid is not None
        meter = CpuMeter(
            {"loop worker": pid_of(worker), "tool worker": pid_of(tools),
             "nats-server": mesh.server.pid, "load generator (bench)": os.getpid()}
        )  # fmt: skip
        meter.start()
        rate = await load.run(ends.run, sessions, "a")
        meter.stop()
    turns = sessions * load.turns_each(sessions)
    cpu = {name: spent / turns * 1000 for name, spent in meter.spent.items()}
    return Always(gaps, rate, cpu)
