"""Back-to-back turns on several loop workers: does a session's next turn ever wait?

    python -m bench.handover [--workers 2] [--clients 128] [--seconds 10] [--runs 3]

An embedded nats-server, ``--workers`` loop-worker processes with the zero-latency model
(``bench.instant_worker``), a tool worker, AckWait and lease TTL at their defaults (30 s).
``--clients`` clients each run sessions of 4 turns, publishing a session's next turn the
moment the last one's ``loop_end`` arrives (as a pipeline, or a person answering, does),
for ``--seconds``. It prints, per run, the turns, their latency p50 and max, and the
turns that took over a second (a hand-over left to AckWait takes 30 s, so a lost
hand-over shows as a turn of about 30 s).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script too

from bench.harness import Ends, Mesh, turn
from loopmesh.aio import run

TURNS_PER_SESSION = 4


async def one_run(args: argparse.Namespace) -> tuple[int, float, float, list[tuple[float, str]]]:
    with tempfile.TemporaryDirectory() as tmp:
        async with Mesh(Path(tmp), ack_wait_s=30, lease_ttl_s=30) as mesh:
            await mesh.tool_worker(ack_wait_s=30)
            for i in range(args.workers):
                await mesh.instant_worker(f"w{i}", 1)
            ends = Ends(mesh.nc)
            await ends.start()
            took: list[tuple[float, str]] = []
            stop = time.monotonic() + args.seconds

            async def client(c: int) -> None:
                k = 0
                while time.monotonic() < stop:
                    for j in range(TURNS_PER_SESSION):
                        turn_id = f"c{c}s{k}t{j}"
                        started = time.monotonic()
                        await ends.run(turn(turn_id, f"c{c}s{k}", "echo 1"), timeout=120)
                        took.append((time.monotonic() - started, turn_id))
                    k += 1

            await asyncio.gather(*(client(c) for c in range(args.clients)))
    took.sort()
    slow = [t for t in took if t[0] > 1.0]
    return len(took), took[len(took) // 2][0], took[-1][0], slow


async def main(args: argparse.Namespace) -> None:
    print(f"{args.workers} loop workers, {args.clients} clients, sessions of "
          f"{TURNS_PER_SESSION} back-to-back turns, {args.seconds:g} s a run:")  # fmt: skip
    for r in range(1, args.runs + 1):
        n, p50, worst, slow = await one_run(args)
        shown = ", ".join(f"{s:.1f} s ({t})" for s, t in slow[-5:])
        print(f"  run {r}: {n} turns, p50 {p50 * 1000:.0f} ms, max {worst * 1000:.0f} ms, "
              f"{len(slow)} over 1 s{': ' + shown if shown else ''}")  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--clients", type=int, default=128)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--runs", type=int, default=3)
    run(main(parser.parse_args()))
