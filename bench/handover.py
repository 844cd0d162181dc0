"""Back-to-back turns on several loop workers: does a session's next turn ever wait?

    python -m bench.handover [--workers 2] [--clients 128] [--seconds 10] [--runs 3] [--piped]

An embedded nats-server, ``--workers`` loop-worker processes with the zero-latency model
(``bench.instant_worker``), a tool worker, AckWait and lease TTL at 30 s (not the 2 s
defaults: far above a hand-over, so one left to AckWait stands out).
``--clients`` clients each run sessions of 4 turns, publishing a session's next turn the
moment the last one's ``loop_end`` arrives (as a pipeline, or a person answering, does),
for ``--seconds``; with ``--piped``, a session's 4 turns are published at once, each
next one while the one before still runs (a turn's latency is then counted from the
later of its publish and the loop_end of the turn before it). It prints, per run, the
turns, their latency p50, p99 and max, the turns that took over a second (a hand-over
left to AckWait takes 30 s, so a lost hand-over shows as a turn of about 30 s), and the
latency histogram in 100 ms bins: a wait on a timer shows as a cluster of its own at
the timer's period, apart from the body.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script too

from bench.harness import Ends, Mesh, S, turn
from loopmesh.aio import run
from loopmesh.jetstream import acked, settled
from schemas import encode

TURNS_PER_SESSION = 4
BIN_S = 0.1  # the histogram's bins
SLOW_S = 1.0


async def one_run(args: argparse.Namespace) -> list[tuple[float, str]]:
    with tempfile.TemporaryDirectory() as tmp:
        async with Mesh(Path(tmp), ack_wait_s=30, lease_ttl_s=30) as mesh:
            await mesh.tool_worker(ack_wait_s=30)
            for i in range(args.workers):
                await mesh.instant_worker(f"w{i}", 1)
            ends = Ends(mesh.nc)
            await ends.start()
            took: list[tuple[float, str]] = []
            stop = time.monotonic() + args.seconds

            async def back_to_back(c: int, k: int) -> None:
                for j in range(TURNS_PER_SESSION):
                    turn_id = f"c{c}s{k}t{j}"
                    started = time.monotonic()
                    await ends.run(turn(turn_id, f"c{c}s{k}", "echo 1"), timeout=120)
                    took.append((time.monotonic() - started, turn_id))

            async def piped(c: int, k: int) -> None:
                session = f"c{c}s{k}"
                turns = [
                    turn(f"{session}t{j}", session, "echo 1") for j in range(TURNS_PER_SESSION)
                ]
                ended = [ends.expect(t.id) for t in turns]
                started = [0.0] * len(turns)
                for j, t in enumerate(turns):
                    await acked(ends.publisher, S.turn(t.tenant, t.session), encode(t),
                                {"Nats-Msg-Id": t.msg_id})  # fmt: skip
                    started[j] = time.monotonic()
                last = 0.0
                for j, t in enumerate(turns):
                    await settled(ended[j], 120)
                    now = time.monotonic()
                    took.append((now - max(started[j], last), t.id))
                    last = now

            async def client(c: int) -> None:
                k = 0
                while time.monotonic() < stop:
                    await (piped if args.piped else back_to_back)(c, k)
                    k += 1

            await asyncio.gather(*(client(c) for c in range(args.clients)))
    return took


def histogram(took: list[tuple[float, str]]) -> list[str]:
    """One line per 100 ms bin that has turns: its range, its count, a bar."""
    bins = Counter(int(s / BIN_S) for s, _ in took)
    top = max(bins.values())
    return [
        f"    {b * BIN_S:4.1f}-{(b + 1) * BIN_S:4.1f} s {n:7d} {'#' * -(-50 * n // top)}"
        for b, n in sorted(bins.items())
    ]


async def main(args: argparse.Namespace) -> None:
    how = "published at once" if args.piped else "back-to-back"
    print(f"{args.workers} loop workers, {args.clients} clients, sessions of "
          f"{TURNS_PER_SESSION} turns {how}, {args.seconds:g} s a run:")  # fmt: skip
    for r in range(1, args.runs + 1):
        took = sorted(await one_run(args))
        n = len(took)
        slow = [t for t in took if t[0] > SLOW_S]
        shown = ", ".join(f"{s:.1f} s ({t})" for s, t in slow[-5:])
        p50, p99, worst = took[n // 2][0], took[min(n - 1, n * 99 // 100)][0], took[-1][0]
        print(f"  run {r}: {n} turns, p50 {p50 * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms, "
              f"max {worst * 1000:.0f} ms, {len(slow)} over {SLOW_S:g} s"
              f"{': ' + shown if shown else ''}")  # fmt: skip
        print("\n".join(histogram(took)))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--clients", type=int, default=128)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--piped", action="store_true", help="publish a session's turns at once")
    run(main(parser.parse_args()))
