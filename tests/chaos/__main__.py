"""``python -m tests.chaos [--seeds N | --seed S ...] [--netsplit]``: chaos runs, one
after another; each prints its summary, a failed one its seed and problems. Exit 1 if
any failed. ``--netsplit`` (or ``--partitions``): the network partition runs
(:mod:`.netsplit`), which need root and network namespaces (exit 2 and why, without
them)."""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

from loopmesh.testing.netns import unavailable

from . import netsplit
from .run import run


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__)
    parser.add_argument("--seeds", type=int, default=1, help="run seeds 1..N (default 1)")
    parser.add_argument("--seed", type=int, action="append", help="run this seed (repeatable)")
    parser.add_argument("--turns", type=int, help="turns per run (default 50; 40 with --netsplit)")
    parser.add_argument(
        "--netsplit",
        "--partitions",
        action="store_true",
        help="cut the network instead of killing processes",
    )
    parser.add_argument("--keep", type=Path, help="run under this directory and keep it")
    parser.add_argument(
        "--turn-partitions", type=int, default=1, metavar="N",
        help="the turns over N streams ([nats] turn_partitions; not with --netsplit)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.netsplit and args.turn_partitions != 1:
        parser.error("--turn-partitions is for the kill runs, not --netsplit")
    seeds = args.seed or list(range(1, args.seeds + 1))
    if args.netsplit and (why := unavailable()):
        print(f"no partition runs here: {why}", file=sys.stderr)
        return 2
    runner = netsplit.run if args.netsplit else run
    more: dict[str, int] = {"turns": args.turns} if args.turns else {}
    if args.turn_partitions != 1:
        more["turn_partitions"] = args.turn_partitions
    failed = 0
    for n, seed in enumerate(seeds):
        with tempfile.TemporaryDirectory(prefix=f"chaos-{seed}-") as tmp:
            again = f"-run{n + 1}" if seeds.count(seed) > 1 else ""  # --seed 1 --seed 1
            root = args.keep / f"seed-{seed}{again}" if args.keep else Path(tmp)
            outcome = asyncio.run(
                runner(seed, root, say=lambda line: print(line, flush=True), **more)
            )
        print(outcome.report(), flush=True)
        failed += not outcome.verdict.ok
    print(f"{len(seeds) - failed} of {len(seeds)} seeds passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
