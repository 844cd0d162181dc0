"""SSE fan-out: many clients watching one session through the gateway. Run by hand:

    python bench/sse.py [--clients 500] [--turns 30] [--rate 1] [--echo 2]

Everything is a real process on this machine: an embedded nats-server, a tool worker
(``bench.tools`` echo), a loop worker whose model answers at once
(``bench.instant_worker``), ``loopmesh gateway`` (no auth, loopback, stream and rate
caps lifted), and the SSE clients: ``--clients`` event streams on ONE session, all in
one other process (this file with ``--clients-process``; uvloop, raw sockets, so the
clients cost as little CPU as they can). This process posts ``--turns`` turns over
HTTP, ``--rate`` per second, each making ``--echo`` tool calls (about 6 events per
iteration), and prints:

- event delivery latency, p50/p99/max over every (client, event): a client's receipt
  time minus the event's ``ts`` (set by the loop or tool worker as it publishes it);
- HTTP turn submission (the POST sent) to ``loop_start``: to the worker's ``ts`` on
  the event, and to the receipt by the clients (every client's receipt counts);
- the same latency for one plain NATS subscriber on the session's events in the
  clients' process: the part of the delay that is not the gateway's;
- CPU seconds of each process over the measured run, beside the figures, and the
  gateway's CPU per delivered SSE message.

The first two turns warm up and are not counted. Same clock for all (one machine).

    python bench/sse.py --nats-fanout [--clients 500]

measures only the NATS half of the gateway's fan-out: ``--clients`` ordered consumers
(each SSE stream has one) on one session, in this process, with the gateway's own
``EventStream``; it prints this process's CPU per event delivered to one consumer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import resource
import sys
import time
from array import array
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import msgspec  # noqa: E402

WARM_UP = 2
SELF = Path(__file__).resolve()


class _Head(msgspec.Struct):
    type: str = ""
    turn_id: str = ""
    ts: float = 0.0


# -- the clients' process ---------------------------------------------------------------


class Clients:
    def __init__(self, host: str, port: int, path: str, count: int) -> None:
        self.host, self.port, self.path, self.count = host, port, path, count
        self.latencies_ms = array("d")
        self.nats_ms = array("d")  # the same, for one core-NATS subscriber
        self.starts: dict[str, list[float]] = {}  # turn id -> receipts of its loop_start
        self.counted: set[str] = set()  # turns whose events count (past the warm-up)
        self.connected = 0
        self.all_connected = asyncio.Event()
        self.messages = 0
        self.errors: list[str] = []
        self._decode = msgspec.json.Decoder(_Head).decode

    async def client(self) -> None:
        reader, writer = await asyncio.open_connection(self.host, self.port, limit=1 << 20)
        request = (
            f"GET {self.path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            "Accept: text/event-stream\r\n\r\n"
        )
        writer.write(request.encode())
        status = await reader.readline()
        if b" 200 " not in status:
            self.errors.append(status.decode().strip())
            writer.close()
            return
        chunked = False
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            chunked |= line.lower().startswith(b"transfer-encoding: chunked")
        self.connected += 1
        if self.connected == self.count:
            self.all_connected.set()
        pending = b""
        try:
            while True:
                if chunked:
                    size = int((await reader.readline()).split(b";")[0], 16)
                    if size == 0:
                        return
                    data = (await reader.readexactly(size + 2))[:-2]
                else:
                    data = await reader.read(65536)
                    if not data:
                        return
                now = time.time()
                pending += data
                while True:
                    end = pending.find(b"\r\n\r\n")
                    if end < 0:
                        break
                    block, pending = pending[:end], pending[end + 4 :]
                    self._message(block, now)
        finally:
            writer.close()

    def _message(self, block: bytes, now: float) -> None:
        for line in block.split(b"\r\n"):
            if line.startswith(b"data: "):
                head = self._decode(line[6:])
                self.messages += 1
                if head.type == "loop_start":
                    self.starts.setdefault(head.turn_id, []).append(now)
                if head.turn_id in self.counted:
                    self.latencies_ms.append((now - head.ts) * 1000)
                return


async def clients_main(args: argparse.Namespace) -> None:
    host, port = re.match(r"http://([^:/]+):(\d+)", args.url).groups()  # type: ignore[union-attr]
    path = f"/v1/sessions/{args.session}/events"
    clients = Clients(host, int(port), path, args.clients)
    import nats

    nc = await nats.connect(args.nats_url)

    async def on_nats(msg: Any) -> None:
        now = time.time()
        head = clients._decode(msg.data)
        if head.turn_id in clients.counted:
            clients.nats_ms.append((now - head.ts) * 1000)

    await nc.subscribe(f"loopmesh.events.local.{args.session}.*", cb=on_nats)
    tasks = [asyncio.ensure_future(clients.client()) for _ in range(args.clients)]
    await asyncio.wait_for(clients.all_connected.wait(), 120)
    print(f"connected {clients.connected}", flush=True)
    loop = asyncio.get_running_loop()
    while True:  # commands from the driver, one a line
        line = (await loop.run_in_executor(None, sys.stdin.readline)).strip()
        if line.startswith("count "):
            clients.counted.add(line.split()[1])
        elif line == "stop" or not line:
            break
    usage = resource.getrusage(resource.RUSAGE_SELF)
    await nc.close()
    for task in tasks:
        task.cancel()
    result = {
        "latencies_ms": sorted(clients.latencies_ms),
        "nats_ms": sorted(clients.nats_ms),
        "starts": clients.starts,
        "messages": clients.messages,
        "errors": clients.errors[:5],
        "cpu_s": usage.ru_utime + usage.ru_stime,
    }
    print("RESULT " + json.dumps(result), flush=True)


# -- the driver -------------------------------------------------------------------------


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    return values[min(len(values) - 1, int(len(values) * p / 100))]


async def driver(args: argparse.Namespace) -> None:
    import tempfile

    import httpx

    from bench.harness import CpuMeter, Mesh, pid_of
    from loopmesh.testing.durable import Proc

    store = Path(tempfile.mkdtemp(prefix="bench-sse-"))
    async with Mesh(store, ack_wait_s=30, lease_ttl_s=30) as mesh:
        tools = await mesh.tool_worker(concurrency=64)
        worker = await mesh.instant_worker("w1", iterations=args.echo)
        gateway = Proc(
            "-m", "loopmesh", "gateway", "--nats-url", mesh.server.url, "--no-auth", "--port", "0",
            env={
                "LOOPMESH_GATEWAY__MAX_STREAMS_PER_KEY": str(args.clients + 10),
                "LOOPMESH_GATEWAY__RATE_PER_S": "100000",
                "LOOPMESH_GATEWAY__RATE_BURST": "100000",
            },
        )  # fmt: skip
        mesh.procs.append(gateway)
        await gateway.start("gateway   http")
        url = re.search(r"gateway\s+(http://\S+)", await gateway.wait_line("gateway   http"))
        assert url is not None
        base = url.group(1)
        async with httpx.AsyncClient(base_url=base, timeout=60) as http:
            r = await http.post("/v1/sessions", json={"session": "watched"})
            assert r.status_code == 201, r.text
            clients = await asyncio.create_subprocess_exec(
                sys.executable, str(SELF), "--clients-process",
                "--url", base, "--session", "watched", "--clients", str(args.clients),
                "--nats-url", mesh.server.url,
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
            )  # fmt: skip
            assert clients.stdin is not None and clients.stdout is not None
            line = (await asyncio.wait_for(clients.stdout.readline(), 180)).decode()
            assert line.startswith("connected"), line
            print(f"{args.clients} SSE clients connected to one session", flush=True)

            meter = CpuMeter({
                "gateway": pid_of(gateway), "SSE clients": clients.pid,
                "loop worker (instant LLM)": pid_of(worker), "tool worker": pid_of(tools),
                "nats-server": mesh.server.pid or 0, "driver": os.getpid(),
            })  # fmt: skip
            posted: dict[str, float] = {}
            text = f"go\necho {args.echo}"
            for i in range(args.turns + WARM_UP):
                if i == WARM_UP:
                    meter.start()
                turn_id = f"t{i}"
                if i >= WARM_UP:
                    clients.stdin.write(f"count {turn_id}\n".encode())
                    await clients.stdin.drain()
                started = time.time()
                r = await http.post(
                    "/v1/sessions/watched/turns", json={"input": text},
                    headers={"Idempotency-Key": turn_id},
                )  # fmt: skip
                assert r.status_code == 202, r.text
                if i >= WARM_UP:
                    posted[turn_id] = started
                await asyncio.sleep(max(0.0, 1 / args.rate - (time.time() - started)))
            # the last turn's events reach everyone: wait until its loop_end is stored
            await wait_turns_done(http, args.turns + WARM_UP)
            await asyncio.sleep(1.0)  # and for the deliveries still in flight
            meter.stop()
            starts_ts = await loop_start_ts(http, posted)
            clients.stdin.write(b"stop\n")
            await clients.stdin.drain()
            out = await asyncio.wait_for(clients.stdout.read(), 120)
            await clients.wait()
    result = json.loads(out.decode().split("RESULT ", 1)[1])
    report(args, result, posted, starts_ts, meter)


async def wait_turns_done(http: Any, turns: int) -> None:
    async with asyncio.timeout(120):
        while True:
            session = (await http.get("/v1/sessions/watched")).json()
            if session["status"] == "idle" and session["turns"] >= turns:
                return
            await asyncio.sleep(0.2)


async def loop_start_ts(http: Any, posted: dict[str, float]) -> dict[str, float]:
    """Each counted turn's loop_start ``ts``, from the stored events (one more stream)."""
    found: dict[str, float] = {}
    async with http.stream("GET", "/v1/sessions/watched/events?since=0") as s:
        async for line in s.aiter_lines():
            if line.startswith("data: "):
                event = json.loads(line[6:])
                if event["type"] == "loop_start" and event["turn_id"] in posted:
                    found[event["turn_id"]] = event["ts"]
                if event["type"] == "loop_end" and len(found) == len(posted):
                    break
    return found


def report(
    args: argparse.Namespace,
    result: dict[str, Any],
    posted: dict[str, float],
    starts_ts: dict[str, float],
    meter: Any,
) -> None:
    lat = result["latencies_ms"]
    to_ts = sorted((starts_ts[t] - posted[t]) * 1000 for t in posted if t in starts_ts)
    to_rx = sorted((rx - posted[t]) * 1000 for t in posted for rx in result["starts"].get(t, []))
    deliveries = len(lat)
    print(f"\n{args.clients} SSE clients, one session, {args.turns} turns at {args.rate:g}/s, "
          f"{args.echo} echo call(s) each; {deliveries} deliveries "
          f"({deliveries / max(1, args.clients * args.turns):.1f} events per turn)")  # fmt: skip
    if result["errors"]:
        print(f"client errors: {result['errors']}")
    print(f"event delivery latency (ts -> client): p50 {pct(lat, 50):.1f} ms, "
          f"p99 {pct(lat, 99):.1f} ms, max {lat[-1] if lat else float('nan'):.1f} ms "
          f"(goal: p99 <= 50 ms)")  # fmt: skip
    nats_ms = result["nats_ms"]
    print(f"  the same for one plain NATS subscriber: p50 {pct(nats_ms, 50):.1f} ms, "
          f"p99 {pct(nats_ms, 99):.1f} ms (what is not the gateway's)")  # fmt: skip
    print(f"turn POST -> loop_start ts:          p50 {pct(to_ts, 50):.1f} ms, "
          f"p99 {pct(to_ts, 99):.1f} ms")  # fmt: skip
    print(f"turn POST -> loop_start at clients:  p50 {pct(to_rx, 50):.1f} ms, "
          f"p99 {pct(to_rx, 99):.1f} ms")  # fmt: skip
    print(f"\nCPU seconds over {meter.wall:.1f} s:")
    for name, seconds in sorted(meter.spent.items(), key=lambda kv: -kv[1]):
        print(f"  {name:28} {seconds:6.2f} s  ({seconds / meter.wall * 100:5.1f}% of a core)")
    gw = meter.spent.get("gateway", 0.0)
    if deliveries:
        print(f"gateway CPU per delivered SSE message: {gw / deliveries * 1e6:.0f} µs")


async def nats_fanout(args: argparse.Namespace) -> None:
    import tempfile

    from gateway.backend import Backend
    from gateway.stream import EventStream
    from loopmesh.nats import connect
    from loopmesh.server import NatsServer
    from loopmesh.settings import NatsSettings
    from loopmesh.testing.durable import provision_short
    from schemas import Subjects

    events = 200
    async with NatsServer(Path(tempfile.mkdtemp(prefix="bench-fanout-"))) as server:
        nc = await connect(NatsSettings(url=server.url), name="fanout")
        await provision_short(nc)
        backend = Backend(nc, Subjects())
        streams = [EventStream(backend, "local", "s1", after=None) for _ in range(args.clients)]
        for stream in streams:
            await stream.__aenter__()
        got = 0
        done = asyncio.Event()

        async def drain(stream: EventStream) -> None:
            nonlocal got
            async for _ in stream:
                got += 1
                if got == events * args.clients:
                    done.set()

        readers = [asyncio.ensure_future(drain(s)) for s in streams]
        publisher = await connect(NatsSettings(url=server.url), name="publisher")
        before = resource.getrusage(resource.RUSAGE_SELF)
        started = time.perf_counter()
        for _ in range(events):
            await publisher.jetstream().publish("loopmesh.events.local.s1.x", b'{"turn_id":"t"}')
        await asyncio.wait_for(done.wait(), 300)
        after = resource.getrusage(resource.RUSAGE_SELF)
        wall = time.perf_counter() - started
        cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
        for reader in readers:
            reader.cancel()
        print(
            f"{args.clients} ordered consumers on one session, {events} events: "
            f"{got} deliveries in {wall:.1f} s; this process {cpu:.2f} CPU s = "
            f"{cpu / got * 1e6:.0f} µs per delivery (NATS side only, incl. the publisher)"
        )
        await publisher.close()
        await nc.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", type=int, default=500)
    parser.add_argument("--turns", type=int, default=30)
    parser.add_argument("--rate", type=float, default=1.0, help="turns posted per second")
    parser.add_argument("--echo", type=int, default=2, help="tool calls per turn")
    parser.add_argument("--nats-fanout", action="store_true", help="the NATS half alone")
    parser.add_argument("--clients-process", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--nats-url", help=argparse.SUPPRESS)
    parser.add_argument("--session", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.clients_process:
        try:
            import uvloop

            uvloop.run(clients_main(args))
        except ImportError:
            asyncio.run(clients_main(args))
    elif args.nats_fanout:
        asyncio.run(nats_fanout(args))
    else:
        asyncio.run(driver(args))


if __name__ == "__main__":
    main()
