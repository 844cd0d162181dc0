"""The one zero-latency OpenAI-compatible server every system of ``python -m bench`` talks
to over HTTP: loopmesh's own fake (``loopmesh.testing.fake_llm``), scripted per session.

A session's first user message ends in ``echo N``: the server answers with a call of the
offered tool whose name ends in ``echo`` until the conversation holds N tool results, then
calls the offered ``task_completion`` tool (loopmesh) or replies with text (the peers,
which have no such tool). It notes when each request arrives, keyed by that first user
message, so one clock measures every system's iterations: the gap between two requests of
one session is one iteration (an LLM call, a tool call and the system's own work).
``GET /bench/gaps`` returns and clears them.

    python -m bench.llm_server --port N
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import re
import signal
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from loopmesh.testing.fake_llm import FakeLLM, Reply, text, tool_calls
from loopmesh.testing.fake_stream import ReplyResponse

_ECHO = re.compile(r"echo (\d+)\s*$")


def _text(message: dict[str, Any]) -> str:
    content = message.get("content") or ""
    if isinstance(content, list):
        return " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


class BenchLLM(FakeLLM):
    def __init__(self, port: int = 0) -> None:
        super().__init__(port=port)
        self.arrivals: dict[str, list[float]] = {}
        self.app.router.routes.append(Route("/bench/gaps", self._gaps, methods=["GET"]))

    async def _completions(self, request: Request) -> Response:
        now = time.perf_counter()
        body = await request.json()
        messages: list[dict[str, Any]] = body.get("messages") or []
        users = [m for m in messages if m.get("role") == "user"]
        key = _text(users[0]) if users else ""
        self.arrivals.setdefault(key, []).append(now)
        names = [(t.get("function") or {}).get("name", "") for t in body.get("tools") or []]
        match = _ECHO.search(key)
        wanted = int(match.group(1)) if match else 1
        done = sum(1 for m in messages if m.get("role") == "tool")
        echo = next((n for n in names if n.endswith("echo")), "echo")
        finish = next((n for n in names if n.endswith("task_completion")), None)
        reply: Reply
        if done < wanted:
            reply = tool_calls((echo, {"text": f"hi {done}"}))
        elif finish:
            reply = tool_calls((finish, {"result": "done"}))
        else:
            reply = text("done")
        return ReplyResponse(
            reply,
            body,
            ident=f"c{next(self._ids)}",
            closing=self._closing,
            on_disconnect=self._disconnected,
        )

    async def _gaps(self, request: Request) -> Response:
        gaps = [
            (b - a) * 1000 for times in self.arrivals.values() for a, b in itertools.pairwise(times)
        ]
        self.arrivals = {}
        return JSONResponse({"gaps_ms": gaps})


async def _serve(port: int) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with BenchLLM(port=port) as fake:
        print(f"bench LLM serving {fake.base_url}", flush=True)
        await stop.wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.llm_server", description=__doc__)
    parser.add_argument("--port", type=int, default=0)
    asyncio.run(_serve(parser.parse_args().port))
