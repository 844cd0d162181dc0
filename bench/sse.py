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

    python bench/sse.py --floor raw|sse-starlette [--clients 500] [--turns 20]

the same run, but the SSE clients read from a bare uvicorn + Starlette process (this
file with ``--floor-server``) instead of the gateway: one core NATS subscription on the
session, each event's frame encoded once and written to every client (``raw``), or
each client's events sent through sse-starlette's ``EventSourceResponse`` (what the
gateway used before). The floor of the HTTP side on this machine: what no gateway
change below the HTTP server can beat.

    python bench/sse.py --events 200 --event-rate 20 [--clients 500]

publishes ``--events`` content deltas (stamped with their send time) straight to the
session at ``--event-rate`` a second instead of running turns: a steady load at a
chosen rate rather than a turn's bursts.

    python bench/sse.py --nats-fanout [--clients 500]

measures only the NATS half of the gateway's fan-out: ``--clients`` event streams on
one session, in this process, with the gateway's own ``Fanout`` and ``EventStream``
(one shared ordered consumer); it prints this process's CPU per event delivered to one
stream.
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
            print("counted", flush=True)  # the driver posts the turn only then
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
            watched, floor = base, None
            if args.floor:
                floor = await asyncio.create_subprocess_exec(
                    sys.executable, str(SELF), "--floor-server", args.floor,
                    "--nats-url", mesh.server.url, "--session", "watched",
                    stdout=asyncio.subprocess.PIPE,
                    env={**os.environ, "PYTHONPATH": str(ROOT)},
                )  # fmt: skip
                assert floor.stdout is not None
                line = (await asyncio.wait_for(floor.stdout.readline(), 60)).decode()
                assert line.startswith("floor http://"), line
                watched = line.split()[1]
            clients = await asyncio.create_subprocess_exec(
                sys.executable, str(SELF), "--clients-process",
                "--url", watched, "--session", "watched", "--clients", str(args.clients),
                "--nats-url", mesh.server.url,
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
            )  # fmt: skip
            assert clients.stdin is not None and clients.stdout is not None
            line = (await asyncio.wait_for(clients.stdout.readline(), 180)).decode()
            assert line.startswith("connected"), line
            print(f"{args.clients} SSE clients connected to one session "
                  f"({'floor: ' + args.floor if floor else 'gateway'})", flush=True)  # fmt: skip

            pids = {
                "gateway": pid_of(gateway), "SSE clients": clients.pid,
                "loop worker (instant LLM)": pid_of(worker), "tool worker": pid_of(tools),
                "nats-server": mesh.server.pid or 0, "driver": os.getpid(),
            }  # fmt: skip
            if floor is not None:
                pids[f"floor server ({args.floor})"] = floor.pid
            meter = CpuMeter(pids)
            posted: dict[str, float] = {}
            if args.events:
                await publish_events(args, mesh, clients.stdin, clients.stdout, meter)
            else:
                await post_turns(args, http, clients.stdin, clients.stdout, meter, posted)
                # the last turn's events reach everyone: wait until its loop_end is stored
                await wait_turns_done(http, args.turns + WARM_UP)
            await asyncio.sleep(1.0)  # and for the deliveries still in flight
            meter.stop()
            starts_ts = await loop_start_ts(http, posted) if posted else {}
            clients.stdin.write(b"stop\n")
            await clients.stdin.drain()
            out = await asyncio.wait_for(clients.stdout.read(), 120)
            await clients.wait()
            if floor is not None:
                floor.kill()
                await floor.wait()
    result = json.loads(out.decode().split("RESULT ", 1)[1])
    report(args, result, posted, starts_ts, meter)


async def count(to_clients: Any, from_clients: Any, turn_id: str) -> None:
    """Have the clients count ``turn_id``'s events, from before the first is published."""
    to_clients.write(f"count {turn_id}\n".encode())
    await to_clients.drain()
    line = await asyncio.wait_for(from_clients.readline(), 60)
    assert line.startswith(b"counted"), line


async def post_turns(
    args: argparse.Namespace,
    http: Any,
    to_clients: Any,
    from_clients: Any,
    meter: Any,
    posted: dict[str, float],
) -> None:
    text = f"go\necho {args.echo}"
    for i in range(args.turns + WARM_UP):
        if i == WARM_UP:
            meter.start()
        turn_id = f"t{i}"
        if i >= WARM_UP:
            await count(to_clients, from_clients, turn_id)
        started = time.time()
        r = await http.post(
            "/v1/sessions/watched/turns", json={"input": text},
            headers={"Idempotency-Key": turn_id},
        )  # fmt: skip
        assert r.status_code == 202, r.text
        if i >= WARM_UP:
            posted[turn_id] = started
        await asyncio.sleep(max(0.0, 1 / args.rate - (time.time() - started)))


async def publish_events(
    args: argparse.Namespace, mesh: Any, to_clients: Any, from_clients: Any, meter: Any
) -> None:
    """``--events`` content deltas at ``--event-rate``, as a worker would publish them."""
    from schemas import Subjects, encode
    from schemas.events import ContentDelta

    await count(to_clients, from_clients, "steady")
    js = mesh.nc.jetstream()
    subject = Subjects().event("local", "watched", "content_delta")
    meter.start()
    started = time.perf_counter()
    for i in range(args.events):
        event = ContentDelta(
            tenant="local", session="watched", turn_id="steady", iteration=i,
            text="x" * 40, ts=time.time(),
        )  # fmt: skip
        await js.publish(subject, encode(event))
        await asyncio.sleep(max(0.0, started + (i + 1) / args.event_rate - time.perf_counter()))


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
    served = f"floor server ({args.floor})" if args.floor else "gateway"
    if args.events:
        print(f"\n{args.clients} SSE clients ({served}), one session, {args.events} events "
              f"at {args.event_rate:g}/s; {deliveries} deliveries")  # fmt: skip
    else:
        print(f"\n{args.clients} SSE clients ({served}), one session, {args.turns} turns at "
              f"{args.rate:g}/s, {args.echo} echo call(s) each; {deliveries} deliveries "
              f"({deliveries / max(1, args.clients * args.turns):.1f} events per turn)"
              )  # fmt: skip
    if result["errors"]:
        print(f"client errors: {result['errors']}")
    print(f"event delivery latency (ts -> client): p50 {pct(lat, 50):.1f} ms, "
          f"p99 {pct(lat, 99):.1f} ms, max {lat[-1] if lat else float('nan'):.1f} ms "
          f"(goal: p99 <= 50 ms)")  # fmt: skip
    nats_ms = result["nats_ms"]
    print(f"  the same for one plain NATS subscriber: p50 {pct(nats_ms, 50):.1f} ms, "
          f"p99 {pct(nats_ms, 99):.1f} ms (what is not the gateway's)")  # fmt: skip
    if not posted:
        to_ts = to_rx = []
    print(f"turn POST -> loop_start ts:          p50 {pct(to_ts, 50):.1f} ms, "
          f"p99 {pct(to_ts, 99):.1f} ms")  # fmt: skip
    print(f"turn POST -> loop_start at clients:  p50 {pct(to_rx, 50):.1f} ms, "
          f"p99 {pct(to_rx, 99):.1f} ms")  # fmt: skip
    print(f"\nCPU seconds over {meter.wall:.1f} s:")
    for name, seconds in sorted(meter.spent.items(), key=lambda kv: -kv[1]):
        print(f"  {name:28} {seconds:6.2f} s  ({seconds / meter.wall * 100:5.1f}% of a core)")
    server = f"floor server ({args.floor})" if args.floor else "gateway"
    spent = meter.spent.get(server, 0.0)
    if deliveries:
        print(f"{server} CPU per delivered SSE message: {spent / deliveries * 1e6:.1f} µs")


async def nats_fanout(args: argparse.Namespace) -> None:
    import tempfile

    from gateway.backend import Backend
    from gateway.fanout import Fanout
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
        fanout = Fanout(Backend(nc, Subjects()))
        streams = [EventStream(fanout, "local", "s1", after=None) for _ in range(args.clients)]
        for stream in streams:
            await stream.__aenter__()
        got = 0
        done = asyncio.Event()

        async def drain(stream: EventStream) -> None:
            nonlocal got
            async for chunk in stream.chunks():
                got += chunk.count(b"\r\nid: ") + chunk.startswith(b"id: ")
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
        await asyncio.gather(*readers, return_exceptions=True)
        for stream in streams:
            await stream.close()
        print(
            f"{args.clients} event streams on one session (one shared ordered consumer), "
            f"{events} events: "
            f"{got} deliveries in {wall:.1f} s; this process {cpu:.2f} CPU s = "
            f"{cpu / got * 1e6:.0f} µs per delivery (NATS side only, incl. the publisher)"
        )
        await publisher.close()
        await nc.close()


# -- the floor: a bare uvicorn + Starlette SSE server -----------------------------------


async def floor_main(args: argparse.Namespace) -> None:
    """Serve ``GET /v1/sessions/{session}/events`` from one core NATS subscription."""
    import nats
    import uvicorn
    from sse_starlette import EventSourceResponse, ServerSentEvent
    from starlette.applications import Starlette
    from starlette.routing import Route

    class Listener:
        def __init__(self) -> None:
            self.queue: list[Any] = []
            self.arrived = asyncio.Event()

    listeners: set[Listener] = set()

    async def on_event(msg: Any) -> None:
        event = msg.subject.rpartition(".")[2]
        if args.floor_server == "raw":
            payload: Any = b"event: %s\r\ndata: %s\r\n\r\n" % (event.encode(), msg.data)
        else:
            payload = (event, msg.data)
        for listener in listeners:
            listener.queue.append(payload)
            listener.arrived.set()

    nc = await nats.connect(args.nats_url)
    await nc.subscribe(f"loopmesh.events.local.{args.session}.*", cb=on_event)

    async def raw(scope: Any, receive: Any, send: Any) -> None:
        headers = [(b"content-type", b"text/event-stream; charset=utf-8")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        me = Listener()
        listeners.add(me)
        try:
            while True:
                await me.arrived.wait()
                me.arrived.clear()
                body = b"".join(me.queue)
                me.queue.clear()
                await send({"type": "http.response.body", "body": body, "more_body": True})
        finally:
            listeners.discard(me)

    async def starlette_sse(request: Any) -> Any:
        me = Listener()
        listeners.add(me)

        async def items() -> Any:
            try:
                while True:
                    await me.arrived.wait()
                    me.arrived.clear()
                    batch = list(me.queue)
                    me.queue.clear()
                    for event, data in batch:
                        yield ServerSentEvent(data=data.decode(), event=event)
            finally:
                listeners.discard(me)

        return EventSourceResponse(items())

    if args.floor_server == "raw":
        app: Any = raw
    else:
        path = "/v1/sessions/{session}/events"
        app = Starlette(routes=[Route(path, starlette_sse, methods=["GET"])])
    config = uvicorn.Config(
        app, host="127.0.0.1", port=0, log_config=None, access_log=False, lifespan="off"
    )
    server = uvicorn.Server(config)
    serving = asyncio.ensure_future(server.serve())
    while not server.started:
        if serving.done():
            serving.result()
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    print(f"floor http://127.0.0.1:{port}", flush=True)
    await serving


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", type=int, default=500)
    parser.add_argument("--turns", type=int, default=30)
    parser.add_argument("--rate", type=float, default=1.0, help="turns posted per second")
    parser.add_argument("--echo", type=int, default=2, help="tool calls per turn")
    parser.add_argument("--nats-fanout", action="store_true", help="the NATS half alone")
    parser.add_argument(
        "--floor", choices=("raw", "sse-starlette"), help="clients read a bare uvicorn server"
    )
    parser.add_argument("--events", type=int, default=0, help="publish events, not turns")
    parser.add_argument("--event-rate", type=float, default=20.0, help="events per second")
    parser.add_argument("--floor-server", help=argparse.SUPPRESS)
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
    elif args.floor_server:
        from loopmesh.aio import run

        run(floor_main(args))
    elif args.nats_fanout:
        asyncio.run(nats_fanout(args))
    else:
        asyncio.run(driver(args))


if __name__ == "__main__":
    main()
