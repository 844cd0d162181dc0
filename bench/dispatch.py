"""Tool dispatch beside its peers: one echo call's round trip (request sent → result
back at the caller), p50/p99 at 1 and 64 in flight, each responder in its own process.

- raw nats-py request/reply, the hand-written durable floor and loopmesh's ToolWorker:
  ``bench/tool_roundtrip.py``'s responders and requester, on an embedded nats-server;
- FastStream's NATS RPC (``broker.request``) on the same nats-server: not durable (core
  NATS), a peer for the programming model;
- Celery with a Redis broker and result backend (Debian's ``redis-server`` started on a
  free port at its defaults: RDB snapshots, no AOF), a threads pool of 64, the caller's
  ``delay().get()`` on 64 threads.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import ROOT, Missing, need_binary, peer_imports
from loopmesh.ports import free_port
from loopmesh.process import terminate

FS_SUBJECT = "bench.faststream.echo"


async def timed(
    call: Callable[[], Awaitable[object]], in_flight: int, calls: int
) -> dict[str, float]:
    latencies: list[float] = []
    left = calls

    async def loop() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            t = time.perf_counter()
            await call()
            latencies.append(time.perf_counter() - t)

    for _ in range(min(50, calls)):
        await call()
    latencies.clear()
    started = time.perf_counter()
    async with asyncio.TaskGroup() as tg:
        for _ in range(in_flight):
            tg.create_task(loop())
    elapsed = time.perf_counter() - started
    latencies.sort()
    return {
        "p50": statistics.median(latencies) * 1000,
        "p99": latencies[max(0, int(len(latencies) * 0.99) - 1)] * 1000,
        "rate": len(latencies) / elapsed,
    }


async def _child(
    *args: str, ready: str, env: dict[str, str] | None = None
) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(
        *args, cwd=str(ROOT), env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    assert proc.stdout is not None
    seen: list[bytes] = []
    try:
        async with asyncio.timeout(60):
            async for line in proc.stdout:
                if ready.encode() in line:
                    asyncio.get_running_loop().create_task(_drain(proc))
                    return proc
                seen = [*seen[-19:], line]
    except TimeoutError:
        pass
    await terminate(proc, 10)
    said = b"".join(seen).decode(errors="replace").strip()
    raise RuntimeError(f"{' '.join(args[:4])} did not say {ready!r}: {said or 'no output'}")


async def _drain(proc: asyncio.subprocess.Process) -> None:
    assert proc.stdout is not None
    async for _ in proc.stdout:
        pass


async def measure_all(calls: int, scale_s: float = 4.0) -> Dispatch:
    from bench import tool_roundtrip as rt
    from loopmesh.provision import ensure_consumer, provision
    from loopmesh.server import NatsServer
    from schemas import definitions, pool_consumer

    out: dict[str, dict[int, dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="loopmesh-bench-") as tmp:
        async with NatsServer(Path(tmp) / "nats") as server:
            import nats

            nc = await nats.connect(server.url)
            js = nc.jetstream()
            await provision(js, definitions(rt.S))
            for pool in ("floor", "bench"):
                await ensure_consumer(js, pool_consumer(rt.S, pool))
            req = rt.Requester(nc)
            await req.start()
            for label, kind, pool in (
                ("raw nats-py request/reply", "raw", ""),
                ("durable floor (hand-written)", "floor", "floor"),
                ("loopmesh ToolWorker", "worker", "bench"),
            ):
                responder = rt.Responder(server.url, kind, pool or "bench")
                try:
                    await rt._wait_serving(req, kind, pool)
                    out[label] = {}
                    for n in (1, 64):
                        r = await rt.measure(
                            req, kind, pool, "echo", n, calls if n > 1 else calls // 4
                        )
                        out[label][n] = r
                finally:
                    responder.stop()
            await ensure_consumer(js, pool_consumer(rt.S, "scale"))
            scaled = {
                "I/O-bound (50 ms sleep), 8 at once per worker": await rt.scaling(
                    req, server.url, "sleep50", 8, scale_s
                ),
                "CPU-bound (10 ms of CPU), 8 at once per worker": await rt.scaling(
                    req, server.url, "spin10", 8, scale_s
                ),
            }
            await nc.close()
            try:
                out["FastStream NATS RPC (not durable)"] = await _faststream(server.url, calls)
            except Missing as e:
                out[f"FastStream: {e}"] = {}
            except Exception as e:  # a peer that fails is reported, not the whole run lost
                out[f"FastStream: failed: {type(e).__name__}: {e}"] = {}
        try:
            out["Celery + Redis"] = await _celery(Path(tmp), calls)
        except Missing as e:
            out[f"Celery + Redis: {e}"] = {}
        except Exception as e:
            out[f"Celery + Redis: failed: {type(e).__name__}: {e}"] = {}
    return Dispatch(out, scaled)


@dataclass(frozen=True)
class Dispatch:
    results: dict[str, dict[int, dict[str, float]]]  # by dispatch, then calls in flight
    scaling: dict[str, list[Any]]  # bench.tool_roundtrip.Scaled at 1, 2, 4 workers

    def markdown(self) -> str:
        floor = self.results["durable floor (hand-written)"]
        lines = [
            "| dispatch | p50 / p99 ms, 1 in flight | p50 / p99 ms, 64 in flight "
            "| calls/s at 64 | p50 vs durable floor (1 / 64) |",
            "| --- | --- | --- | --- | --- |",
        ]
        for name, r in self.results.items():
            if not r:
                lines.append(f"| {name} | not run | | | |")
                continue
            lines.append(
                f"| {name} | {r[1]['p50']:.3f} / {r[1]['p99']:.3f} | {r[64]['p50']:.3f} / "
                f"{r[64]['p99']:.3f} | {r[64]['rate']:.0f} | "
                f"{r[1]['p50'] / floor[1]['p50']:.2f}x / {r[64]['p50'] / floor[64]['p50']:.2f}x |"
            )
        lines += [
            "",
            "Tool-pool scaling: loopmesh tool-worker processes on one pool, 64 calls in flight "
            f"({os.cpu_count()} cores):",
            "",
            "| tool | 1 worker calls/s | 2 workers | 4 workers | efficiency at 2 / 4 |",
            "| --- | --- | --- | --- | --- |",
        ]
        for name, runs in self.scaling.items():
            rates = " | ".join(f"{r.rate:.0f}" for r in runs)
            eff = " / ".join(f"{r.efficiency:.0%}" for r in runs[1:])
            lines.append(f"| {name} | {rates} | {eff} |")
        return "\n".join(lines)


async def _faststream(url: str, calls: int) -> dict[int, dict[str, float]]:
    with peer_imports("faststream"):
        from faststream.nats import NatsBroker
    proc = await _child(sys.executable, "-m", "bench.dispatch", "faststream", url, ready="ready")
    try:
        broker = NatsBroker(url)
        await broker.start()
        try:

            async def call() -> None:
                await broker.request({"text": "x" * 100}, FS_SUBJECT, timeout=30)

            return {n: await timed(call, n, calls if n > 1 else calls // 4) for n in (1, 64)}
        finally:
            await broker.stop()
    finally:
        await terminate(proc, 10)


async def _serve_faststream(url: str) -> None:
    from faststream.nats import NatsBroker

    broker = NatsBroker(url)

    @broker.subscriber(FS_SUBJECT)
    async def echo(data: dict[str, str]) -> dict[str, str]:
        return data

    await broker.start()
    # One call through nats-server before "ready": the subscription is registered there
    # (a connection's SUB is processed before its PUB), so the caller's first request
    # finds a responder.
    await broker.request({"text": "up"}, FS_SUBJECT, timeout=30)
    print("ready", flush=True)
    await asyncio.Event().wait()


async def _celery(tmp: Path, calls: int) -> dict[int, dict[str, float]]:
    redis = need_binary("redis-server", "apt-get install redis-server")
    with peer_imports("celery"):
        import celery  # noqa: F401
    port = free_port()
    server = await _child(
        redis, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp),
        ready="Ready to accept connections",
    )  # fmt: skip
    url = f"redis://127.0.0.1:{port}/0"
    env = {"BENCH_REDIS_URL": url}
    worker = await _child(
        sys.executable, "-m", "celery", "-A", "bench.celery_app", "worker", "--pool", "threads",
        "--concurrency", "64", "--loglevel", "INFO", "--without-gossip", "--without-mingle",
        "--without-heartbeat", ready="ready.", env=env,
    )  # fmt: skip
    try:
        os.environ["BENCH_REDIS_URL"] = url
        from bench.celery_app import echo

        pool = ThreadPoolExecutor(64)
        loop = asyncio.get_running_loop()

        async def call() -> None:
            await loop.run_in_executor(pool, lambda: echo.delay("x" * 100).get(timeout=30))

        result = {
            n: await timed(call, n, max(64, calls // 8) if n > 1 else calls // 16) for n in (1, 64)
        }
        pool.shutdown()
        return result
    finally:
        await terminate(worker, 10)
        await terminate(server, 10)


def run(args: argparse.Namespace) -> Dispatch:
    return asyncio.run(measure_all(args.tool_calls))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["faststream"])
    parser.add_argument("url")
    a = parser.parse_args()
    asyncio.run(_serve_faststream(a.url))
