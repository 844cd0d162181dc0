"""Tool round-trip benchmark: request published → result back at the requester.

Measures, in one run and against one nats-server, p50/p99 latency at 1 and at 64 calls
in flight, and throughput at 64 in flight, for:

- ``raw``: core NATS request/reply (the absolute floor);
- ``floor``: a minimal durable round trip in plain nats-py (JetStream work-queue publish
  → pull → KV effect put → core reply → ack), the floor for any design that keeps a
  call when a process dies;
- ``worker``: loopmesh's ToolWorker (schema validation, timeout, effect put, event
  publish, reply, ack; the requests are marked ``first_attempt``, as the loop worker
  marks the calls of a turn's first run, so the worker skips the effect lookup a
  redelivered call makes).

Then the scaling of a 50 ms sleep tool with 64 calls in flight across 1, 2 and 4 worker
processes. Every responder runs in its own process; the requester is the same for all
(it publishes without awaiting the publish ack — a timed-out call is retried under the
same id — and waits for the reply on a wildcard inbox)::

    python bench/tool_roundtrip.py                # embedded nats-server in a temp dir
    python bench/tool_roundtrip.py --calls 5000 --nats-url nats://127.0.0.1:4222
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loopmesh.provision import ensure_consumer, provision  # noqa: E402
from loopmesh.server import NatsServer  # noqa: E402
from schemas import (  # noqa: E402
    Subjects,
    ToolCallRequest,
    ToolResult,
    decode,
    definitions,
    encode,
    new_id,
    pool_consumer,
)
from schemas import call_id as make_call_id  # noqa: E402
from tool_worker import Registry, to_tool, tool  # noqa: E402
from tool_worker.service import ToolWorker  # noqa: E402

S = Subjects()
RAW_SUBJECT = "bench.raw"


@tool
async def echo(text: str) -> str:
    """Return the text."""
    return text


@tool(timeout_s=10)
async def sleep50() -> str:
    """Sleep 50 ms."""
    await asyncio.sleep(0.05)
    return "ok"


@tool(timeout_s=10)
def spin10() -> str:
    """Keep a core busy for 10 ms (CPU time), on the worker's thread pool."""
    until = time.thread_time() + 0.01
    while time.thread_time() < until:
        pass
    return "ok"


# -- responders (each runs in its own process) ------------------------------------------


async def serve_raw(nc: Client, stop: asyncio.Event) -> None:
    async def respond(msg: Msg) -> None:
        await nc.publish(msg.reply, msg.data)

    await nc.subscribe(RAW_SUBJECT, cb=respond)
    await stop.wait()


async def serve_floor(nc: Client, stop: asyncio.Event, concurrency: int = 64) -> None:
    """The minimal durable round trip, in plain nats-py."""
    js = nc.jetstream()
    psub = await js.pull_subscribe_bind(S.pool_consumer("floor"), stream=S.tools_stream)
    kv_prefix = f"$KV.{S.effects_bucket}."

    async def one_at_a_time() -> None:
        while not stop.is_set():
            try:
                (msg,) = await psub.fetch(1, timeout=1.0)
            except TimeoutError:
                continue
            req = decode(msg.data, ToolCallRequest)
            payload = encode(ToolResult(call_id=req.call_id, content=req.arguments["text"]))
            await js.publish(kv_prefix + req.call_id, payload)  # the effect, stored
            assert req.reply_to is not None
            await nc.publish(req.reply_to, payload)
            await msg.ack()

    async with asyncio.TaskGroup() as tg:
        for _ in range(concurrency):
            tg.create_task(one_at_a_time())


async def serve_worker(nc: Client, stop: asyncio.Event, pool: str, concurrency: int) -> None:
    registry = Registry([to_tool(echo), to_tool(sleep50), to_tool(spin10)])
    worker = ToolWorker(nc, registry, pool=pool, concurrency=concurrency, catalog=False)
    await worker.run(stop)


async def serve(args: argparse.Namespace) -> None:
    nc = await nats.connect(args.nats_url)
    stop = asyncio.Event()
    reader = asyncio.create_task(_stop_on_stdin_close(stop))
    try:
        if args.kind == "raw":
            await serve_raw(nc, stop)
        elif args.kind == "floor":
            await serve_floor(nc, stop)
        else:
            await serve_worker(nc, stop, args.pool, args.concurrency)
    finally:
        reader.cancel()
        await nc.drain()


async def _stop_on_stdin_close(stop: asyncio.Event) -> None:
    await asyncio.to_thread(sys.stdin.read)
    stop.set()


class Responder:
    """A ``serve`` subprocess; closing its stdin stops it."""

    def __init__(self, url: str, kind: str, pool: str = "bench", concurrency: int = 64) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "serve", "--nats-url", url, "--kind", kind,
             "--pool", pool, "--concurrency", str(concurrency)],
            stdin=subprocess.PIPE, cwd=ROOT,
        )  # fmt: skip

    def stop(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# -- the requester ------------------------------------------------------------------------


class Requester:
    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self.inbox = nc.new_inbox()
        self.acks = nc.new_inbox()
        self.waiting: dict[str, asyncio.Future[bytes]] = {}
        self.ack_errors = 0
        self.seq = 0
        self.turn = new_id()

    async def start(self) -> None:
        await self.nc.subscribe(self.inbox + ".*", cb=self._on_reply)
        await self.nc.subscribe(self.acks, cb=self._on_ack)

    async def _on_reply(self, msg: Msg) -> None:
        fut = self.waiting.pop(msg.subject[len(self.inbox) + 1 :], None)
        if fut is not None and not fut.done():
            fut.set_result(msg.data)

    async def _on_ack(self, msg: Msg) -> None:
        if b'"error"' in msg.data:
            self.ack_errors += 1

    async def call(self, kind: str, pool: str, tool: str, arguments: dict[str, str]) -> float:
        self.seq += 1
        # as the loop worker makes them (a tool worker refuses any other): a fresh turn
        # per requester keeps them apart from another run's on the same server
        call_id = make_call_id("bench", "s", self.turn, 0, self.seq)
        fut: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self.waiting[call_id] = fut
        reply_to = f"{self.inbox}.{call_id}"
        start = time.perf_counter()
        if kind == "raw":
            await self.nc.publish(RAW_SUBJECT, b"x" * 200, reply=reply_to)
        else:
            req = ToolCallRequest(
                call_id=call_id, tenant="bench", session="s", turn_id=self.turn, server="local",
                tool=tool, arguments=arguments, reply_to=reply_to,
                first_attempt=True,  # as the loop worker marks a turn's first run's calls
            )  # fmt: skip
            await self.nc.publish(
                S.tool(pool, "local", tool), encode(req), reply=self.acks,
                headers={"Nats-Msg-Id": call_id},
            )  # fmt: skip
        async with asyncio.timeout(30):
            await fut
        return time.perf_counter() - start


async def measure(
    req: Requester, kind: str, pool: str, tool: str, in_flight: int, calls: int, *,
    duration_s: float | None = None, arguments: dict[str, str] | None = None,
) -> dict[str, float]:  # fmt: skip
    latencies: list[float] = []
    args = arguments if arguments is not None else {"text": "x" * 100}
    left = calls
    deadline = time.perf_counter() + duration_s if duration_s else None

    async def loop() -> None:
        nonlocal left
        while (left > 0) if deadline is None else (time.perf_counter() < deadline):
            left -= 1
            latencies.append(await req.call(kind, pool, tool, args))

    for _ in range(min(200, calls)):  # warm up
        await req.call(kind, pool, tool, args)
    start = time.perf_counter()
    async with asyncio.TaskGroup() as tg:
        for _ in range(in_flight):
            tg.create_task(loop())
    elapsed = time.perf_counter() - start
    latencies.sort()
    return {
        "p50": statistics.median(latencies) * 1000,
        "p99": latencies[int(len(latencies) * 0.99) - 1] * 1000,
        "rate": len(latencies) / elapsed,
        "n": len(latencies),
    }


def row(name: str, r: dict[str, float]) -> str:
    return (
        f"  {name:<8} p50 {r['p50']:7.3f} ms   p99 {r['p99']:7.3f} ms   "
        f"{r['rate']:8.0f} calls/s  (n={r['n']:.0f})"
    )


async def run(args: argparse.Namespace) -> None:
    nc = await nats.connect(args.nats_url)
    js = nc.jetstream()
    await provision(js, definitions(S))
    for pool in ("floor", "bench", "scale"):
        await ensure_consumer(js, pool_consumer(S, pool))
    req = Requester(nc)
    await req.start()
    # Rounds alternate the three responders so that load from elsewhere on the machine
    # falls on all of them alike; each figure is the median over the rounds.
    rounds: dict[tuple[str, int], list[dict[str, float]]] = {}
    for _ in range(args.rounds):
        for kind, pool in (("raw", ""), ("floor", "floor"), ("worker", "bench")):
            responder = Responder(args.nats_url, kind, pool or "bench")
            try:
                await _wait_serving(req, kind, pool)
                for in_flight, calls in ((1, args.calls // 4), (64, args.calls)):
                    r = await measure(req, kind, pool, "echo", in_flight, calls)
                    rounds.setdefault((kind, in_flight), []).append(r)
            finally:
                responder.stop()
    results = {
        key: {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        for key, runs in rounds.items()
    }
    print(
        "tool round trip (request published -> result at the requester), "
        f"median of {args.rounds} rounds, nats-server {args.nats_url}"
    )
    for in_flight in (1, 64):
        print(f"{in_flight} in flight:")
        for kind in ("raw", "floor", "worker"):
            print(row(kind, results[(kind, in_flight)]))
    w1, f1 = results[("worker", 1)], results[("floor", 1)]
    w64, f64 = results[("worker", 64)], results[("floor", 64)]
    print(f"worker/floor p50, 1 in flight:      {w1['p50'] / f1['p50']:.2f}x (goal <= 1.25x)")
    print(f"worker/floor p50, 64 in flight:     {w64['p50'] / f64['p50']:.2f}x")
    print(f"worker/floor calls/s, 64 in flight: {w64['rate'] / f64['rate']:.0%} (goal >= 80%)")

    c = args.scale_concurrency
    print(f"scaling: 50 ms sleep tool, 64 in flight, each worker runs {c} calls at once")
    for r in await scaling(req, args.nats_url, "sleep50", c, args.scale_s):
        ideal = min(r.workers * c, 64) / 0.05
        print(f"  {r}  ({r.rate / ideal:.0%} of {ideal:.0f}/s if calls cost nothing but the sleep)")
    if req.ack_errors:
        print(f"publish errors: {req.ack_errors}")
    await nc.drain()


@dataclass(frozen=True)
class Scaled:
    workers: int
    rate: float  # calls/s
    p50: float  # ms
    efficiency: float  # rate over workers x the one worker's rate

    def __str__(self) -> str:
        return (
            f"{self.workers} worker(s): {self.rate:5.0f} calls/s  p50 {self.p50:6.1f} ms  "
            f"efficiency {self.efficiency:4.0%} of {self.workers} x 1 worker"
        )


async def scaling(
    req: Requester, url: str, tool_name: str, concurrency: int, seconds: float
) -> list[Scaled]:
    """Calls/s of ``tool_name`` with 64 in flight over 1, 2 and 4 worker processes of
    the ``scale`` pool, each running ``concurrency`` calls at once."""
    out: list[Scaled] = []
    for n in (1, 2, 4):
        workers = [Responder(url, "worker", "scale", concurrency) for _ in range(n)]
        try:
            await _wait_serving(req, "worker", "scale", tool=tool_name)
            await _wait_pulling(req.nc, "scale", n)
            r = await measure(
                req, "worker", "scale", tool_name, 64, 0, duration_s=seconds, arguments={}
            )
        finally:
            for w in workers:
                w.stop()
        base = out[0].rate if out else r["rate"]
        out.append(Scaled(n, r["rate"], r["p50"], r["rate"] / (base * n)))
    return out


async def _wait_pulling(nc: Client, pool: str, workers: int) -> None:
    """Until ``workers`` processes have a pull request waiting on the pool's consumer
    (each idle worker keeps one), so that none joins a run late."""
    js = nc.jetstream()
    async with asyncio.timeout(60):
        while True:
            info = await js.consumer_info(S.tools_stream, S.pool_consumer(pool))
            if info.num_waiting >= workers:
                return
            await asyncio.sleep(0.05)


async def _wait_serving(req: Requester, kind: str, pool: str, tool: str = "echo") -> None:
    """Until one call goes through (the responder process is up)."""
    args: dict[str, str] = {"text": "up"} if tool == "echo" else {}
    async with asyncio.timeout(30):
        while True:
            try:
                async with asyncio.timeout(2):
                    await req.call(kind, pool, tool, args)
                return
            except TimeoutError:
                req.waiting.clear()


async def main(args: argparse.Namespace) -> None:
    if args.nats_url:
        await run(args)
        return
    with tempfile.TemporaryDirectory() as store:
        async with NatsServer(store) as server:
            args.nats_url = server.url
            await run(args)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", nargs="?", default="bench", choices=["bench", "serve"])
    parser.add_argument("--nats-url")
    parser.add_argument("--calls", type=int, default=8000, help="calls at 64 in flight")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--scale-s", type=float, default=4.0, help="seconds per scaling run")
    parser.add_argument("--scale-concurrency", type=int, default=8)
    parser.add_argument("--kind", choices=["raw", "floor", "worker"])
    parser.add_argument("--pool", default="bench")
    parser.add_argument("--concurrency", type=int, default=64)
    return parser.parse_args()


if __name__ == "__main__":
    ns = parse()
    asyncio.run(serve(ns) if ns.command == "serve" else main(ns))
