"""The NATS half of the gateway's SSE fan-out, alone (``bench/sse.py --nats-fanout``):

    python bench/sse_fanout.py [--clients 500]

``--clients`` event streams on one session, in this process, with the gateway's own
``Fanout`` and ``EventStream`` (one shared ordered consumer), and 200 events published
to the session; it prints this process's CPU per event delivered to one
stream (the publisher's share included).
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


async def nats_fanout(args: argparse.Namespace) -> None:
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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", type=int, default=500)
    asyncio.run(nats_fanout(parser.parse_args()))


if __name__ == "__main__":
    main()
