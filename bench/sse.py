"""SSE fan-out: many clients watching one session through the gateway. Run by hand:

    python bench/sse.py [--clients 500] [--turns 30] [--rate 1] [--echo 2]

Everything is a real process on this machine: an embedded nats-server, a tool worker
(``bench.tools`` echo), a loop worker whose model answers at once
(``bench.instant_worker``), ``loopmesh gateway`` (no auth, loopback, stream and rate
caps lifted), and the SSE clients: ``--clients`` event streams on ONE session, all in
one other process (``bench/sse_clients.py``; uvloop, raw sockets, so the clients cost
as little CPU as they can). This process posts ``--turns`` turns over
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

the same run, but the SSE clients read from a bare uvicorn + Starlette process
(``bench/sse_floor.py``) instead of the gateway: one core NATS subscription on the
session, each event's frame encoded once and written to every client (``raw``), or
each client's events sent through sse-starlette's ``EventSourceResponse`` (the cost the
gateway's pre-encoded frames avoid). The floor of the HTTP side on the machine it runs
on: what no gateway change below the HTTP server can beat.

    python bench/sse.py --events 200 --event-rate 20 [--clients 500]

publishes ``--events`` content deltas (stamped with their send time) straight to the
session at ``--event-rate`` a second instead of running turns: a steady load at a
chosen rate rather than a turn's bursts.

    python bench/sse.py --nats-fanout [--clients 500]

measures only the NATS half of the gateway's fan-out (``bench/sse_fanout.py``):
``--clients`` event streams on one session, in this process, with the gateway's own
``Fanout`` and ``EventStream`` (one shared ordered consumer); it prints this process's
CPU per event delivered to one stream.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WARM_UP = 2
CLIENTS = ROOT / "bench" / "sse_clients.py"
FLOOR = ROOT / "bench" / "sse_floor.py"


def unlimited(streams: int) -> dict[str, str]:
    """The gateway's settings for a bench: ``streams`` SSE streams per key, rates lifted."""
    return {
        "LOOPMESH_GATEWAY__MAX_STREAMS_PER_KEY": str(streams),
        "LOOPMESH_GATEWAY__RATE_PER_S": "100000",
        "LOOPMESH_GATEWAY__RATE_BURST": "100000",
    }


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    return values[min(len(values) - 1, int(len(values) * p / 100))]


async def driver(args: argparse.Namespace) -> None:
    import tempfile

    import httpx

    from bench.harness import CpuMeter, Mesh, pid_of

    store = Path(tempfile.mkdtemp(prefix="bench-sse-"))
    async with Mesh(store, ack_wait_s=30, lease_ttl_s=30) as mesh:
        tools = await mesh.tool_worker(concurrency=64)
        worker = await mesh.instant_worker("w1", iterations=args.echo)
        gateway, base = await mesh.gateway(unlimited(args.clients + 10))
        async with httpx.AsyncClient(base_url=base, timeout=60) as http:
            r = await http.post("/v1/sessions", json={"session": "watched"})
            assert r.status_code == 201, r.text
            watched, floor = base, None
            if args.floor:
                floor = await asyncio.create_subprocess_exec(
                    sys.executable, str(FLOOR), args.floor,
                    "--nats-url", mesh.server.url, "--session", "watched",
                    stdout=asyncio.subprocess.PIPE,
                    env={**os.environ, "PYTHONPATH": str(ROOT)},
                )  # fmt: skip
                assert floor.stdout is not None
                line = (await asyncio.wait_for(floor.stdout.readline(), 60)).decode()
                assert line.startswith("floor http://"), line
                watched = line.split()[1]
            clients = await asyncio.create_subprocess_exec(
                sys.executable, str(CLIENTS),
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
    args = parser.parse_args()
    if args.nats_fanout:
        from bench.sse_fanout import nats_fanout

        asyncio.run(nats_fanout(args))
    else:
        asyncio.run(driver(args))


if __name__ == "__main__":
    main()
