"""The SSE clients of ``bench/sse.py``: ``--clients`` event streams on ONE session, all
in this one process (uvloop, raw sockets, so the clients cost as little CPU as they
can), plus one plain NATS subscriber on the session's events (the part of the delay
that is not the gateway's). The driver starts it:

    python bench/sse_clients.py --url http://127.0.0.1:PORT --session watched \
        --clients 500 --nats-url nats://127.0.0.1:PORT

It prints ``connected N`` once every stream is open, then reads commands from stdin,
one a line: ``count <turn id>`` (count that turn's events from now on; it answers
``counted``) and ``stop``, after which it prints ``RESULT <json>``: every counted
delivery's latency (receipt time minus the event's ``ts``), each turn's ``loop_start``
receipts, the messages read, the first errors and this process's CPU seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import resource
import sys
import time
from array import array
from collections.abc import Callable
from typing import Any

import msgspec


class _Head(msgspec.Struct):
    type: str = ""
    turn_id: str = ""
    ts: float = 0.0


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
        try:
            await read_sse(self.host, self.port, self.path, self._message, self._opened)
        except SseRefused as exc:
            self.errors.append(str(exc))

    def _opened(self) -> None:
        self.connected += 1
        if self.connected == self.count:
            self.all_connected.set()

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


class SseRefused(Exception):
    """The server answered an event stream's request with another status than 200."""


async def read_sse(
    host: str,
    port: int,
    path: str,
    on_message: Callable[[bytes, float], None],
    on_open: Callable[[], None] = lambda: None,
) -> None:
    """Read one SSE stream (``GET path``, HTTP/1.1, chunked or not) until the server ends
    it: ``on_open()`` once its head is read, then ``on_message(block, received_at)`` for
    each message (its lines, without the blank line that ends it; ``received_at`` is
    ``time.time()`` when the bytes holding its end arrived). Raises :class:`SseRefused`."""
    reader, writer = await asyncio.open_connection(host, port, limit=1 << 20)
    try:
        request = f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nAccept: text/event-stream\r\n\r\n"
        writer.write(request.encode())
        status = await reader.readline()
        if b" 200 " not in status:
            raise SseRefused(status.decode().strip())
        chunked = False
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            chunked |= line.lower().startswith(b"transfer-encoding: chunked")
        on_open()
        pending = b""
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
                on_message(block, now)
    finally:
        writer.close()


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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", required=True, help="the SSE server (gateway or floor)")
    parser.add_argument("--session", required=True)
    parser.add_argument("--clients", type=int, default=500)
    parser.add_argument("--nats-url", required=True)
    args = parser.parse_args()
    try:
        import uvloop

        uvloop.run(clients_main(args))
    except ImportError:
        asyncio.run(clients_main(args))


if __name__ == "__main__":
    main()
