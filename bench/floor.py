"""The floor of a durable turn: its NATS messages alone, with no engine and no logic.

    python bench/floor.py [--turns 20000] [--concurrency 256]

A durable turn of ``bench/distributed.py`` (one echo call, then ``task_completion``)
sends and receives these messages from the loop worker, whatever the code around them:
the turn pulled from the turns stream, the order check, the lease taken, the control
read (and the snapshot's, on a session's first turn here: later ones are warm), the
tool request and its reply, two checkpoints, fifteen events (one with an ack), the
lease released and the turn acked. This script does exactly
those, through the same plumbing the loop worker uses (``Publisher``, ``KV``,
nats-py's publish), against the real streams and buckets, with an immediate responder in its own
process standing in for the tool worker. It prints the CPU time per turn of this
process, of nats-server and of the responder: what the distributed path costs before
any of loopmesh's own work, to set beside the in-process engine's CPU per turn.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import subprocess
import sys
import tempfile
import time
from asyncio.subprocess import Process
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.harness import Load, local_engine  # noqa: E402
from loopmesh.aio import both, run  # noqa: E402
from loopmesh.jetstream import KV, Publisher, acked, answered  # noqa: E402
from loopmesh.nats import connect  # noqa: E402
from loopmesh.provision import ensure_bucket  # noqa: E402
from loopmesh.server import NatsServer  # noqa: E402
from loopmesh.settings import NatsSettings, RuntimeConfig, load  # noqa: E402
from loopmesh.testing.durable import provision_short, tenant_consumer_of  # noqa: E402
from schemas import Subjects  # noqa: E402
from schemas.streams import KVDef  # noqa: E402

S = Subjects()
TENANT = "t"
TOOL = S.tool("local", "local", "echo")
EVENTS = [  # the events of one turn, as the in-process engine emits them
    "loop_start", "loop_iteration", "context_budget", "llm_request", "llm_response",
    "tool_call", "tool_result", "loop_iteration", "context_budget", "llm_request",
    "llm_response", "tool_call", "message", "tool_result", "loop_end",
]  # fmt: skip
PAYLOAD = b'{"type":"x","tenant":"t","session":"s","turn_id":"x","ts":1.0,"n":"' + b"x" * 200
SNAPSHOT = b"s" * 1500


def ticks(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def respond(url: str) -> None:
    nc = await connect(NatsSettings(url=url), name="floor-responder")

    async def on_call(msg: Any) -> None:
        await nc.publish(msg.reply, b'{"ok":true,"result":"hi"}')

    await nc.subscribe(TOOL, cb=on_call)
    await nc.flush()
    print("ready", flush=True)
    await asyncio.Event().wait()


MARKERS: dict[str, int] = {}  # session → its lease's delete marker, as the worker keeps
REVISIONS: dict[str, int] = {}  # session → its snapshot's revision, as the worker keeps


async def turn(pub: Publisher, kv: dict[str, KV], n: int, session: str) -> None:
    lease_key = f"t.{session}"
    marker = MARKERS.pop(lease_key, 0)
    _, lease = await both(
        pub.first_seq(S.turns_stream, S.turn(TENANT, session)),
        kv["leases"].update(lease_key, b"w", marker),
    )
    if marker:  # the lease continued: the snapshot kept at the last turn's end serves
        await kv["control"].entry(lease_key)
        rev = REVISIONS[lease_key]
    else:
        _, snapshot = await both(kv["control"].entry(lease_key), kv["sessions"].entry(lease_key))
        rev = snapshot.revision if snapshot is not None else 0
    for i, event in enumerate(EVENTS):
        subject = S.event(TENANT, session, event)
        if event == "loop_end":
            await acked(pub, subject, PAYLOAD, {"Nats-Msg-Id": f"{n}:{i}:{event}"})
            continue
        await pub.nc.publish(subject, PAYLOAD, headers={"Nats-Msg-Id": f"{n}:{i}:{event}"})
        if i == 5:
            await answered(pub, TOOL, b'{"call_id":"c","arguments":{"text":"hi"}}')
        if i in (6, 13):
            rev = await kv["sessions"].update(lease_key, SNAPSHOT, rev)
    REVISIONS[lease_key] = rev
    MARKERS[lease_key] = await kv["leases"].delete(lease_key, lease)


async def drive(
    args: argparse.Namespace, nc: Any, server_pid: int | None, responder: Process
) -> tuple[float, list[float], int]:
    """Publish the turns, then run them ``args.concurrency`` at once (a session's turns
    one after another, as the loop worker does); wall time, CPU seconds of this process,
    nats-server and the responder, and the turns done."""
    assert responder.stdout is not None and server_pid is not None
    await responder.stdout.readline()
    js = nc.jetstream()
    for n in range(args.turns):
        await js.publish(S.turn(TENANT, f"s{n % args.concurrency}"), b"{}")
    pub = Publisher(nc)
    await pub.start()
    kv = {
        "leases": KV(pub, S.leases_bucket),
        "sessions": KV(pub, S.sessions_bucket),
        "control": KV(pub, S.control_bucket),
    }
    sub = await js.pull_subscribe_bind(S.tenant_consumer(TENANT), S.turns_stream)
    room = asyncio.Semaphore(args.concurrency)
    in_order = collections.defaultdict(asyncio.Lock)
    done = 0

    async def one(msg: Any, n: int) -> None:
        nonlocal done
        try:
            session = msg.subject.rsplit(".", 1)[1]
            async with in_order[session]:
                await turn(pub, kv, n, session)
            await answered(pub, msg.reply, b"+ACK")
            done += 1
        finally:
            room.release()

    pids = [os.getpid(), server_pid, responder.pid]
    start, before = time.perf_counter(), [ticks(p) for p in pids]
    n = 0
    async with asyncio.TaskGroup() as tg:
        while n < args.turns:
            for msg in await sub.fetch(64, timeout=5):
                await room.acquire()
                tg.create_task(one(msg, n))
                n += 1
    wall = time.perf_counter() - start
    return wall, [ticks(p) - b for p, b in zip(pids, before, strict=True)], done


@dataclass(frozen=True)
class Floor:
    turns: int
    wall_s: float
    concurrency: int
    per_turn_ms: list[float]  # CPU: loop-worker side, nats-server, tool responder
    engine_ms: float  # the in-process engine's CPU per turn
    local_rate: float  # its turns/s

    @property
    def one_process(self) -> float:
        """At most this share of in-process throughput from one loop-worker process."""
        return self.engine_ms / (self.engine_ms + self.per_turn_ms[0])

    @property
    def shared(self) -> float:
        """At most this share with every process sharing the machine's cores."""
        cores = os.cpu_count() or 1
        return min(1.0, cores * self.engine_ms / (self.engine_ms + sum(self.per_turn_ms)))

    @property
    def bound(self) -> float:
        return min(self.one_process, self.shared)


async def measure(args: argparse.Namespace) -> Floor:
    with tempfile.TemporaryDirectory(prefix="loopmesh-floor-") as tmp:
        async with NatsServer(Path(tmp)) as server:
            nc = await connect(NatsSettings(url=server.url), name="floor")
            await provision_short(nc, lease_ttl_s=30.0)
            js = nc.jetstream()
            await tenant_consumer_of(nc, TENANT, ack_wait_s=30.0)
            await ensure_bucket(js, KVDef(bucket=S.leases_bucket, ttl_s=30.0))
            responder = await asyncio.create_subprocess_exec(
                sys.executable, __file__, "--respond", server.url, stdout=subprocess.PIPE
            )
            try:
                wall, cpu, done = await drive(args, nc, server.pid, responder)
            finally:
                responder.kill()
                await responder.wait()
                await nc.close()
    engine, _ = local_engine(1)
    load = Load(per_session=4, total=args.turns)
    await load.warm_up(engine.run, "w")
    local_start = ticks(os.getpid())
    local_rate = await load.run(engine.run, args.concurrency, "l")
    turns = args.concurrency * load.turns_each(args.concurrency)
    local = (ticks(os.getpid()) - local_start) / turns
    return Floor(
        turns=done, wall_s=wall, concurrency=args.concurrency,
        per_turn_ms=[c / done * 1000 for c in cpu], engine_ms=local * 1000,
        local_rate=local_rate,
    )  # fmt: skip


def report(f: Floor) -> str:
    per, engine_ms = f.per_turn_ms, f.engine_ms
    return "\n".join(
        [
            f"{f.turns} turns in {f.wall_s:.1f} s: {f.turns / f.wall_s:.0f} turns/s, "
            f"{f.concurrency} at once",
            "CPU per turn, ms: the messages of a durable turn, with no engine",
            f"  loop-worker side   {per[0]:.3f}",
            f"  nats-server        {per[1]:.3f}",
            f"  tool responder     {per[2]:.3f}",
            f"  all                {sum(per):.3f}",
            f"and the in-process engine, on bench/distributed.py's turns: {engine_ms:.3f} ms "
            f"({f.local_rate:.0f} turns/s)",
            "so a loop worker that ran the engine and only these messages would spend at "
            f"least {engine_ms + per[0]:.3f} ms per turn: at most {f.one_process:.0%} of "
            "in-process throughput from one loop-worker process",
            f"and with every process sharing {os.cpu_count() or 1} cores, at most "
            f"{f.shared:.0%} (tool worker and load generator not counted)",
        ]
    )


async def main(args: argparse.Namespace) -> None:
    print(report(await measure(args)))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--turns", type=int, default=20000)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--respond", help=argparse.SUPPRESS)
    a = parser.parse_args()
    event_loop = load(RuntimeConfig).runtime.event_loop  # LOOPMESH_RUNTIME__EVENT_LOOP
    run(respond(a.respond) if a.respond else main(a), event_loop=event_loop)
