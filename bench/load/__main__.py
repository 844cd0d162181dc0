"""loopmesh under the load its users put on it.

    python -m bench.load [--workers 1,2] [--servers r1,r3] [--loads back-to-back,think]
                         [--sessions 8] [--turns 100] [--turns-per-session 4]
                         [--think-s 1] [--echo 1] [--watched 4]
                         [--ttft-ms 200] [--tokens-per-s 50] [--tokens 20]
                         [--set LOOPMESH_LOOP__FIELD=VALUE ...] [--json PATH] [--chart PNG]

Everything is a real process on the machine it runs on: nats-server (R1), or a cluster of three
with every stream and bucket on three replicas (R3: ``loopmesh.cluster.NatsCluster``);
one tool worker (``bench.tools`` echo); ``loopmesh gateway`` (no auth, loopback); 1, 2,
4… loop workers (``python -m loop_worker``: the real ``OpenAILLM`` over HTTP), AckWait
and lease TTL at their defaults (2 s); and the fake LLM
(``bench.llm_server``, paced: a first token after ``--ttft-ms``, then ``--tokens-per-s``,
one token per chunk, ``--tokens`` per reply, then a tool call). This process is the load
generator (``bench/load/clients.py``): ``--sessions`` clients at once running
``--turns`` turns in all, in sessions of ``--turns-per-session`` turns of ``--echo`` echo
calls each, back to back or with ``--think-s`` between turns, and SSE clients of the
gateway on the sessions of the first ``--watched`` clients (``bench/load/watch.py``).

Per configuration (servers x loop workers x load) it prints turns/s; turn latency over
the model's own time (the latency minus the time the fake took to stream that turn's
replies, as the fake measured it); the turns more than 1 s over it (stalls); the added
latency per token from the model's emit to an SSE client's receipt; CPU per turn and per
streamed token of every process (``/proc``; the fake LLM's too, apart); and the messages
and bytes each stream and bucket stored per turn. Then one table of them all.

A loop worker's settings can be changed with ``--set`` (say
``--set LOOPMESH_LOOP__STREAM_FLUSH_MS=50``). On a bigger machine: ``--workers 1,2,4,8``,
more ``--sessions`` (each loop worker runs up to 256 turns at once by default; the bench
raises that to ``--sessions``) and ``--turns``. A run that fails says why and exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from collections.abc import Callable
from pathlib import Path

import httpx

from bench.common import LLMServer, bench_main, loadavg
from bench.harness import QUIET_S, CpuMeter, Ends, Mesh, pid_of, production_mesh
from bench.llm_stream import Pace
from bench.load.clients import TENANT, Load, Shape
from bench.load.figures import Result, chart, report, stored, table
from bench.load.watch import Watch
from bench.sse import unlimited
from loopmesh.testing.durable import Proc

WARM_UP_TURNS = 4  # per loop worker, before each configuration, not measured


class Bench:
    """One server set-up (R1 or R3) with its services; loop workers added as asked."""

    def __init__(self, args: argparse.Namespace, llm: LLMServer, mesh: Mesh) -> None:
        self.args, self.llm, self.mesh = args, llm, mesh
        self.servers = "R3" if mesh.cluster is not None else "R1"
        self.workers: list[Proc] = []
        self.runs = 0
        self.http: httpx.AsyncClient | None = None

    async def start(self) -> None:
        self.tools = await self.mesh.tool_worker(concurrency=512, ack_wait_s=QUIET_S)
        self.gateway, self.url = await self.mesh.gateway(unlimited(self.args.watched + 16))
        self.http = httpx.AsyncClient(base_url=self.url, timeout=30)
        self.ends = Ends(self.mesh.nc, tenant=TENANT)
        await self.ends.start()

    async def close(self) -> None:
        if self.http is not None:
            await self.http.aclose()

    def watch(self) -> Watch:
        assert self.http is not None
        return Watch(self.url, self.http)

    async def scale_to(self, n: int) -> None:
        env = {"LOOPMESH_LOOP_WORKER__MAX_ACTIVE_TURNS": str(max(256, self.args.sessions))}
        env.update(self.args.set)
        new = range(len(self.workers) + 1, n + 1)
        self.workers += await asyncio.gather(
            *(self.mesh.loop_worker_process(self.llm.base_url, f"w{k}", env) for k in new)
        )

    def meter(self) -> CpuMeter:
        pids = {f"loop worker {k}": pid_of(w) for k, w in enumerate(self.workers, 1)}
        pids.update(self.mesh.server_pids)
        pids.update({
            "tool worker": pid_of(self.tools), "gateway": pid_of(self.gateway),
            "fake LLM (not loopmesh)": self.llm.proc.pid,
            "load generator + SSE clients": os.getpid(),
        })  # fmt: skip
        return CpuMeter(pids)

    def load(self, shape: Shape, watch: Watch) -> Load:
        self.runs += 1
        return Load(
            ends=self.ends,
            watch=watch,
            shape=shape,
            tag=f"r{self.runs}",
            stagger_s=self.nominal_s(shape),
            timeout_s=self.args.turn_timeout_s,
        )

    def nominal_s(self, shape: Shape) -> float:
        return (shape.echo + 1) * self.llm.pace.nominal_s

    async def measure(self, shape: Shape) -> Result:
        """One configuration: a warm-up, then the load, metered."""
        a = self.args
        result = Result(self.servers, len(self.workers), shape.name, shape.sessions, a.per_session)
        warm = Shape(sessions=WARM_UP_TURNS * len(self.workers), per_session=1,
                     turns=WARM_UP_TURNS * len(self.workers), echo=shape.echo)  # fmt: skip
        await self.load(warm, self.watch()).run()
        await self.llm.turns()  # forget the warm-up's
        watch = self.watch()
        load = self.load(shape, watch)
        js = self.mesh.nc.jetstream()
        result.before = await stored(js)
        meter = self.meter()
        tokens = await self.llm.tokens()
        meter.start()
        result.wall_s = await load.run()
        meter.stop()
        result.tokens = await self.llm.tokens() - tokens
        result.cpu = meter
        result.after = await stored(js)
        streamed = await self.llm.turns()
        missing = [t.turn_id for t in load.done if t.turn_id not in streamed]
        if missing:
            raise RuntimeError(f"the fake LLM streamed nothing for turns {missing[:5]}")
        result.turns = len(load.done)
        result.latency_s = [t.latency_s for t in load.done]
        result.model_s = [streamed[t.turn_id].model_s for t in load.done]
        result.nominal_s = self.nominal_s(shape)
        result.reasons.update(t.reason for t in load.done)
        result.token_ms = watch.latency_ms
        result.watched, result.retracts = watch.sessions, watch.retracts
        result.watching = shape.watched
        seen = [t.turn_id for t in load.done if t.watched]
        result.sent = (
            sum(streamed[t].tokens for t in seen),
            sum(streamed[t].chars for t in seen),
        )
        result.received = (sum(watch.tokens[t] for t in seen), sum(watch.chars[t] for t in seen))
        return result


def shapes(args: argparse.Namespace) -> list[Shape]:
    return [
        Shape(
            sessions=args.sessions,
            per_session=args.per_session,
            turns=args.turns,
            think_s=args.think_s if name == "think" else 0.0,
            echo=args.echo,
            watched=min(args.watched, args.sessions),
        )
        for name in args.loads
    ]


async def run(args: argparse.Namespace) -> list[Result]:
    pace = Pace(ttft_s=args.ttft_ms / 1000, tokens_per_s=args.tokens_per_s, tokens=args.tokens)
    about = (
        f"{args.echo + 1} replies x ({args.ttft_ms:g} ms + {max(0, args.tokens - 1)} "
        f"tokens / {args.tokens_per_s:g} tok/s)"
    )
    results: list[Result] = []
    async with LLMServer(pace) as llm:
        for servers in args.servers:
            async with production_mesh(servers, "loopmesh-load-") as mesh:
                bench = Bench(args, llm, mesh)
                try:
                    await bench.start()
                    for n in args.workers:
                        await bench.scale_to(n)
                        for shape in shapes(args):
                            result = await bench.measure(shape)
                            print(report(result, about), flush=True)
                            results.append(result)
                finally:
                    await bench.close()
    return results


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.load", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip

    def numbers(text: str) -> list[int]:
        return sorted({int(x) for x in text.split(",")})

    def among(*allowed: str) -> Callable[[str], list[str]]:
        def words(text: str) -> list[str]:
            out = [w.strip() for w in text.split(",") if w.strip()]
            for w in out:
                if w not in allowed:
                    raise argparse.ArgumentTypeError(f"{' or '.join(allowed)}, not {w!r}")
            return out

        return words

    def setting(text: str) -> tuple[str, str]:
        key, eq, value = text.partition("=")
        if not eq or not key.startswith("LOOPMESH_"):
            raise argparse.ArgumentTypeError(f"LOOPMESH_...=VALUE, not {text!r}")
        return key, value

    cores = os.cpu_count() or 1
    default_workers = ",".join(str(2**k) for k in range(cores.bit_length()) if 2**k <= cores)
    p.add_argument(
        "--workers",
        type=numbers,
        default=numbers(default_workers),
        help=f"loop-worker processes per run (default here: {default_workers})",
    )
    loads = ["back-to-back", "think"]
    p.add_argument("--servers", type=among("r1", "r3"), default=["r1", "r3"], help="r1,r3")
    p.add_argument("--loads", type=among(*loads), default=loads, help=",".join(loads))
    p.add_argument("--sessions", type=int, default=8, help="clients at once")
    p.add_argument("--turns", type=int, default=100, help="turns per configuration")
    p.add_argument("--turns-per-session", dest="per_session", type=int, default=4)
    p.add_argument("--think-s", type=float, default=1.0, help="the think load's pause")
    p.add_argument("--echo", type=int, default=1, help="echo calls per turn")
    p.add_argument("--watched", type=int, default=4, help="clients watched over SSE")
    p.add_argument("--ttft-ms", type=float, default=200.0, help="time to first token")
    p.add_argument("--tokens-per-s", type=float, default=50.0)
    p.add_argument("--tokens", type=int, default=20, help="content tokens per reply")
    p.add_argument("--turn-timeout-s", type=float, default=120.0)
    p.add_argument(
        "--set",
        type=setting,
        action="append",
        default=[],
        metavar="LOOPMESH_X=V",
        help="a setting of the loop workers, as a variable (repeatable)",
    )
    p.add_argument("--json", type=Path, help="write every configuration's figures")
    p.add_argument("--chart", type=Path, help="draw them (needs matplotlib)")
    return p


def main() -> None:
    args = parser().parse_args()
    results, seconds = bench_main("bench.load", run(args))
    print(f"\n{len(results)} configurations in {seconds:.0f} s; load average "
          f"after: {loadavg()}\n\n{table(results)}")  # fmt: skip
    summaries = [r.summary() for r in results]
    if args.json:
        args.json.write_text(json.dumps(summaries, indent=1))
    if args.chart and not chart(summaries, args.chart):
        print("no chart: matplotlib is not installed (pip install matplotlib)")


if __name__ == "__main__":
    main()
