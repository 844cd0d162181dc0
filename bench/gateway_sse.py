"""The gateway under many SSE clients: event delivery latency and turn submission.

    python -m bench.gateway_sse [--clients 500] [--events 200] [--rate 20] [--turns 50]

Starts an embedded nats-server, a loop worker whose LLM answers at once
(``bench.instant_worker``), the gateway (``loopmesh gateway --no-auth``) and the SSE
clients, each in its own process. The clients (raw asyncio HTTP, one process) open
``--clients`` streams on one session; this process then publishes ``--events`` events
to that session at ``--rate`` a second, as a worker would, each stamped with its send
time, and every client measures when it arrives. Then ``--turns`` turns are posted over
HTTP one after another, each timed from the POST to its ``loop_start`` on an SSE stream.
Prints p50/p99 of both, and the CPU each process spent.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import msgspec

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SESSION = "fanout"


class _Ts(msgspec.Struct):
    ts: float = 0.0


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(p / 100 * len(values)))] if values else float("nan")


# -- the clients' process -----------------------------------------------------------------


async def client(host: str, port: int, n_events: int, out: list[float], ready: asyncio.Event,
                 connected: list[int]) -> None:  # fmt: skip
    decode = msgspec.json.Decoder(_Ts).decode
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(
        f"GET /v1/sessions/{SESSION}/events HTTP/1.1\r\nHost: {host}\r\n"
        "Accept: text/event-stream\r\n\r\n".encode()
    )
    await writer.drain()
    status = await reader.readline()
    assert b" 200 " in status, status
    while (await reader.readline()) not in (b"\r\n", b"\n", b""):
        pass  # headers
    connected[0] += 1
    if connected[0] == connected[1]:
        ready.set()
    got = 0
    while got < n_events:
        line = await reader.readline()
        if not line:
            raise RuntimeError("stream ended")
        if line.startswith(b"data: "):
            out.append(time.time() - decode(line[6:]).ts)
            got += 1
    writer.close()


async def clients_main(url: str, n: int, n_events: int) -> None:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    latencies: list[float] = []
    ready = asyncio.Event()
    connected = [0, n]
    tasks = [
        asyncio.create_task(client(host, int(port), n_events, latencies, ready, connected))
        for _ in range(n)
    ]
    await ready.wait()
    print("connected", flush=True)
    before = resource.getrusage(resource.RUSAGE_SELF)
    await asyncio.gather(*tasks)
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    summary = {
        "deliveries": len(latencies),
        "p50_ms": pct(latencies, 50) * 1000,
        "p99_ms": pct(latencies, 99) * 1000,
        "max_ms": max(latencies) * 1000,
        "clients_cpu_s": cpu,
    }
    print("summary " + json.dumps(summary), flush=True)
    await asyncio.Event().wait()  # until the driver stops us, so it can read our CPU


# -- the driver ---------------------------------------------------------------------------


async def main(args: argparse.Namespace) -> None:
    import httpx

    from bench.harness import CpuMeter, Mesh, pid_of
    from loopmesh.testing.durable import Proc
    from loopmesh.testing.sse import messages
    from schemas import Subjects, encode
    from schemas.events import ContentDelta

    s = Subjects()
    with tempfile.TemporaryDirectory() as tmp:
        async with Mesh(Path(tmp) / "nats") as mesh:
            worker = await mesh.instant_worker("w1", iterations=1)
            gateway = Proc(
                "-m", "loopmesh", "gateway", "--nats-url", mesh.server.url, "--no-auth",
                "--port", "0", "--log-level", "WARNING",
                env={
                    "LOOPMESH_GATEWAY__MAX_STREAMS_PER_KEY": str(args.clients + 10),
                    "LOOPMESH_GATEWAY__RATE_PER_S": "100000",
                    "LOOPMESH_GATEWAY__RATE_BURST": "100000",
                },
            )  # fmt: skip
            mesh.procs.append(gateway)
            line = await (await gateway.start()).wait_line("gateway   http")
            url = line.split()[1]
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                await http.post("/v1/sessions", json={"session": SESSION})
                clients = Proc(
                    "-m", "bench.gateway_sse", "--as-clients", url,
                    "--clients", str(args.clients), "--events", str(args.events),
                )  # fmt: skip
                mesh.procs.append(clients)
                await clients.start("connected", timeout=120)
                meter = CpuMeter({
                    "gateway": pid_of(gateway), "clients": pid_of(clients),
                    "nats-server": mesh.server.pid or 0,
                })  # fmt: skip
                meter.start()
                js = mesh.nc.jetstream()
                subject = s.event("local", SESSION, "content_delta")
                for i in range(args.events):
                    event = ContentDelta(
                        tenant="local", session=SESSION, turn_id="t", iteration=i,
                        text="x" * 40, ts=time.time(),
                    )  # fmt: skip
                    await js.publish(subject, encode(event))
                    await asyncio.sleep(1 / args.rate)
                summary = json.loads(
                    (await clients.wait_line("summary ", timeout=300)).split(" ", 1)[1]
                )
                meter.stop()
                print(
                    f"SSE fan-out: {args.clients} clients on one session, {args.events} events "
                    f"at {args.rate:g}/s = {summary['deliveries']} deliveries; delivery latency "
                    f"p50 {summary['p50_ms']:.1f} ms, p99 {summary['p99_ms']:.1f} ms, "
                    f"max {summary['max_ms']:.1f} ms"
                )
                print(f"  CPU over {meter.wall:.1f} s: " + ", ".join(
                    f"{name} {sec:.1f} s" for name, sec in meter.spent.items()
                ) + f" (clients' own count: {summary['clients_cpu_s']:.1f} s)")  # fmt: skip

                # turn submission over HTTP to loop_start
                submit: list[float] = []
                await http.post("/v1/sessions", json={"session": "turns"})
                async with http.stream("GET", "/v1/sessions/turns/events") as r:
                    assert r.status_code == 200
                    reader = messages(r)
                    for i in range(args.turns):
                        t0 = time.perf_counter()
                        posted = await http.post(
                            "/v1/sessions/turns/turns", json={"input": f"turn {i}"},
                            headers={"Idempotency-Key": f"b{i}"},
                        )  # fmt: skip
                        assert posted.status_code == 202, posted.text
                        async for m in reader:
                            if m.event == "loop_start" and m.json()["turn_id"] == f"b{i}":
                                submit.append(time.perf_counter() - t0)
                                break
                        async for m in reader:
                            if m.event == "loop_end":
                                break
                print(
                    f"turn submission (HTTP POST to loop_start over SSE), {args.turns} turns "
                    f"in sequence: p50 {pct(submit, 50) * 1000:.1f} ms, "
                    f"p99 {pct(submit, 99) * 1000:.1f} ms"
                )
            del worker


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=500)
    parser.add_argument("--events", type=int, default=200)
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--turns", type=int, default=50)
    parser.add_argument("--as-clients", metavar="URL", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.as_clients:
        asyncio.run(clients_main(args.as_clients, args.clients, args.events))
    else:
        asyncio.run(main(args))


if __name__ == "__main__":
    cli()
