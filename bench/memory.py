"""Memory search at scale: one namespace of N memories, searched the way a loop worker does.

    python -m bench.memory [--sizes 10000,100000] [--searches 200]

An embedded nats-server holds the memory bucket. For each size the bench writes N
memories of one user (384-dimension unit vectors, as MiniLM's, stored with each memory),
then a fresh :class:`loop_worker.memory.NatsMemories` searches that namespace as a turn's
recall does: the first search loads it (reads every key, then follows it), the rest run
on the matrix in memory. Query vectors come from a stub embedder (a fixed vector per
query), so the figures are the store's and the search's alone; the bundled MiniLM's time
to embed one query is printed apart. Prints, per size: the write rate, the load, search
p50/p99, and the worker's memory per stored memory (RSS growth over the load).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # one BLAS thread, as a loop worker has

import numpy as np

from bench.common import loadavg, machine
from loop_worker.engine.settings import MemorySettings
from loop_worker.memory import NatsMemories
from loopmesh.memory import MemoryStore
from loopmesh.nats import connect
from loopmesh.provision import provision
from loopmesh.server import NatsServer
from loopmesh.settings import NatsSettings
from schemas.memory import Memory, MemorySource
from schemas.streams import definitions
from schemas.subjects import Subjects

DIMS = 384
S = Subjects()


class StubEmbedder:
    """A unit vector per text, drawn from a generator seeded by the text."""

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        out = []
        for text in texts:
            v = np.random.default_rng(abs(hash(text)) % (1 << 32)).standard_normal(DIMS)
            out.append((v / np.linalg.norm(v)).tolist())
        return out


def rss_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


async def write(store: MemoryStore, user: str, n: int) -> float:
    """Write ``n`` memories of ``user``; their rate per second."""
    rng = np.random.default_rng(7)
    started = time.perf_counter()

    async def one(i: int) -> None:
        v = rng.standard_normal(DIMS).astype(np.float32)
        v /= np.linalg.norm(v)
        memory = Memory(
            id=f"m{i:07d}", tenant="acme", kind="user", name=user,
            text=f"Fact number {i} about {user}, worth remembering.",
            created_at=time.time(), source=MemorySource(by="api"),
            model="stub", vector=v.tobytes(),
        )  # fmt: skip
        await store.put(memory)

    for start in range(0, n, 256):  # 256 writes in flight, the event loop never blocked
        await asyncio.gather(*(one(i) for i in range(start, min(start + 256, n))))
    return n / (time.perf_counter() - started)


async def measure(nc, n: int, searches: int) -> dict[str, float]:  # type: ignore[no-untyped-def]
    user = f"u{n}"
    rate = await write(MemoryStore(nc.jetstream(), S.memory_bucket, timeout_s=30), user, n)
    memories = NatsMemories(
        nc, S.memory_bucket, MemorySettings(), embedder=StubEmbedder(), model="stub"
    )
    before = rss_kb()
    started = time.perf_counter()
    await memories.search("acme", [("user", user)], "warm", 5)
    load_s = time.perf_counter() - started
    grown = rss_kb() - before
    times = []
    for i in range(searches):
        t = time.perf_counter()
        await memories.search("acme", [("user", user)], f"query {i}", 5)
        times.append((time.perf_counter() - t) * 1000)
    await memories.aclose()
    times.sort()
    return {
        "n": n, "write_per_s": rate, "load_s": load_s,
        "p50_ms": statistics.median(times), "p99_ms": times[int(len(times) * 0.99) - 1],
        "kb_per_memory": grown / n,
    }  # fmt: skip


def minilm_query_ms() -> float | None:
    from loopmesh.minilm import MiniLM, missing

    if missing() is not None:
        return None
    model = MiniLM.load()
    model.embed(["warm up"])
    t = time.perf_counter()
    for i in range(20):
        model.embed([f"What colour do I like, take {i}?"])
    return (time.perf_counter() - t) / 20 * 1000


async def main(args: argparse.Namespace) -> None:
    print(f"# {machine()}; load {loadavg()}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        async with NatsServer(Path(tmp)) as server:
            nc = await connect(NatsSettings(url=server.url), name="bench")
            await provision(nc.jetstream(), definitions(S))
            for n in args.sizes:
                print(f"# {n} memories...", flush=True)
                rows.append(await measure(nc, n, args.searches))
            await nc.close()
    head = f"{'memories':>9} {'writes/s':>9} {'load s':>7} {'search p50 ms':>14} {'p99 ms':>7}"
    print(f"{head} {'KB/memory':>10}")
    for r in rows:
        print(
            f"{r['n']:>9} {r['write_per_s']:>9.0f} {r['load_s']:>7.2f} {r['p50_ms']:>14.2f} "
            f"{r['p99_ms']:>7.2f} {r['kb_per_memory']:>10.2f}"
        )
    embed = minilm_query_ms()
    if embed is not None:
        print(f"MiniLM, one query embedded in process: {embed:.1f} ms")


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.memory", description=__doc__)
    parser.add_argument(
        "--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[10_000, 100_000]
    )
    parser.add_argument("--searches", type=int, default=200)
    return parser.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse(sys.argv[1:])))
