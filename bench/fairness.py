"""Fair share across tenants: one tenant floods the fleet, and the others should not notice.

    python -m bench.fairness [--configs r1x1,r1x2,r1x4,r3x1,r3x2,r3x4] [--quick]
                             [--max-active 16] [--flood-x 10] [--flood-s 15]
                             [--tenant-max-active N] [--alone-s 10] [--every-s 0.5]
                             [--back-to-back 2] [--ttft-ms 150] [--tokens 6]
                             [--tokens-per-s 50] [--turn-timeout-s 300]

Everything is a real process on the machine it runs on: nats-server (R1), or a cluster of three
with every stream and bucket on three replicas (R3); 1, 2 or 4 loop workers (``python -m
loop_worker``: the real ``OpenAILLM`` over HTTP), each running at most ``--max-active``
turns at once (``[loop_worker] max_active_turns``; ``--tenant-max-active`` sets
``tenant_max_active``); and the fake LLM (``bench.llm_server``), which streams each
reply at a model's pace: a first token after ``--ttft-ms``, then ``--tokens-per-s``,
``--tokens`` in all (250 ms a reply by default), then a call of ``task_completion``, so a
turn is one reply. A configuration is ``r1x2``: R1, 2 loop workers.

This process is the tenants. It publishes turns on ``loopmesh.turns.<tenant>.<session>``
and hears their ``loop_end`` events; a turn's latency runs from its publish to its
``loop_end``. How the workers choose which turn to run next is theirs: nothing here
assumes an order.

- A floods: ``--flood-x`` times the fleet's turn slots (loop workers x ``--max-active``)
  published at once, each turn in a session of its own; for ``--flood-s`` after, each of
  its turns that ends is replaced by a new one, so that the flood stays that deep.
- B and C are interactive: each publishes a turn every ``--every-s`` (each in a new
  session, as many users would) and runs ``--back-to-back`` sessions whose next turn is
  published the moment the last one's ``loop_end`` arrives.

The runs of a configuration: B and C alone for ``--alone-s``; A's flood alone and the
same flood spread over 8 tenants (the fleet's throughput, whoever floods), twice each,
alternated, the best of each kept; A's flood again, with B and C running from the moment
its first turns are all published until its last ``loop_end``. Then a table per
configuration, the goals and a verdict on each:

- under the flood, B's and C's p50 latency is at most 1.5 times their p50 alone, and
  their p99 at most 3 times their p99 alone;
- A alone gets at least 90% of the fleet's throughput (a fair share holds back no
  tenant that is alone);
- no turn of B or C is more than 1 s over the model's time (the time the fake LLM took
  to stream its reply), alone or under the flood.

A's own turns wait by design (its flood is many times the slots): its latency is shown,
not judged. ``--quick`` runs R1 with 2 loop workers and shorter runs (about a minute on
2 cores). A run that fails says why and exits 1; goals not met are verdicts, not a
failure.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from bench.common import LLMServer, bench_main, loadavg
from bench.harness import Ends, Mesh, production_mesh, turn
from bench.llm_stream import Pace
from bench.load.figures import STALL_S, pct
from loopmesh.jetstream import settled
from schemas.events import LoopEnd

FLOODER, OTHERS = "A", ("B", "C")
FLEET = [f"F{k}" for k in range(8)]  # the flood spread over tenants: the fleet's throughput
WARM_UP_TURNS = 4  # per loop worker, before each configuration, not measured
#: A's flood alone and the fleet's, alternated, each this many times; the best of each
#: counts, so that a load passing on the machine does not decide the verdict.
THROUGHPUT_RUNS = 2
#: The goals: B's and C's latency under the flood over alone, at p50 and p99; A's share
#: of the fleet's throughput when it is alone.
P50_X, P99_X, ALONE_SHARE = 1.5, 3.0, 0.9


@dataclass(frozen=True)
class Config:
    servers: str  # "r1" or "r3"
    workers: int

    @property
    def label(self) -> str:
        return f"{self.servers.upper()}, {self.workers} loop worker{'s' * (self.workers > 1)}"


@dataclass
class Turned:
    """One turn as its tenant saw it."""

    tenant: str
    turn_id: str
    started: float  # perf_counter at its publish
    ended: float  # at its loop_end's arrival
    reason: str
    model_s: float = 0.0  # what the fake LLM took to stream its reply

    @property
    def latency_s(self) -> float:
        return self.ended - self.started

    @property
    def over_s(self) -> float:
        return self.latency_s - self.model_s


@dataclass
class Run:
    """The turns of one run."""

    turns: list[Turned] = field(default_factory=list)

    def of(self, *tenants: str) -> list[Turned]:
        return [t for t in self.turns if t.tenant in tenants]

    def latency(self, tenant: str) -> list[float]:
        return [t.latency_s for t in self.of(tenant)]

    def stalls(self, *tenants: str) -> int:
        """Turns more than ``STALL_S`` over the model's time."""
        return sum(1 for t in self.of(*tenants) if t.over_s > STALL_S)

    def throughput(self, *tenants: str) -> float:
        """Turns/s from the first one's publish to the last one's loop_end."""
        turns = self.of(*tenants)
        if not turns:
            return 0.0
        wall = max(t.ended for t in turns) - min(t.started for t in turns)
        return len(turns) / wall if wall > 0 else 0.0


class Tenants:
    """The load generator of one run: every turn it publishes lands in ``run``."""

    def __init__(self, ends: Ends, args: argparse.Namespace, tag: str) -> None:
        self.ends, self.args, self.tag = ends, args, tag
        self.run = Run()
        self.ids = 0

    async def turn(self, tenant: str, session: str) -> None:
        """Publish one turn and wait for its loop_end."""
        await self.ended(await self.publish(tenant, session))

    async def publish(self, tenant: str, session: str) -> Published:
        """Publish a turn of ``tenant`` in ``session`` (its ack awaited)."""
        self.ids += 1
        turn_id = f"{self.tag}n{self.ids}"
        t = turn(turn_id, f"{self.tag}{session}", f"bench-turn={turn_id}\necho 0", tenant)
        started = time.perf_counter()
        return Published(tenant, turn_id, started, await self.ends.publish(t))

    async def ended(self, p: Published) -> None:
        """Wait for the loop_end of ``p`` and note the turn."""
        timeout = self.args.turn_timeout_s
        try:
            end = await settled(p.end, timeout)
        except TimeoutError:
            why = f"turn {p.turn_id} had no loop_end within {timeout:g} s"
            raise RuntimeError(why) from None
        self.run.turns.append(
            Turned(p.tenant, p.turn_id, p.started, time.perf_counter(), end.reason)
        )

    async def flood(self, n: int, tenants: Sequence[str], published: asyncio.Event) -> None:
        """``n`` turns round the ``tenants``, published at once (``published`` is set
        when every one is acked), each in a session of its own; for ``--flood-s`` after,
        each that ends is replaced by another, so that ``n`` wait or run all along."""
        ids = itertools.count()

        def session() -> tuple[str, str]:
            k = next(ids)
            return tenants[k % len(tenants)], f"f{k}"

        sent = await asyncio.gather(*(self.publish(*session()) for _ in range(n)))
        published.set()
        until = time.perf_counter() + self.args.flood_s

        async def keep(p: Published) -> None:
            await self.ended(p)
            while time.perf_counter() < until:
                await self.ended(await self.publish(*session()))

        await asyncio.gather(*(keep(p) for p in sent))

    async def interactive(self, stop: asyncio.Event) -> None:
        """B and C until ``stop``: a turn every ``--every-s`` each, and their sessions of
        back-to-back turns; then their last turns to their loop_ends."""
        async with asyncio.TaskGroup() as tg:
            for tenant in OTHERS:
                tg.create_task(self._every(tenant, stop, tg))
                for s in range(self.args.back_to_back):
                    tg.create_task(self._back_to_back(tenant, f"{tenant}b{s}", stop))

    async def _every(self, tenant: str, stop: asyncio.Event, tg: asyncio.TaskGroup) -> None:
        k = 0
        while not stop.is_set():
            tg.create_task(self.turn(tenant, f"{tenant}i{k}"))
            k += 1
            with contextlib.suppress(TimeoutError):  # the load's pace, not a wait on it
                await asyncio.wait_for(stop.wait(), self.args.every_s)

    async def _back_to_back(self, tenant: str, session: str, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.turn(tenant, session)


@dataclass(frozen=True)
class Published:
    """A turn published, waiting for its loop_end."""

    tenant: str
    turn_id: str
    started: float
    end: asyncio.Future[LoopEnd]


@dataclass
class Result:
    """One configuration's runs."""

    config: Config
    alone: Run  # B and C without the flood
    flood: Run  # A alone
    fleet: Run  # the flood spread over FLEET
    shared: Run  # A's flood with B and C

    def ratio(self, tenant: str, q: float) -> float:
        return pct(self.shared.latency(tenant), q) / pct(self.alone.latency(tenant), q)

    def goals(self) -> list[tuple[str, str, bool]]:
        """(goal, figures, met) for each goal."""
        p50 = {t: self.ratio(t, 0.5) for t in OTHERS}
        p99 = {t: self.ratio(t, 0.99) for t in OTHERS}
        share = self.flood.throughput(FLOODER) / self.fleet.throughput(*FLEET)
        alone, shared = self.alone.stalls(*OTHERS), self.shared.stalls(*OTHERS)
        return [
            (f"B's and C's p50 under the flood <= {P50_X:g}x alone",
             ", ".join(f"{t} {x:.1f}x" for t, x in p50.items()), max(p50.values()) <= P50_X),
            (f"B's and C's p99 under the flood <= {P99_X:g}x alone",
             ", ".join(f"{t} {x:.1f}x" for t, x in p99.items()), max(p99.values()) <= P99_X),
            (f"A alone >= {ALONE_SHARE:.0%} of the fleet's throughput",
             f"{share:.0%}", share >= ALONE_SHARE),
            (f"no turn of B or C > {STALL_S:g} s over the model's time",
             f"alone {alone}, under the flood {shared}", alone + shared == 0),
        ]  # fmt: skip


class Bench:
    """One server set-up (R1 or R3) and its loop workers, added as asked."""

    def __init__(self, args: argparse.Namespace, llm: LLMServer, mesh: Mesh) -> None:
        self.args, self.llm, self.mesh = args, llm, mesh
        self.workers = 0
        self.runs = 0

    async def start(self) -> None:
        self.ends = Ends(self.mesh.nc, tenant="*")
        await self.ends.start()

    async def scale_to(self, n: int) -> None:
        env = {"LOOPMESH_LOOP_WORKER__MAX_ACTIVE_TURNS": str(self.args.max_active)}
        if self.args.tenant_max_active is not None:
            env["LOOPMESH_LOOP_WORKER__TENANT_MAX_ACTIVE"] = str(self.args.tenant_max_active)
        await asyncio.gather(*(
            self.mesh.loop_worker_process(self.llm.base_url, f"w{k}", env)
            for k in range(self.workers + 1, n + 1)
        ))  # fmt: skip
        self.workers = max(self.workers, n)

    def tenants(self) -> Tenants:
        self.runs += 1
        return Tenants(self.ends, self.args, f"r{self.runs}")

    async def measure(self, config: Config) -> Result:
        """A warm-up, then the configuration's runs."""
        args = self.args
        n = flood_turns(args, config)
        warm = self.tenants()
        await asyncio.gather(*(
            warm.turn(tenant, f"w{k}")
            for k in range(WARM_UP_TURNS * self.workers) for tenant in (FLOODER, *OTHERS)
        ))  # fmt: skip
        await self.llm.turns()  # forget the warm-up's

        alone, stop = self.tenants(), asyncio.Event()
        asyncio.get_running_loop().call_later(args.alone_s, stop.set)
        await alone.interactive(stop)
        floods: list[Tenants] = []
        fleets: list[Tenants] = []
        for _ in range(THROUGHPUT_RUNS):
            floods.append(await self.flood(n, [FLOODER]))
            fleets.append(await self.flood(n, FLEET))
        shared, published, stop = self.tenants(), asyncio.Event(), asyncio.Event()
        async with asyncio.TaskGroup() as tg:
            flooding = tg.create_task(shared.flood(n, [FLOODER], published))
            flooding.add_done_callback(lambda _: stop.set())
            await published.wait()
            tg.create_task(shared.interactive(stop))

        streamed = await self.llm.turns()
        for t in (t for r in (alone, *floods, *fleets, shared) for t in r.run.turns):
            if t.turn_id not in streamed:
                raise RuntimeError(f"the fake LLM streamed nothing for turn {t.turn_id}")
            if t.reason != "task_completion":
                raise RuntimeError(f"turn {t.turn_id} ended by {t.reason}, not completion")
            t.model_s = streamed[t.turn_id].model_s
        flood = max((r.run for r in floods), key=lambda r: r.throughput(FLOODER))
        fleet = max((r.run for r in fleets), key=lambda r: r.throughput(*FLEET))
        return Result(config, alone.run, flood, fleet, shared.run)

    async def flood(self, n: int, tenants: Sequence[str]) -> Tenants:
        """A run of a flood of ``n`` turns over ``tenants``, alone."""
        run = self.tenants()
        await run.flood(n, tenants, asyncio.Event())
        return run


def flood_turns(args: argparse.Namespace, config: Config) -> int:
    """``--flood-x`` times the fleet's turn slots."""
    return args.flood_x * args.max_active * config.workers  # type: ignore[no-any-return]


# -- what is printed ------------------------------------------------------------------


def ms(values: Sequence[float]) -> str:
    return " / ".join(f"{pct(values, q) * 1000:.0f}" for q in (0.5, 0.99, 1.0))


def report(r: Result, a: argparse.Namespace) -> str:
    """The block of one configuration (``a``: the bench's arguments): its table, A's
    throughput, the goals."""
    limit = "unset" if a.tenant_max_active is None else a.tenant_max_active
    lines = [
        f"\n== {r.config.label}: {a.max_active * r.config.workers} turn slots "
        f"(max_active_turns {a.max_active} each, tenant_max_active {limit}) ==",
        f"A floods {flood_turns(a, r.config)} turns at once, each that ends replaced for "
        f"{a.flood_s:g} s; B and C each: a turn every {a.every_s:g} s and "
        f"{a.back_to_back} session{'s' * (a.back_to_back != 1)} of back-to-back turns; "
        f"the model {a.pace.nominal_s * 1000:.0f} ms a reply",
        "| tenant | turns alone / under the flood | latency alone p50 / p99 / max ms "
        f"| under the flood p50 / p99 / max ms | p50 x | p99 x | turns > {STALL_S:g} s over "
        "the model's time, alone / under the flood |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for tenant, run in [(t, r.alone) for t in OTHERS] + [(FLOODER, r.flood)]:
        name = f"{tenant} (floods)" if tenant == FLOODER else tenant
        before, under = run.latency(tenant), r.shared.latency(tenant)
        lines.append(
            f"| {name} | {len(before)} / {len(under)} | {ms(before)} | {ms(under)} | "
            f"{pct(under, 0.5) / pct(before, 0.5):.1f} | "
            f"{pct(under, 0.99) / pct(before, 0.99):.1f} | "
            f"{run.stalls(tenant)} / {r.shared.stalls(tenant)} |"
        )
    alone, shared = r.flood.throughput(FLOODER), r.shared.throughput(FLOODER)
    lines.append(
        f"A's throughput: alone {alone:.1f} turns/s, beside B and C {shared:.1f} turns/s "
        f"({shared / alone:.0%} of alone); the fleet's (the flood over {len(FLEET)} "
        f"tenants) {r.fleet.throughput(*FLEET):.1f} turns/s"
    )
    lines += [f"goal: {goal:52s} {figures:28s} {verdict(met)}" for goal, figures, met in r.goals()]
    return "\n".join(lines)


def verdict(met: bool) -> str:
    return "PASS" if met else "FAIL"


def table(results: Sequence[Result]) -> str:
    """One row per configuration: its figures against the goals."""
    rows = [
        "| servers | loop workers | B, C p50 x | B, C p99 x | A alone / fleet | "
        "A beside B and C / alone | B, C turns > 1 s over | goals met |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        goals = r.goals()
        rows.append(
            f"| {r.config.servers.upper()} | {r.config.workers} | {goals[0][1]} | "
            f"{goals[1][1]} | {goals[2][1]} | "
            f"{r.shared.throughput(FLOODER) / r.flood.throughput(FLOODER):.0%} | "
            f"{goals[3][1]} | {sum(met for _, _, met in goals)} of {len(goals)} |"
        )
    return "\n".join(rows)


# -- the command ----------------------------------------------------------------------


async def run(args: argparse.Namespace) -> list[Result]:
    results: list[Result] = []
    async with LLMServer(args.pace) as llm:
        for servers in ("r1", "r3"):
            configs = sorted((c for c in args.configs if c.servers == servers),
                             key=lambda c: c.workers)  # fmt: skip
            if not configs:
                continue
            async with production_mesh(servers, "loopmesh-fairness-") as mesh:
                bench = Bench(args, llm, mesh)
                await bench.start()
                for config in configs:
                    await bench.scale_to(config.workers)
                    result = await bench.measure(config)
                    print(report(result, args), flush=True)
                    results.append(result)
    return results


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.fairness", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip

    def configs(text: str) -> list[Config]:
        out = []
        for word in (w.strip() for w in text.split(",") if w.strip()):
            servers, x, workers = word.lower().partition("x")
            if servers not in ("r1", "r3") or not x or not workers.isdigit() or workers == "0":
                raise argparse.ArgumentTypeError(f"r1xN or r3xN (N loop workers), not {word!r}")
            out.append(Config(servers, int(workers)))
        return out

    def slots(text: str) -> int:
        if not text.isdigit() or int(text) < 1:
            raise argparse.ArgumentTypeError(f"a whole number above 0, not {text!r}")
        return int(text)

    def pace(text: str) -> float:
        if float(text) <= 0:
            raise argparse.ArgumentTypeError(f"seconds above 0, not {text!r}")
        return float(text)

    p.add_argument("--configs", type=configs, help="default r1x1,r1x2,r1x4,r3x1,r3x2,r3x4; "
                   "with --quick r1x2")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="R1 x 2 loop workers, short runs")
    p.add_argument("--max-active", type=slots, default=16, help="each loop worker's turn slots")
    p.add_argument("--flood-x", type=slots, default=10, help="A's flood: this times the slots")
    p.add_argument("--flood-s", type=float, help="A keeps it up this long (default 15; quick 8)")
    p.add_argument("--tenant-max-active", type=int, help="the loop workers' tenant_max_active")
    p.add_argument("--alone-s", type=float, help="B and C alone this long (default 10; quick 6)")
    p.add_argument("--every-s", type=pace, default=0.5, help="B's and C's interactive pace")
    p.add_argument("--back-to-back", type=int, default=2, help="sessions each of B and C")
    p.add_argument("--ttft-ms", type=float, default=150.0, help="time to first token")
    p.add_argument("--tokens-per-s", type=float, default=50.0)
    p.add_argument("--tokens", type=int, default=6, help="content tokens per reply")
    p.add_argument("--turn-timeout-s", type=float, default=300.0)
    return p


def main() -> None:
    args = parser().parse_args()
    if args.configs is None:
        args.configs = (
            parser()
            .parse_args(["--configs", "r1x2" if args.quick else "r1x1,r1x2,r1x4,r3x1,r3x2,r3x4"])
            .configs
        )
    if args.alone_s is None:
        args.alone_s = 6.0 if args.quick else 10.0
    if args.flood_s is None:
        args.flood_s = 8.0 if args.quick else 15.0
    args.pace = Pace(ttft_s=args.ttft_ms / 1000, tokens_per_s=args.tokens_per_s,
                     tokens=args.tokens)  # fmt: skip
    results, seconds = bench_main("bench.fairness", run(args))
    print(f"\n{len(results)} configurations in {seconds:.0f} s; load average "
          f"after: {loadavg()}\n\n{table(results)}")  # fmt: skip


if __name__ == "__main__":
    main()
