"""One events stream's ceiling: how many events a second its leader stores, and what each
costs the server.

    python -m bench.ceiling [--seconds 5] [--publishers 2] [--sessions 256]

For each configuration (one server with JetStream's default sync, one server with
``sync_interval: always``, a 3-node cluster with the stream at R3), the events stream is
provisioned as loopmesh provisions it, and ``--publishers`` processes publish events as
loop workers do: ``content_delta``-sized JSON (about 200 bytes) with a ``Nats-Msg-Id``
each, over ``--sessions`` session subjects; on one server plain publishes with an acked
barrier every 64 (the sink's ``barriers``), on R3 every event acked (``each``), up to
512 events unacked per publisher. It prints, per configuration, the events stored a
second, the servers' CPU per stored event, and what one core of server would store at
that cost (the leader's ceiling where the publishers are not the limit: on a small
machine they share its cores with the servers, and run out first).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script too

from nats.js import JetStreamContext

from bench.harness import cpu_seconds
from loopmesh.aio import run
from loopmesh.cluster import NatsCluster
from loopmesh.jetstream import Publisher, settled
from loopmesh.nats import connect
from loopmesh.provision import ensure_stream
from loopmesh.server import NatsServer
from loopmesh.settings import NatsSettings
from schemas import Subjects, encode
from schemas.events import ContentDelta
from schemas.streams import definitions

S = Subjects()
ROOT = Path(__file__).resolve().parents[1]
WINDOW = 512  # events a publisher leaves unacked at most


async def publish(url: str, index: int, seconds: float, sessions: int, each: bool) -> int:
    """Publish events for ``seconds``; how many were published (and acked)."""
    nc = await connect(NatsSettings(url=url), name=f"publisher-{index}")
    publisher = Publisher(nc)
    await publisher.start()
    event = ContentDelta(tenant="bench", session="s0", turn_id="t", iteration=1, text="x" * 60)
    payload = encode(event)
    subjects = [S.event("bench", f"p{index}s{i}", "content_delta") for i in range(sessions)]
    waiting: list[asyncio.Future[object]] = []
    window = WINDOW if each else WINDOW // 64  # acks outstanding: messages or barriers
    sent = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for _ in range(64):
            subject = subjects[sent % sessions]
            headers = {"Nats-Msg-Id": f"p{index}-{sent}"}
            sent += 1
            if each or sent % 64 == 0:
                waiting.append(await publisher.publish(subject, payload, headers))
            else:
                await nc.publish(subject, payload, headers=headers)
        if len(waiting) >= window:  # as the sink does: a bounded number unacked
            await asyncio.gather(*(settled(f, 30) for f in waiting[: window // 2]))
            del waiting[: window // 2]
    await asyncio.gather(*(settled(f, 30) for f in waiting))
    await publisher.close()
    await nc.close()
    return sent


async def stored_events(js: JetStreamContext) -> int:
    """The events kept, over every partition's events stream."""
    return sum([(await js.stream_info(name)).state.messages for name in S.events_streams])


async def measure(
    url: str, pids: list[int], args: argparse.Namespace, each: bool
) -> dict[str, float]:
    nc = await connect(NatsSettings(url=url), name="ceiling")
    js = nc.jetstream()
    replicas = 3 if each else 1
    for d in definitions(S, replicas=replicas).streams:
        if d.name in S.events_streams:
            await ensure_stream(js, d, placement_wait_s=30)
    before = await stored_events(js)
    cpu = sum(cpu_seconds(p) for p in pids)
    started = time.perf_counter()
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "bench.ceiling",
            "--publisher",
            str(i),
            "--url",
            url,
            "--seconds",
            str(args.seconds),
            "--sessions",
            str(args.sessions),
            *(["--each"] if each else []),
            cwd=str(ROOT),
            stdout=asyncio.subprocess.PIPE,
        )
        for i in range(args.publishers)
    ]
    outs = [await p.communicate() for p in procs]
    wall = time.perf_counter() - started
    spent = sum(cpu_seconds(p) for p in pids) - cpu
    stored = await stored_events(js) - before
    await nc.close()
    published = sum(int(out.decode().split()[-1]) for out, _ in outs)
    return {
        "published": published,
        "stored": stored,
        "per_s": stored / wall,
        "cpu_us": spent / max(stored, 1) * 1e6,
    }


def _row(name: str, m: dict[str, float]) -> str:
    core = 1e6 / m["cpu_us"] if m["cpu_us"] else 0
    return (
        f"| {name} | {m['per_s']:,.0f} | {m['cpu_us']:.1f} | {core:,.0f} | "
        f"{m['stored']:,.0f} of {m['published']:,.0f} |"
    )


async def main(args: argparse.Namespace) -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        async with NatsServer(root / "r1") as server:
            rows.append(
                _row("R1, default sync", await measure(server.url, [server.pid or 0], args, False))
            )
        conf = root / "always.conf"
        conf.write_text("jetstream { sync_interval: always }\n")
        async with NatsServer(root / "r1a", extra_args=("-c", str(conf))) as server:
            rows.append(
                _row("R1, sync always", await measure(server.url, [server.pid or 0], args, False))
            )
        async with NatsCluster(root / "r3") as cluster:
            pids = [n.pid or 0 for n in cluster.nodes]
            rows.append(
                _row("R3 (3 nodes), default sync", await measure(cluster.url, pids, args, True))
            )
    print(
        f"events stream, {args.publishers} publisher processes, {args.seconds:g} s each, "
        f"{os.cpu_count()} cores:"
    )
    print("| configuration | events stored/s | server CPU per event (µs, all nodes) "
          "| one core's worth (events/s) | stored of published |")  # fmt: skip
    print("| --- | --- | --- | --- | --- |")
    print("\n".join(rows))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--publishers", type=int, default=2)
    parser.add_argument("--sessions", type=int, default=256)
    parser.add_argument("--publisher", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--url", default="", help=argparse.SUPPRESS)
    parser.add_argument("--each", action="store_true", help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.publisher is not None:
        print(run(publish(a.url, a.publisher, a.seconds, a.sessions, a.each)))
    else:
        run(main(a))
