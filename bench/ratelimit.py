"""A fleet against a provider's tokens-per-minute limit, with and without ``[llm.limits]``:
how much of the limit the fleet uses, and how many of its calls are answered 429. The
figures in docs/PERFORMANCE.md ("Fleet-wide LLM rate limits").

    python -m bench.ratelimit [--tpm 40000] [--window-s 60] [--seconds 120]
                              [--warm-up-s 30] [--sessions 64] [--tenants 4]
                              [--workers 4] [--runs pauses,limited] [--today REV]

Everything is a real process: nats-server; ``--workers`` loop workers
(``python -m loop_worker``, the real ``OpenAILLM`` over HTTP); the fake provider
(``bench.llm_server --tpm``: a sliding window of ``--window-s`` that accepts at most
``tpm * window_s / 60`` tokens, each request's usage counted when it arrives, and
answers 429 with ``Retry-After`` past it; replies paced like a small model). This
process is the load: ``--sessions`` sessions, spread over ``--tenants`` tenants (the
first tenant has half of them), each sending its next one-call turn as soon as the
last ended, so the fleet always wants more than the limit allows.

The runs, each on a fresh server and provider:

- ``today`` (only when asked for, with ``--today REV``): the loop workers of another
  commit, exported with ``git archive`` (one before the limiter: each worker retries a 429
  after its ``Retry-After`` by itself);
- ``pauses``: this tree, no ``[llm.limits]``: a 429 pauses the model for every worker;
- ``limited``: this tree, ``[llm.limits]`` set to the provider's limit.

Per run, over ``--seconds`` after ``--warm-up-s`` (a whole number of windows, so the
window's own rhythm does not bias the share): the share of the limit used (tokens the
provider accepted over what it allows in that time), the calls answered 429, turns
finished (and failed, ``llm_failed``) per tenant, and each process's CPU. The limit
is small so that the loop workers are not CPU-bound on a small machine: their CPU
share says so.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import LLMServer, loadavg, machine
from bench.harness import CpuMeter, Ends, Mesh, pid_of, turn
from bench.llm_stream import Pace
from loopmesh.aio import run

ROOT = Path(__file__).resolve().parents[1]
MAX_TOKENS = 64  # [llm] max_tokens: the reply's ceiling in every run


@dataclass
class Outcome:
    run: str
    seconds: float = 0.0
    requests: int = 0
    rejected: int = 0
    accepted: int = 0
    allowed: float = 0.0
    turns: collections.Counter[str] = field(default_factory=collections.Counter)
    failed: collections.Counter[str] = field(default_factory=collections.Counter)
    cpu: CpuMeter | None = None

    @property
    def used(self) -> float:
        return self.accepted / self.allowed if self.allowed else 0.0

    @property
    def answered_429(self) -> float:
        return self.rejected / self.requests if self.requests else 0.0


def tenants(args: argparse.Namespace) -> list[str]:
    """The tenant of each session: the first has half of them, the others share the rest."""
    names = [f"t{i}" for i in range(args.tenants)]
    half = args.sessions // 2 if args.tenants > 1 else args.sessions
    rest = names[1:] or names
    return [names[0]] * half + [rest[i % len(rest)] for i in range(args.sessions - half)]


async def fleet(args: argparse.Namespace, name: str, tree: Path | None) -> Outcome:
    """One run: a fresh server, provider and fleet, loaded, measured."""
    pace = Pace(ttft_s=args.ttft_ms / 1000, tokens_per_s=100.0, tokens=args.tokens)
    limit = ("--tpm", str(args.tpm), "--window-s", f"{args.window_s:g}")
    outcome = Outcome(name)
    with tempfile.TemporaryDirectory(prefix="loopmesh-ratelimit-") as store:
        async with LLMServer(pace, *limit) as llm, Mesh(Path(store), ack_wait_s=30,
                                                        lease_ttl_s=30) as mesh:  # fmt: skip
            env = {
                "LOOPMESH_LLM__MAX_TOKENS": str(MAX_TOKENS),
                "LOOPMESH_LOOP_WORKER__MAX_ACTIVE_TURNS": str(args.sessions),
            }
            if tree is not None:  # another tree's code, first on the path (not the cwd)
                env.update({"PYTHONPATH": str(tree), "PYTHONSAFEPATH": "1"})
            if name == "limited":
                model = {"tpm": args.tpm, "window_s": args.window_s}
                env["LOOPMESH_LLM__LIMITS"] = json.dumps({"models": {"fake-model": model}})
            workers = await asyncio.gather(
                *(mesh.loop_worker_process(llm.base_url, f"w{k}", env)
                  for k in range(1, args.workers + 1))
            )  # fmt: skip
            ends = {t: Ends(mesh.nc, tenant=t) for t in set(tenants(args))}
            for e in ends.values():
                await e.start()
            counting = False
            stop = asyncio.Event()

            async def session(i: int, tenant: str) -> None:
                k = 0
                while not stop.is_set():
                    k += 1
                    t = turn(f"r{i}x{k}", f"s{i}", "echo 0", tenant=tenant)
                    try:
                        end = await ends[tenant].run(t, timeout=args.window_s * 3 + 60)
                    except TimeoutError:
                        continue
                    if counting:
                        outcome.turns[tenant] += 1
                        if end.reason != "task_completion":
                            outcome.failed[tenant] += 1

            pids = {f"loop worker {k}": pid_of(w) for k, w in enumerate(workers, 1)}
            pids.update(mesh.server_pids)
            pids["fake provider"] = llm.proc.pid
            meter = CpuMeter(pids)
            async with asyncio.TaskGroup() as tg:
                sessions = [tg.create_task(session(i, t)) for i, t in enumerate(tenants(args))]
                await asyncio.sleep(args.warm_up_s)
                before = await llm.limited()
                counting, started = True, time.monotonic()
                meter.start()
                await asyncio.sleep(args.seconds)
                meter.stop()
                after = await llm.limited()
                outcome.seconds = time.monotonic() - started
                counting = False
                stop.set()
                for task in sessions:  # those waiting for a turn's end stop waiting
                    task.cancel()
            outcome.requests = after[0] - before[0]
            outcome.rejected = after[1] - before[1]
            outcome.accepted = after[2] - before[2]
            outcome.allowed = args.tpm * outcome.seconds / 60
            outcome.cpu = meter
    return outcome


@contextlib.contextmanager
def exported(rev: str):  # type: ignore[no-untyped-def]
    """The tree of ``rev`` in a temporary directory (``git archive``)."""
    with tempfile.TemporaryDirectory(prefix="loopmesh-today-") as tmp:
        got = subprocess.run(["git", "-C", str(ROOT), "archive", rev], capture_output=True)
        if got.returncode:
            raise SystemExit(
                f"the today run needs commit {rev} (git archive: "
                f"{got.stderr.decode().strip()}): a clone with its history "
                "(git fetch --unshallow), or --runs pauses,limited"
            )
        archive = got.stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        yield Path(tmp)


def report(args: argparse.Namespace, outcomes: list[Outcome]) -> None:
    print(
        f"\nprovider limit {args.tpm:,} tokens/min over a {args.window_s:g} s window; "
        f"{args.workers} loop workers, {args.sessions} sessions over {args.tenants} tenants "
        f"(t0 has half); measured {args.seconds:g} s after {args.warm_up_s:g} s\n"
    )
    print(f"{'run':<9} {'limit used':>10} {'answered 429':>13} {'calls':>7} {'turns':>6} "
          f"{'failed':>7}  turns per tenant")  # fmt: skip
    for o in outcomes:
        per = " ".join(f"{t}:{o.turns[t]}" for t in sorted(o.turns))
        print(
            f"{o.run:<9} {o.used:>10.1%} {o.answered_429:>13.1%} {o.requests:>7} "
            f"{sum(o.turns.values()):>6} {sum(o.failed.values()):>7}  {per}"
        )
    print("\nCPU, share of one core over the measured seconds:")
    for o in outcomes:
        assert o.cpu is not None
        shares = ", ".join(
            f"{name} {seconds / o.cpu.wall:.0%}" for name, seconds in o.cpu.spent.items()
        )
        print(f"  {o.run:<9} {shares}")


async def main(args: argparse.Namespace) -> None:
    print(f"# {machine()}; load {loadavg()}")
    outcomes = []
    for name in args.runs:
        print(f"# run {name}...", flush=True)
        if name == "today":
            with exported(args.today) as tree:
                outcomes.append(await fleet(args, name, tree))
        else:
            outcomes.append(await fleet(args, name, None))
    report(args, outcomes)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.ratelimit",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--tpm", type=int, default=40_000, help="the provider's tokens/min")
    parser.add_argument("--window-s", type=float, default=60.0)
    parser.add_argument("--seconds", type=float, default=120.0, help="measured (whole windows)")
    parser.add_argument("--warm-up-s", type=float, default=30.0)
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--tenants", type=int, default=4)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--ttft-ms", type=float, default=150.0, help="the model's first token")
    parser.add_argument("--tokens", type=int, default=10, help="content tokens per reply")
    parser.add_argument("--runs", type=lambda s: s.split(","), default=["pauses", "limited"])
    parser.add_argument("--today", metavar="REV", help="the commit of the `today` run")
    args = parser.parse_args()
    if "today" in args.runs and args.today is None:
        parser.error("the `today` run needs --today REV (the commit whose workers it runs)")
    return args


if __name__ == "__main__":
    run(main(parse()))
