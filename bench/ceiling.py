"""One events stream's ceiling: how many events a second its leader stores, and what each
costs the server.

    python -m bench.ceiling [--seconds 5] [--publishers 2] [--sessions 256] [--partitions 1,4]

For each configuration (one server with JetStream's default sync, one server with
``sync_interval: always``, a 3-node cluster with the stream at R3), the events stream is
provisioned as loopmesh provisions it, and ``--publishers`` processes publish events as
loop workers do: ``content_delta``-sized JSON (about 200 bytes) with a ``Nats-Msg-Id``
each, over ``--sessions`` session subjects; on one server plain publishes with an acked
barrier every 64 (the sink's ``barriers``), on R3 every event acked (``each``), up to
512 events unacked per publisher. It prints, per configuration, the events stored a
second, the servers' CPU per stored event, and what one core of server would store at
that cost (the leader's ceiling where the publishers are not the limit: on a small
machine they share its cores with the servers, and run out first). Each configuration
runs once per ``--partitions`` count (``[nats] partitions``: the events over that many
streams, whose leaders JetStream spreads over a cluster's nodes).
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

from bench.harness import bench_process, bound_unacked, ceiling_parser, servers_cpu
from loopmesh.aio import run
from loopmesh.cluster import NatsCluster
from loopmesh.jetstream import Publisher
from loopmesh.nats import connect
from loopmesh.provision import ensure_stream
from loopmesh.server import NatsServer
from loopmesh.settings import NatsSettings
from schemas import Subjects, encode
from schemas.events import ContentDelta
from schemas.streams import definitions

WINDOW = 512  # events a publisher leaves unacked at most


async def publish(
    url: str, index: int, seconds: float, sessions: int, each: bool, partitions: int
) -> int:
    """Publish events for ``seconds``; how many were published (and acked)."""
    S = Subjects(partitions=partitions)
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
        await bound_unacked(waiting, window)  # as the sink does: a bounded number unacked
    await bound_unacked(waiting, 0)
    await publisher.close()
    await nc.close()
    return sent


async def stored(js: JetStreamContext, S: Subjects) -> int:
    """Messages in all the events streams."""
    infos = [await js.stream_info(name) for name in S.events_streams]
    return sum(info.state.messages for info in infos)


async def measure(
    url: str, pids: list[int], args: argparse.Namespace, each: bool, partitions: int
) -> dict[str, float]:
    S = Subjects(partitions=partitions)
    nc = await connect(NatsSettings(url=url), name="ceiling")
    js = nc.jetstream()
    replicas = 3 if each else 1
    names = set(S.events_streams)
    for events in definitions(S, replicas=replicas).streams:
        if events.name in names:
            await ensure_stream(js, events, placement_wait_s=30)
    leaders = {(await js.stream_info(name)).cluster.leader for name in S.events_streams}  # type: ignore[union-attr]
    before = await stored(js, S)
    cpu = servers_cpu(pids)
    started = time.perf_counter()
    procs = [
        await bench_process(
            "bench.ceiling",
            "--publisher",
            str(i),
            "--url",
            url,
            "--seconds",
            str(args.seconds),
            "--sessions",
            str(args.sessions),
            "--partitions",
            str(partitions),
            *(["--each"] if each else []),
        )
        for i in range(args.publishers)
    ]
    outs = [await p.communicate() for p in procs]
    wall = time.perf_counter() - started
    spent = servers_cpu(pids) - cpu
    kept = await stored(js, S) - before
    for name in S.events_streams:  # the next count's streams take these subjects
        await js.delete_stream(name)
    await nc.close()
    published = sum(int(out.decode().split()[-1]) for out, _ in outs)
    return {
        "published": published,
        "stored": kept,
        "per_s": kept / wall,
        "cpu_us": spent / max(kept, 1) * 1e6,
        "leaders": len(leaders),
    }


def _row(name: str, partitions: int, m: dict[str, float]) -> str:
    core = 1e6 / m["cpu_us"] if m["cpu_us"] else 0
    return (
        f"| {name} | {partitions} ({m['leaders']:.0f} leader nodes) | {m['per_s']:,.0f} | "
        f"{m['cpu_us']:.1f} | {core:,.0f} | {m['stored']:,.0f} of {m['published']:,.0f} |"
    )


async def main(args: argparse.Namespace) -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        counts = args.partitions
        async with NatsServer(root / "r1") as server:
            for n in counts:
                m = await measure(server.url, [server.pid or 0], args, False, n)
                rows.append(_row("R1, default sync", n, m))
        conf = root / "always.conf"
        conf.write_text("jetstream { sync_interval: always }\n")
        async with NatsServer(root / "r1a", extra_args=("-c", str(conf))) as server:
            for n in counts:
                m = await measure(server.url, [server.pid or 0], args, False, n)
                rows.append(_row("R1, sync always", n, m))
        async with NatsCluster(root / "r3") as cluster:
            pids = [node.pid or 0 for node in cluster.nodes]
            for n in counts:
                m = await measure(cluster.url, pids, args, True, n)
                rows.append(_row("R3 (3 nodes), default sync", n, m))
    print(
        f"events stream, {args.publishers} publisher processes, {args.seconds:g} s each, "
        f"{os.cpu_count()} cores:"
    )
    print("| configuration | partitions | events stored/s | server CPU per event (µs, all nodes) "
          "| one core's worth (events/s) | stored of published |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))


if __name__ == "__main__":
    parser = ceiling_parser(__doc__, "[nats] partitions")
    parser.add_argument("--sessions", type=int, default=256)
    parser.add_argument("--each", action="store_true", help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.publisher is not None:
        [count] = a.partitions
        print(run(publish(a.url, a.publisher, a.seconds, a.sessions, a.each, count)))
    else:
        run(main(a))
