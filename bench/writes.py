"""JetStream writes per turn on loopmesh's durable path: what each stream and bucket
stores, and the fsyncs nats-server makes with ``sync_interval: always``.

    python -m bench.writes [--turns 40] [--iterations 1,10] [--no-strace]

A real loop-worker process with the zero-latency model (``bench.instant_worker``) and a
tool-worker process, on an embedded nats-server with ``jetstream { sync_interval:
always }``. For each ``k`` of ``--iterations``, ``--turns`` turns of ``k`` echo calls,
each in a fresh session, one after another; before and after, the server's ``/jsz``
(each stream's last sequence: the messages it stored, a KV put or delete being one) and
``/varz`` (messages received from clients, acks and deduplicated copies included).
``strace -f -c`` (when installed) counts the server's ``fsync``/``fdatasync`` calls
over the same turns: besides each stored message, a work-queue message removed by its
ack costs one. strace slows the server: the counts are the figure, not the times.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.harness import Ends, Mesh, turn
from loopmesh.aio import run
from loopmesh.server import NatsServer

RECEIVED = "messages received (acks, duplicates included)"
FSYNCS = "fsync + fdatasync (strace)"


@dataclass(frozen=True)
class Writes:
    iterations: int  # echo calls per turn
    per_turn: dict[str, float]  # by stream (stored messages), RECEIVED and FSYNCS


async def _counters(monitor: str) -> dict[str, int]:
    async with httpx.AsyncClient() as http:
        jsz = (await http.get(f"{monitor}/jsz", params={"streams": "true"})).json()
        varz = (await http.get(f"{monitor}/varz")).json()
    out = {RECEIVED: int(varz["in_msgs"])}
    for account in jsz.get("account_details") or []:
        for stream in account.get("stream_detail") or []:
            out[stream["name"]] = int(stream["state"]["last_seq"])
    return out


async def _strace(pid: int, out: Path) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(
        "strace", "-f", "-c", "-e", "trace=fsync,fdatasync", "-o", str(out), "-p", str(pid),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    await asyncio.sleep(1.0)  # until it has attached to every thread
    return proc


def _fsyncs(path: Path) -> int:
    """The calls column of ``strace -c``'s fsync and fdatasync lines."""
    total = 0
    for line in path.read_text().splitlines():
        m = re.match(r"\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:\d+\s+)?(fsync|fdatasync)\s*$", line)
        if m:
            total += int(m.group(1))
    return total


async def measure(
    turns: int = 40, ks: tuple[int, ...] = (1, 10), strace: bool = True
) -> list[Writes]:
    strace = strace and shutil.which("strace") is not None
    out: list[Writes] = []
    with tempfile.TemporaryDirectory(prefix="loopmesh-writes-") as tmp:
        store = Path(tmp)
        conf = store / "sync.conf"
        conf.write_text("jetstream { sync_interval: always }\n")
        mesh = Mesh(store, ack_wait_s=30, lease_ttl_s=30)
        mesh.server = NatsServer(store, extra_args=("-c", str(conf)))
        async with mesh:
            await mesh.tool_worker()
            await mesh.instant_worker("w1", max(ks))
            ends = Ends(mesh.nc)
            await ends.start()
            await ends.run(turn("warm", "warm", "echo 1"))
            for k in ks:
                tracer, trace = None, store / f"strace-{k}"
                if strace and mesh.server.pid is not None:
                    tracer = await _strace(mesh.server.pid, trace)
                before = await _counters(mesh.server.monitor_url)
                for n in range(turns):
                    await ends.run(turn(f"k{k}t{n}", f"k{k}s{n}", f"echo {k}"))
                after = await _counters(mesh.server.monitor_url)
                per_turn = {
                    name: (value - before.get(name, 0)) / turns
                    for name, value in after.items()
                    if value != before.get(name, 0)
                }
                if tracer is not None:
                    tracer.terminate()
                    await tracer.wait()
                    per_turn[FSYNCS] = _fsyncs(trace) / turns
                out.append(Writes(k, per_turn))
    return out


async def stream_rates(shards: tuple[int, ...] = (1, 2, 4), group: int = 16) -> dict[int, float]:
    """Messages/s JetStream stores with ``sync_interval: always`` when 64 concurrent
    writers each publish ``group`` messages (the last with an ack, as a turn's events
    go: plain publishes and a barrier) spread over 1, 2 or 4 streams: one stream's
    writes are fsynced one after another, so its rate bounds the turns/s of anything
    that stores ``group`` messages per turn in it."""
    import json

    out: dict[int, float] = {}
    with tempfile.TemporaryDirectory(prefix="loopmesh-writes-") as tmp:
        conf = Path(tmp) / "sync.conf"
        conf.write_text("jetstream { sync_interval: always }\n")
        async with NatsServer(Path(tmp), extra_args=("-c", str(conf))) as server:
            import nats

            nc = await nats.connect(server.url)
            for s in range(max(shards)):
                config = {"name": f"W{s}", "subjects": [f"w{s}.>"], "storage": "file"}
                await nc.request(f"$JS.API.STREAM.CREATE.W{s}", json.dumps(config).encode())
            for n in shards:
                room = asyncio.Semaphore(64)

                async def writer(i: int, n: int = n, room: asyncio.Semaphore = room) -> None:
                    async with room:
                        for j in range(group):
                            subject, hdr = f"w{i % n}.{i}.{j}", {"Nats-Msg-Id": f"{n}.{i}.{j}"}
                            if j < group - 1:
                                await nc.publish(subject, b"x" * 200, headers=hdr)
                            else:
                                await nc.request(subject, b"x" * 200, headers=hdr, timeout=30)

                count = 512
                started = time.perf_counter()
                await asyncio.gather(*(writer(i) for i in range(count)))
                out[n] = count * group / (time.perf_counter() - started)
            await nc.close()
    return out


def markdown(results: list[Writes]) -> str:
    names = [n for n in dict.fromkeys(n for r in results for n in r.per_turn) if n != FSYNCS]
    names = [*sorted(n for n in names if n != RECEIVED), RECEIVED]
    if any(FSYNCS in r.per_turn for r in results):
        names.append(FSYNCS)
    head = " | ".join(f"per turn of {r.iterations}" for r in results)
    lines = [
        f"| stream or bucket (messages stored) | {head} | per iteration (from the last two) |",
        "|" + " --- |" * (2 + len(results)),
    ]
    for name in names:
        cells = " | ".join(f"{r.per_turn.get(name, 0):.2f}" for r in results)
        slope = ""
        if len(results) >= 2:
            a, b = results[-2], results[-1]
            rise = b.per_turn.get(name, 0) - a.per_turn.get(name, 0)
            slope = f"{rise / (b.iterations - a.iterations):.2f}"
        lines.append(f"| {name} | {cells} | {slope} |")
    return "\n".join(lines)


async def _main(args: argparse.Namespace) -> None:
    ks = tuple(int(k) for k in args.iterations.split(","))
    print(markdown(await measure(args.turns, ks, args.strace)))
    rates = await stream_rates()
    print("stored messages/s, sync_interval always, 64 writers over 1 / 2 / 4 streams: ")
    print(" / ".join(f"{r:.0f}" for r in rates.values()))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--turns", type=int, default=40)
    parser.add_argument("--iterations", default="1,10")
    parser.add_argument("--no-strace", dest="strace", action="store_false")
    run(_main(parser.parse_args()))
