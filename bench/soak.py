"""Soak: many turns through one loop worker, watching memory and storage.

    python bench/soak.py [--turns 100000] [--clients 32] [--per-session 10]
                         [--echo 1] [--events-max-mb 64] [--every 2]

An embedded nats-server, one loop worker with the zero-latency LLM
(``bench.instant_worker``) and one tool worker (each turn makes ``--echo`` echo calls,
then ends). ``--clients`` clients each run turns one after another, in fresh sessions
of ``--per-session`` turns. Every ``--every`` seconds it samples each process's RSS and
the bytes of every stream and bucket, and prints:

- the samples (turns done, RSS per process, stored bytes);
- the RSS plateau: each process's RSS at the end of warm-up (the first tenth of the
  turns) and its highest after, so growth after warm-up shows;
- bytes per turn of the events stream (taken from the last sample in which the stream
  had discarded nothing) and whether every limited stream stayed within its limit.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import Ends, Mesh, S, pid_of, rss_kb, turn
from loopmesh.provision import provision
from schemas import definitions

MB = 2**20


@dataclass
class Sample:
    t: float
    turns: int
    rss_kb: dict[str, int]
    bytes: dict[str, int]
    events_first_seq: int


@dataclass
class Soak:
    args: argparse.Namespace
    done: int = 0
    samples: list[Sample] = field(default_factory=list)


async def stream_bytes(js: Any) -> tuple[dict[str, int], int]:
    """Bytes kept by store (the events summed over every partition's stream), and the
    highest first sequence of an events stream (above 1: events were discarded)."""
    names = {
        "turns": S.turns_stream, "tools": S.tools_stream,
        "sessions": f"KV_{S.sessions_bucket}", "effects": f"KV_{S.effects_bucket}",
        "leases": f"KV_{S.leases_bucket}",
    }  # fmt: skip
    out, first = {"events": 0}, 0
    for stream in S.events_streams:
        info = await js.stream_info(stream)
        out["events"] += info.state.bytes
        first = max(first, info.state.first_seq)
    for label, stream in names.items():
        out[label] = (await js.stream_info(stream)).state.bytes
    return out, first


async def client(soak: Soak, ends: Ends, k: int, turns: int) -> None:
    text = f"echo {soak.args.echo}"
    for i in range(turns):
        session = f"c{k}s{i // soak.args.per_session}"
        await ends.run(turn(f"c{k}t{i}", session, text), timeout=120)
        soak.done += 1


async def sampler(soak: Soak, js: Any, pids: dict[str, int], start: float) -> None:
    while True:
        sizes, first = await stream_bytes(js)
        rss = {name: rss_kb(pid) for name, pid in pids.items()}
        soak.samples.append(Sample(time.monotonic() - start, soak.done, rss, sizes, first))
        await asyncio.sleep(soak.args.every)


async def run(args: argparse.Namespace, store: Path) -> Soak:
    soak = Soak(args)
    async with Mesh(store, ack_wait_s=30, lease_ttl_s=30) as mesh:
        js = mesh.nc.jetstream()
        actions = await provision(
            js,
            definitions(
                S, lease_ttl_s=30,
                events_max_bytes=args.events_max_mb * MB, sessions_ttl_s=args.sessions_ttl_s,
            ),
        )  # fmt: skip
        print("provisioned:", "; ".join(actions), flush=True)
        tools = await mesh.tool_worker()
        worker = await mesh.instant_worker("soak", max(1, args.echo))
        ends = Ends(mesh.nc)
        await ends.start()
        assert mesh.server.pid is not None
        pids = {
            "loop worker": pid_of(worker), "tool worker": pid_of(tools),
            "nats-server": mesh.server.pid, "load generator": os.getpid(),
        }  # fmt: skip
        start = time.monotonic()
        sampling = asyncio.create_task(sampler(soak, js, pids, start))
        try:
            share, extra = divmod(args.turns, args.clients)
            async with asyncio.TaskGroup() as tg:
                for k in range(args.clients):
                    tg.create_task(client(soak, ends, k, share + (k < extra)))
        finally:
            sampling.cancel()
        sizes, first = await stream_bytes(js)
        rss = {name: rss_kb(pid) for name, pid in pids.items()}
        soak.samples.append(Sample(time.monotonic() - start, soak.done, rss, sizes, first))
        await worker.terminate()
        await tools.terminate()
    return soak


def report(soak: Soak) -> None:
    args, samples = soak.args, soak.samples
    elapsed = samples[-1].t
    print(
        f"\nturns {soak.done} in {elapsed:.0f}s ({soak.done / elapsed:.0f}/s), "
        f"{args.clients} clients, {args.per_session} turns per session, {args.echo} echo "
        f"call(s) per turn; events max_bytes {args.events_max_mb} MiB"
    )
    names = list(samples[0].rss_kb)
    step = max(1, len(samples) // 12)
    print("\n  t(s)   turns  " + "  ".join(f"{n[:12]:>12}" for n in names) + "   events MiB"
          "  sessions MiB  effects MiB")  # fmt: skip
    for s in samples[::step] + ([samples[-1]] if (len(samples) - 1) % step else []):
        rss = "  ".join(f"{s.rss_kb[n] / 1024:>9.1f} MiB" for n in names)
        b = s.bytes
        print(
            f"{s.t:6.0f} {s.turns:7d}  {rss}  {b['events'] / MB:11.1f}"
            f"  {b['sessions'] / MB:12.1f}  {b['effects'] / MB:11.1f}"
        )
    warm = next((s for s in samples if s.turns >= args.turns // 10), samples[0])
    after = [s for s in samples if s.t >= warm.t]
    print("\nRSS after warm-up (the first tenth of the turns) → highest after:")
    for n in names:
        top = max(s.rss_kb[n] for s in after)
        last = samples[-1].rss_kb[n]
        print(
            f"  {n:16} {warm.rss_kb[n] / 1024:7.1f} → {top / 1024:7.1f} MiB "
            f"(+{(top - warm.rss_kb[n]) / 1024:.1f}); at the end {last / 1024:.1f} MiB"
        )
    undiscarded = [s for s in samples if s.events_first_seq <= 1 and s.turns]
    if undiscarded:
        s = undiscarded[-1]
        print(f"\nevents bytes per turn: {s.bytes['events'] / s.turns:.0f} "
              f"(at {s.turns} turns, none discarded)")  # fmt: skip
    limit = args.events_max_mb * MB
    top_events = max(s.bytes["events"] for s in samples)
    print(
        f"events stream: highest {top_events / MB:.1f} MiB of its {args.events_max_mb} MiB "
        f"limit ({'within' if top_events <= limit else 'OVER'}); first kept seq at the end "
        f"{samples[-1].events_first_seq}"
    )
    for label in ("sessions", "effects", "turns", "tools"):
        print(f"{label}: {samples[-1].bytes[label] / MB:.1f} MiB at the end")


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="loopmesh-soak-") as store:
        report(await run(args, Path(store)))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--turns", type=int, default=100_000)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--per-session", type=int, default=10)
    parser.add_argument("--echo", type=int, default=1, help="echo calls per turn")
    parser.add_argument("--events-max-mb", type=int, default=64)
    parser.add_argument("--sessions-ttl-s", type=float, default=24 * 3600.0)
    parser.add_argument("--every", type=float, default=2.0, help="seconds between samples")
    asyncio.run(main(parser.parse_args()))
