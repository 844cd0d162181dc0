"""The turns streams' ceiling: how many turns a second they take in and hand out, and
what each costs the servers, with the turns in one stream and over N.

    python -m bench.turns_ceiling [--seconds 5] [--publishers 2] [--consumers 2]
                                  [--tenants 64] [--partitions 1,4]

For each configuration (one server with JetStream's default sync; a 3-node cluster with
the streams at R3) and each ``--partitions`` count (``[nats] turn_partitions``), fresh
servers start with that count's subject mappings (``Subjects.turn_mappings``); the turns
streams are provisioned as loopmesh provisions them, with one interactive-lane consumer
per tenant (``schemas.streams.tenant_consumer``), and the routing is checked as the
services check it at start. Then, for ``--seconds``:

- ``--publishers`` processes publish turns as clients do: a real ``schemas.Turn`` (about
  570 bytes of JSON) per publish on ``loopmesh.turns.<tenant>.<session>`` with its
  ``Nats-Msg-Id``, each acked by JetStream, up to 512 unacked per process, over
  ``--tenants`` tenants and 16 sessions of each per process;
- ``--consumers`` processes take them as loop workers do: a pull of up to 16 turns from
  each tenant's consumer in turn (raw ``CONSUMER.MSG.NEXT`` requests answered on one
  inbox, expiring after the loop worker's ``fetch_timeout_s``), and one ack per turn
  with its reply awaited, as a loop worker's is, up to 512 unanswered per process.

When the publishers stop, the consumers take what is left and stop, so every turn counted
was stored, delivered, acked and removed within the run. It prints, per configuration,
the turns a second, the servers' CPU per turn, what one core of server would carry at that
cost, and the publishers' and consumers' CPU per turn (on a small machine they share its
cores with the servers and are the limit first); then each count's figures over the
first's, measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script too

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from bench.harness import (
    QUIET_S,
    at_least_one,
    bench_process,
    bound_unacked,
    ceiling_parser,
    servers_cpu,
    turn,
)
from loop_worker.config import ServiceSettings
from loopmesh.aio import run
from loopmesh.cluster import NatsCluster
from loopmesh.jetstream import Publisher
from loopmesh.mappings import check_turn_partitions
from loopmesh.nats import connect
from loopmesh.provision import ensure_consumer, ensure_stream
from loopmesh.server import NatsServer
from loopmesh.settings import NatsSettings
from schemas import Subjects, encode
from schemas.streams import tenant_consumer, turns_streams

MODULE = "bench.turns_ceiling"
WINDOW = 512  # turns a process leaves unacked at most: publishes, or takes
BATCH = 16  # turns one pull asks a tenant's consumer for
SESSIONS = 16  # sessions of each tenant a publisher spreads its turns over
LOST_S = 1.0  # a pull unanswered this long after it expired is given up
WORKER = ServiceSettings()  # the loop worker's defaults: pull expiry, deliveries
INPUT = (
    "Summarise the open incidents of the last week and draft a status note for the team, "
    "with the owners and next steps of each."
)


def tenants_of(count: int) -> list[str]:
    return [f"tenant-{i}" for i in range(count)]


async def started() -> asyncio.StreamReader:
    """Say ``ready`` and wait for the bench's ``go`` on stdin, which it sends when every
    process is ready; the stdin stream after it (the bench closes it when the
    publishers are done)."""
    stdin = asyncio.StreamReader()
    protocol = asyncio.StreamReaderProtocol(stdin)
    await asyncio.get_running_loop().connect_read_pipe(lambda: protocol, sys.stdin)
    print("ready", flush=True)
    await stdin.readline()
    return stdin


# -- a publisher process ------------------------------------------------------------------


async def publish(url: str, index: int, seconds: float, tenants: int, partitions: int) -> str:
    """Publish turns for ``seconds`` from ``go``: how many (all acked), and the CPU
    seconds this process spent on them."""
    S = Subjects(turn_partitions=partitions)
    nc = await connect(NatsSettings(url=url), name=f"publisher-{index}")
    publisher = Publisher(nc)
    await publisher.start()
    names = tenants_of(tenants)
    await started()
    cpu = time.process_time()
    waiting: list[asyncio.Future[Any]] = []
    sent = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for _ in range(64):
            session = f"p{index}s{sent // tenants % SESSIONS}"
            t = turn(f"p{index}x{sent}", session, INPUT, tenant=names[sent % tenants])
            headers = {"Nats-Msg-Id": t.msg_id}
            waiting.append(await publisher.publish(S.turn(t.tenant, session), encode(t), headers))
            sent += 1
        await bound_unacked(waiting, WINDOW)
    await bound_unacked(waiting, 0)
    spent = time.process_time() - cpu
    await publisher.close()
    await nc.close()
    return f"{sent} {spent}"


# -- a consumer process -------------------------------------------------------------------


class Taker:
    """One consumer process's pulls: at most one in flight per tenant, every tenant's
    asked for again as soon as its last one ends; each turn is acked as it arrives.
    Once the publishers are done (:meth:`drain`), the pulls ask without waiting, and it
    stops when each tenant's last one came back empty."""

    def __init__(self, nc: Client, subjects: Subjects, tenants: list[str]) -> None:
        self.nc = nc
        self.publisher = Publisher(nc)
        self.tenants = {name: i for i, name in enumerate(tenants)}
        self.apis = [
            f"$JS.API.CONSUMER.MSG.NEXT.{subjects.turns_stream_of(t)}.{subjects.tenant_consumer(t)}"
            for t in tenants
        ]
        n = len(tenants)
        self.asked_at: list[float | None] = [None] * n  # the pull in flight, sent when
        self.left = [0] * n  # places its pull has left
        self.got = [0] * n  # turns its pull has had
        self.when_draining = [False] * n  # its pull asked once the publishers were done
        self.empty: set[int] = set()  # tenants found empty once they were
        self.draining = False
        self.acks: list[asyncio.Future[Any]] = []  # the acks' replies not yet in
        self.taken = 0
        self.changed = asyncio.Event()
        expires = int(WORKER.fetch_timeout_s * 1e9)
        self.body = json.dumps({"batch": BATCH, "expires": expires}).encode()
        self.drain_body = json.dumps({"batch": BATCH, "no_wait": True}).encode()

    async def start(self) -> None:
        await self.publisher.start()
        self.inbox = self.nc.new_inbox()
        await self.nc.subscribe(f"{self.inbox}.*", cb=self._on_reply)
        await self.nc.flush()

    def drain(self) -> None:
        self.draining = True
        self.changed.set()

    async def take(self) -> None:
        """Pull, ack, until drained; every ack's reply in."""
        loop = asyncio.get_running_loop()
        n, first = len(self.apis), 0
        while not (self.draining and len(self.empty) == n):
            self.changed.clear()
            await bound_unacked(self.acks, WINDOW)
            now = loop.time()
            for i in (*range(first, n), *range(first)):  # round-robin over the tenants
                asked = self.asked_at[i]
                if asked is not None and now - asked > WORKER.fetch_timeout_s + LOST_S:
                    self._end(i)
                if self.asked_at[i] is None and i not in self.empty:
                    await self._ask(i, now)
            first = (first + 1) % n
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(WORKER.fetch_timeout_s):
                    await self.changed.wait()
        await bound_unacked(self.acks, 0)

    async def _ask(self, i: int, now: float) -> None:
        self.asked_at[i], self.left[i], self.got[i] = now, BATCH, 0
        self.when_draining[i] = self.draining
        body = self.drain_body if self.draining else self.body
        await self.nc.publish(self.apis[i], body, reply=f"{self.inbox}.{i}")

    def _end(self, i: int) -> None:
        self.asked_at[i] = None
        self.changed.set()

    async def _on_reply(self, msg: Msg) -> None:
        status = JetStreamContext.is_status_msg(msg)
        if status is None:  # a turn, on its stored subject: <prefix>.turns.<tenant>.<session>
            self.acks.append(await self.publisher.request(msg.reply, b"+ACK"))
            self.taken += 1
            i = self.tenants[msg.subject.split(".")[2]]
            self.got[i] += 1
            self.left[i] -= 1
            if self.left[i] == 0 and self.asked_at[i] is not None:
                self._end(i)
            return
        i = int(msg.subject.rpartition(".")[2])  # a status, on the pull's reply subject
        if status == "100" or self.asked_at[i] is None:  # a heartbeat, or a pull ended
            return
        if status in ("404", "408") and self.when_draining[i] and not self.got[i]:
            self.empty.add(i)
        self._end(i)


async def consume(url: str, index: int, tenants: int, partitions: int) -> str:
    """Take turns from ``go`` until the bench closes stdin and nothing is left: how
    many were acked, and the CPU seconds this process spent on them."""
    S = Subjects(turn_partitions=partitions)
    nc = await connect(NatsSettings(url=url), name=f"consumer-{index}")
    taker = Taker(nc, S, tenants_of(tenants))
    await taker.start()
    stdin = await started()
    cpu = time.process_time()

    async def publishers_done() -> None:
        await stdin.read()
        taker.drain()

    async with asyncio.TaskGroup() as tg:
        tg.create_task(publishers_done())
        await taker.take()
    spent = time.process_time() - cpu
    await taker.publisher.close()
    await nc.close()
    return f"{taker.taken} {spent}"  # every ack answered


# -- the bench ----------------------------------------------------------------------------


async def provision(nc: Client, S: Subjects, tenants: int, replicas: int) -> int:
    """The turns streams, each tenant's interactive-lane consumer, the routing checked;
    how many nodes lead the turns streams."""
    js = nc.jetstream()
    for stream in turns_streams(S, replicas=replicas):
        await ensure_stream(js, stream, placement_wait_s=30)
    await check_turn_partitions(nc, S)
    consumers = [
        tenant_consumer(S, t, ack_wait_s=QUIET_S, max_deliver=WORKER.max_deliveries)
        for t in tenants_of(tenants)
    ]
    await asyncio.gather(*(ensure_consumer(js, c) for c in consumers))
    infos = [await js.stream_info(name) for name in S.turns_streams]
    return len({info.cluster.leader if info.cluster else "" for info in infos})


async def measure(
    url: str, pids: list[int], args: argparse.Namespace, replicas: int, partitions: int
) -> dict[str, float]:
    S = Subjects(turn_partitions=partitions)
    nc = await connect(NatsSettings(url=url), name="turns-ceiling")
    leaders = await provision(nc, S, args.tenants, replicas)
    common = ("--url", url, "--seconds", str(args.seconds), "--tenants", str(args.tenants),
              "--partitions", str(partitions))  # fmt: skip
    publishers = [
        await bench_process(MODULE, "--publisher", str(i), *common, stdin=True)
        for i in range(args.publishers)
    ]
    consumers = [
        await bench_process(MODULE, "--consumer", str(i), *common, stdin=True)
        for i in range(args.consumers)
    ]
    procs = publishers + consumers
    for proc in procs:
        assert proc.stdout is not None and proc.stdin is not None
        if (await proc.stdout.readline()).strip() != b"ready":
            code = await proc.wait()
            raise RuntimeError(f"a {MODULE} process exited ({code}) before it was ready")
    cpu = servers_cpu(pids)
    started = time.perf_counter()
    for proc in procs:
        proc.stdin.write(b"go\n")  # type: ignore[union-attr]
    await asyncio.gather(*(proc.stdin.drain() for proc in procs))  # type: ignore[union-attr]
    published = await asyncio.gather(*(proc.communicate() for proc in publishers))
    for proc in procs:  # the consumers take what is left, then stop
        proc.stdin.close()  # type: ignore[union-attr]
    taken = await asyncio.gather(*(proc.communicate() for proc in consumers))
    wall = time.perf_counter() - started
    spent = servers_cpu(pids) - cpu
    js = nc.jetstream()
    left = sum([(await js.stream_info(name)).state.messages for name in S.turns_streams])
    await nc.close()
    if any(proc.returncode for proc in procs):
        raise RuntimeError(f"{MODULE} processes exited with {[p.returncode for p in procs]}")
    sent, sent_cpu = _sums(out for out, _ in published)
    acked, taken_cpu = _sums(out for out, _ in taken)
    return {
        "published": sent,
        "acked": acked,
        "left": left,
        "per_s": acked / wall,
        "cpu_us": spent / max(acked, 1) * 1e6,
        "publish_us": sent_cpu / max(acked, 1) * 1e6,
        "take_us": taken_cpu / max(acked, 1) * 1e6,
        "leaders": leaders,
    }


def _sums(outs: Any) -> tuple[int, float]:
    """The counts and CPU seconds the processes printed, each summed."""
    pairs = [out.decode().split() for out in outs]
    return sum(int(count) for count, _ in pairs), sum(float(cpu) for _, cpu in pairs)


def _nodes(leaders: float) -> str:
    return "1 leader node" if leaders == 1 else f"{leaders:.0f} leader nodes"


def _core(m: dict[str, float]) -> float:
    """The turns a second one core of server would carry at this cost."""
    return 1e6 / m["cpu_us"] if m["cpu_us"] else 0.0


def _row(partitions: int, m: dict[str, float]) -> str:
    return (
        f"| {partitions} ({_nodes(m['leaders'])}) | {m['per_s']:,.0f} | "
        f"{m['cpu_us']:.1f} | {_core(m):,.0f} | {m['publish_us']:.1f} + {m['take_us']:.1f} | "
        f"{m['acked']:,.0f} of {m['published']:,.0f} ({m['left']:,.0f} left) |"
    )


def _ratio(partitions: int, first: int, m: dict[str, float], one: dict[str, float]) -> str:
    clients, clients_one = m["publish_us"] + m["take_us"], one["publish_us"] + one["take_us"]
    return (
        f"| {partitions} over {first} | {m['per_s'] / one['per_s']:.2f}x | "
        f"{m['cpu_us'] / one['cpu_us']:.2f}x | {_core(m) / _core(one):.2f}x | "
        f"{clients / clients_one:.2f}x | |"
    )


def table(name: str, args: argparse.Namespace, results: dict[int, dict[str, float]]) -> str:
    first, *_ = results
    lines = [
        f"{name}: {args.publishers} publisher and {args.consumers} consumer processes, "
        f"{args.tenants} tenants, {args.seconds:g} s each, {os.cpu_count()} cores:",
        "| turn partitions | turns/s (published, taken, acked) "
        "| server CPU per turn (µs, all nodes) | one core's worth (turns/s) "
        "| clients' CPU per turn (µs: publishers + consumers) | acked of published |",
        "| --- | --- | --- | --- | --- | --- |",
        *(_row(n, m) for n, m in results.items()),
        *(_ratio(n, first, m, results[first]) for n, m in results.items() if n != first),
    ]
    return "\n".join(lines)


async def main(args: argparse.Namespace) -> None:
    r1: dict[int, dict[str, float]] = {}
    r3: dict[int, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for n in args.partitions:
            mappings = Subjects(turn_partitions=n).turn_mappings
            async with NatsServer(root / f"r1-{n}", mappings=mappings) as server:
                r1[n] = await measure(server.url, [server.pid or 0], args, 1, n)
        for n in args.partitions:
            mappings = Subjects(turn_partitions=n).turn_mappings
            async with NatsCluster(root / f"r3-{n}", mappings=mappings) as cluster:
                pids = [node.pid or 0 for node in cluster.nodes]
                r3[n] = await measure(cluster.url, pids, args, 3, n)
    print(table("R1, default sync", args, r1))
    print()
    print(table("R3 (3 nodes), default sync", args, r3))


if __name__ == "__main__":
    parser = ceiling_parser(__doc__, "[nats] turn_partitions")
    parser.add_argument("--consumers", type=at_least_one, default=2)
    parser.add_argument("--tenants", type=at_least_one, default=64)
    parser.add_argument("--consumer", type=int, default=None, help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.publisher is not None:
        [count] = a.partitions
        print(run(publish(a.url, a.publisher, a.seconds, a.tenants, count)))
    elif a.consumer is not None:
        [count] = a.partitions
        print(run(consume(a.url, a.consumer, a.tenants, count)))
    else:
        run(main(a))
