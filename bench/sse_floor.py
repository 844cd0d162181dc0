"""The floor of ``bench/sse.py --floor``: a bare uvicorn + Starlette SSE server, what no
gateway change below the HTTP server can beat on the machine it runs on.

    python bench/sse_floor.py raw|sse-starlette --nats-url nats://... --session watched

serves ``GET /v1/sessions/{session}/events`` from one core NATS subscription on the
session: each event's frame encoded once and written to every client (``raw``), or each
client's events sent through sse-starlette's ``EventSourceResponse`` (the cost the
gateway's pre-encoded frames avoid). It prints ``floor http://127.0.0.1:PORT`` once it
listens.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


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
    parser.add_argument("floor_server", choices=("raw", "sse-starlette"))
    parser.add_argument("--nats-url", required=True)
    parser.add_argument("--session", required=True)
    args = parser.parse_args()
    from loopmesh.aio import run

    run(floor_main(args))


if __name__ == "__main__":
    main()
