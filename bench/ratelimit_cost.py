"""What sharing a rate limit through NATS costs at 1,000 calls/s: a token bucket in KV
(revision-checked) against a limiter leader (request/reply over core NATS, what
``loop_worker/limiter.py`` does). docs/PERFORMANCE.md holds its figures, and
docs/ARCHITECTURE.md ("Fleet-wide LLM rate limits") the reasons they back.

    python -m bench.ratelimit_cost [--rate 1000] [--seconds 10] [--clients 4]

An embedded nats-server; ``--clients`` processes (the loop workers) make ``--rate``
calls a second between them, open loop (a call starts every 1/rate s whatever the
others do), each an acquire and then a settle (the correction after the reply: a
tokens-per-minute limit needs both), with limits far above the load, so that nothing
waits and what is measured is the cost of the sharing itself. Three ways:

- ``none``: the call does nothing (the load generator's own cost, subtracted below);
- ``leader``: :class:`loop_worker.limiter.SharedLimiter`, its leader in a process of
  its own (in production it is one of the loop workers): an acquire is one request to
  the leader and its reply, a settle one publish;
- ``kv``: a token bucket in one KV key (requests and tokens, refilled by the time since
  its last write): an acquire reads the key and writes it back with a revision check,
  again on a conflict; a settle does the same to give back what the reply did not use.
  (The design not taken; it lives here only.)

Per way: the calls made and their rate, the time an acquire took (p50, p99), the CPU
per call of the clients (less ``none``'s), of the leader and of nats-server (``/proc``),
and the KV conflicts per call. The clients' own CPU is read by themselves, the others'
by this process, over the same seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
from nats.js.errors import KeyWrongLastSequenceError

from bench.common import loadavg, machine
from bench.harness import cpu_seconds
from loop_worker.engine.settings import LimitSettings, ModelLimits
from loop_worker.limiter import SharedLimiter
from loopmesh.aio import raise_if_cancelled, run
from loopmesh.jetstream import KV, Publisher, open_kv
from loopmesh.nats import connect
from loopmesh.provision import provision
from loopmesh.server import NatsServer
from loopmesh.settings import NatsSettings
from loopmesh.testing.durable import Proc, wait_for
from schemas import Subjects, definitions

S = Subjects()
MODEL = "bench-model"
#: Far above the load: nothing waits, the sharing is what is measured.
LIMITS = LimitSettings(models={MODEL: ModelLimits(rpm=100_000_000, tpm=10**12)})
ESTIMATE, USED = 1_000, 700  # tokens asked for, and used (the settle gives 300 back)
WAYS = ("none", "leader", "kv")
GO = "bench.ratelimit.go"  # when the clients start measuring (Unix time)
GRACE_S = 2.0  # after the load, for the calls still running
MAX_RUNNING = 200  # calls at once per client; past it a call is not started (unfinished)


# -- the KV token bucket (the design not taken) ----------------------------------------------


class Bucket(msgspec.Struct):
    requests: float
    tokens: float
    at: float  # when last written (time.time())


class KVBucket:
    """One model's requests and tokens in one KV key, each change revision-checked."""

    KEY = "bucket.bench-model"

    def __init__(self, kv: KV, rpm: float, tpm: float) -> None:
        self.kv = kv
        self.rpm, self.tpm = rpm, tpm
        self.conflicts = 0

    async def change(self, requests: float, tokens: float) -> None:
        """Take (negative) or give back (positive) requests and tokens."""
        while True:
            raise_if_cancelled()  # nats-py may swallow a cancel (loopmesh/aio.py)
            entry = await self.kv.entry(self.KEY)
            now = time.time()
            if entry is None or entry.value is None:
                b = Bucket(requests=self.rpm, tokens=self.tpm, at=now)
            else:
                b = msgspec.json.decode(entry.value, type=Bucket)
                elapsed = max(now - b.at, 0.0)
                b.requests = min(self.rpm, b.requests + elapsed * self.rpm / 60)
                b.tokens = min(self.tpm, b.tokens + elapsed * self.tpm / 60)
            if b.requests + requests < 0 or b.tokens + tokens < 0:
                await asyncio.sleep(0.01)  # not reached: the limits are far above the load
                continue
            b.requests += requests
            b.tokens += tokens
            b.at = now
            try:
                await self.kv.update(
                    self.KEY, msgspec.json.encode(b), entry.revision if entry else 0
                )
                return
            except KeyWrongLastSequenceError:
                self.conflicts += 1


# -- one client process ---------------------------------------------------------------------


async def client(args: argparse.Namespace) -> None:
    nc = await connect(NatsSettings(url=args.url), name=f"client-{args.index}")
    publisher = Publisher(nc)
    limiter = SharedLimiter(nc, S, LIMITS, name=f"c{args.index}", publisher=publisher)
    bucket: KVBucket | None = None
    if args.way == "leader":
        await limiter.start()  # asks only: this client does not campaign
    elif args.way == "kv":
        bucket = KVBucket(await open_kv(nc.jetstream(), publisher, S.limits_bucket), 1e8, 1e12)
    latencies: list[float] = []
    errors: list[str] = []

    async def call() -> None:
        try:
            await one()
        except Exception as exc:  # a KV read or write that timed out: counted, not raised
            errors.append(repr(exc))

    async def one() -> None:
        started = time.perf_counter()
        if args.way == "leader":
            permit = await limiter.acquire(MODEL, "acme", ESTIMATE)
            latencies.append(time.perf_counter() - started)
            await permit.settle(USED)
        elif bucket is not None:
            await bucket.change(-1, -ESTIMATE)
            latencies.append(time.perf_counter() - started)
            await bucket.change(0, ESTIMATE - USED)
        else:
            latencies.append(time.perf_counter() - started)

    async def load(seconds: float) -> int:
        """Start a call every 1/rate s for ``seconds`` (none while :data:`MAX_RUNNING`
        run); give the calls still running :data:`GRACE_S` more, then cancel them: how
        many were, or were not started (a way that cannot keep up falls behind without
        end)."""
        interval = 1 / args.rate
        running: set[asyncio.Task[None]] = set()
        shed = 0
        next_at, end = time.monotonic(), time.monotonic() + seconds
        while next_at < end:
            if len(running) < MAX_RUNNING:
                task = asyncio.create_task(call())
                running.add(task)
                task.add_done_callback(running.discard)
            else:
                shed += 1
            next_at += interval
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        if running:
            await asyncio.wait(set(running), timeout=GRACE_S)
        late = set(running)
        for task in late:
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)
        return len(late) + shed

    go = await nc.subscribe(GO)
    await nc.flush()
    await load(1.0)  # warm up
    latencies.clear()
    print("ready", flush=True)
    start_at = float((await go.next_msg(timeout=600)).data)
    await asyncio.sleep(max(0.0, start_at - time.time()))
    cpu = time.process_time()
    unfinished = await load(args.seconds)
    cpu = time.process_time() - cpu
    out = {
        "calls": len(latencies),
        "unfinished": unfinished,
        "errors": len(errors),
        "cpu_s": cpu,
        "latencies_ms": [round(x * 1000, 3) for x in latencies],
        "conflicts": bucket.conflicts if bucket is not None else 0,
    }
    print("result " + json.dumps(out), flush=True)
    await nc.drain()


async def leader(args: argparse.Namespace) -> None:
    nc = await connect(NatsSettings(url=args.url), name="leader")
    limiter = SharedLimiter(nc, S, LIMITS, name="leader")
    await limiter.start()
    async with asyncio.TaskGroup() as tg:
        task = tg.create_task(limiter.run())
        await wait_for(lambda: limiter.leader is not None and limiter.leader.leading, timeout=60)
        print("leading", flush=True)
        await asyncio.sleep(args.seconds)
        task.cancel()
    await limiter.close()
    await nc.drain()


# -- the measurement --------------------------------------------------------------------------


async def measure(
    way: str, server: NatsServer, nc: Any, args: argparse.Namespace
) -> dict[str, Any]:
    procs: list[Proc] = []
    base = ["-m", "bench.ratelimit_cost", "--url", server.url, "--way", way]
    pids: dict[str, int] = {"nats-server": server.pid or 0}
    try:
        if way == "leader":
            lead = Proc(*base, "--role", "leader", "--seconds", "3600")
            procs.append(lead)
            await lead.start("leading", timeout=180)
            assert lead.proc is not None
            pids["leader"] = lead.proc.pid
        rate = args.rate / args.clients
        for i in range(args.clients):
            p = Proc(*base, "--role", "client", "--index", str(i), "--rate", f"{rate:g}",
                     "--seconds", f"{args.seconds:g}")  # fmt: skip
            procs.append(p)
            await p.start()
        for p in procs[-args.clients :]:
            await p.wait_line("ready", timeout=180)
        start_at = time.time() + 1.0
        await nc.publish(GO, f"{start_at:.3f}".encode())
        await nc.flush()
        await asyncio.sleep(max(0.0, start_at - time.time()))
        before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        results = [
            json.loads((await p.wait_line("result ", timeout=args.seconds + 60)).split(" ", 1)[1])
            for p in procs[-args.clients :]
        ]
        spent = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
    finally:
        for p in procs:
            await p.close()
    calls = sum(r["calls"] for r in results)
    latencies = sorted(x for r in results for x in r["latencies_ms"])
    return {
        "way": way,
        "calls": calls,
        "rate": calls / args.seconds,
        "p50_ms": statistics.median(latencies) if latencies else math.nan,
        "p99_ms": latencies[int(len(latencies) * 0.99)] if latencies else math.nan,
        "clients_us": sum(r["cpu_s"] for r in results) / max(calls, 1) * 1e6,
        "leader_us": spent.get("leader", 0.0) / max(calls, 1) * 1e6,
        "server_us": spent["nats-server"] / max(calls, 1) * 1e6,
        "conflicts": sum(r["conflicts"] for r in results) / max(calls, 1),
        "unfinished": sum(r["unfinished"] for r in results) + sum(r["errors"] for r in results),
    }


async def main(args: argparse.Namespace) -> None:
    print(f"# {machine()}; load {loadavg()}")
    print(f"# {args.clients} clients, {args.rate:g} calls/s in all, {args.seconds:g} s per way\n")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        async with NatsServer(Path(tmp)) as server:
            nc = await connect(NatsSettings(url=server.url), name="bench")
            await provision(nc.jetstream(), definitions(S))
            for way in args.ways.split(","):
                print(f"# measuring {way}...", flush=True)
                rows.append(await measure(way, server, nc, args))
            await nc.close()
    none = next((r for r in rows if r["way"] == "none"), None)
    base = {k: none[k] if none is not None else 0.0 for k in ("clients_us", "server_us")}
    print(
        f"{'way':<8} {'calls':>7} {'calls/s':>8} {'acquire p50':>12} {'p99':>9} "
        f"{'CPU/call: clients':>18} {'leader':>8} {'nats-server':>12} {'KV conflicts/call':>18} "
        f"{'unfinished':>11}"
    )
    for r in rows:
        clients, server = r["clients_us"], r["server_us"]
        if none is not None and r is not none and r["calls"]:
            clients -= base["clients_us"]  # the load generator's own cost per call
            server -= base["server_us"] * none["calls"] / r["calls"]  # the idle server's
        print(
            f"{r['way']:<8} {r['calls']:>7} {r['rate']:>8.0f} {r['p50_ms']:>10.2f}ms "
            f"{r['p99_ms']:>7.2f}ms {clients:>16.0f}µs {r['leader_us']:>6.0f}µs "
            f"{server:>10.0f}µs {r['conflicts']:>18.2f} {r['unfinished']:>11}"
        )
    print(
        "\n(clients and nats-server: less the `none` row, the load generator's own cost and"
        " the idle server's; per call done;"
        f" unfinished: calls still running {GRACE_S:g} s after the load stopped, cancelled,"
        f" failed, or not started while {MAX_RUNNING} of a client's ran)"
    )


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.ratelimit_cost",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--rate", type=float, default=1000.0, help="calls/s, all clients")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--ways", default=",".join(WAYS))
    # a client's or the leader's process (this module runs them)
    parser.add_argument("--role", choices=("main", "client", "leader"), default="main")
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--way", help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


if __name__ == "__main__":
    ns = parse(sys.argv[1:])
    run({"main": main, "client": client, "leader": leader}[ns.role](ns))
