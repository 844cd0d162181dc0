"""A fake OpenAI-compatible server on loopback, scripted per test.

``POST /v1/chat/completions`` answers each request with the next scripted reply (SSE
chunks shaped like OpenAI's when ``stream`` is true, one JSON object otherwise);
:meth:`FakeLLM.script_for` scripts the replies to one model (a planner and an executor,
say) apart from the rest. ``GET /v1/models`` lists ``models``; ``POST /v1/embeddings``
embeds with ``embedder`` (by default :func:`hashed_embeddings`, words hashed into 64
dimensions: texts that share words are near) and keeps each request's inputs in
``embeddings``. With ``prompt_cache=True`` it reports ``cached_tokens`` as a provider's
prompt cache would: the tokens of the longest run of leading messages, under the same
model and tools, that an earlier request began with. Replies are built with
:func:`text`, :func:`tool_calls`, :func:`error`, :func:`hang`, :func:`cut`, :func:`empty`
and :func:`auto`.
``python -m loopmesh.testing.fake_llm --port N [--script FILE.json]`` serves the
same app in its own process, answering in ``auto`` mode once the script is spent.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import itertools
import json
import logging
import math
import re
import signal
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from types import TracebackType
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from loopmesh.testing.fake_replies import (
    Auto,
    Cut,
    Empty,
    Error,
    Hang,
    Reply,
    Text,
    ToolCalls,
    auto,
    cut,
    empty,
    error,
    hang,
    resolve_auto,
    text,
    tool_calls,
)
from loopmesh.testing.fake_stream import ReplyResponse, message_tokens

__all__ = [
    "Auto",
    "Cut",
    "Empty",
    "Error",
    "FakeLLM",
    "Hang",
    "Reply",
    "Text",
    "ToolCalls",
    "auto",
    "cut",
    "empty",
    "error",
    "hang",
    "text",
    "tool_calls",
]

_DROPPED_ON_PURPOSE = (
    "ASGI callable returned without completing response.",  # cut(), or closing mid-stream
    "ASGI callable returned without starting response.",  # closing during hang()
)


class _DropCutLog(logging.Filter):
    """Hide uvicorn's complaints about the replies the fake ends on purpose."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() not in _DROPPED_ON_PURPOSE


class _Server(uvicorn.Server):
    """uvicorn stopped by an event: no signal handlers, no 0.1 s polling on the way out."""

    def __init__(self, config: uvicorn.Config, stop: asyncio.Event) -> None:
        super().__init__(config)
        self._stop = stop

    def capture_signals(self) -> contextlib.AbstractContextManager[None]:  # type: ignore[override]
        return contextlib.nullcontext()

    async def main_loop(self) -> None:
        await self.on_tick(0)  # the Date header
        await self._stop.wait()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:
            server.close()
        for connection in list(self.server_state.connections):
            connection.shutdown()  # idle ones close now, busy ones after their reply
        if self.server_state.tasks:
            await asyncio.wait(list(self.server_state.tasks), timeout=5)
        for _ in range(2):  # closed transports report connection_lost on the next turns
            await asyncio.sleep(0)


class FakeLLM:
    """The server; ``async with FakeLLM() as fake`` starts it on a free loopback port."""

    def __init__(
        self,
        *replies: Reply,
        default: Reply | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        models: tuple[str, ...] = ("fake-model",),
        embedder: Callable[[Sequence[str]], list[list[float]]] | None = None,
        prompt_cache: bool = False,
    ) -> None:
        self.default = default
        self.prompt_cache = prompt_cache
        self._prefixes: set[bytes] = set()  # digests of every request's leading messages
        self.embedder = embedder or hashed_embeddings
        self.embeddings: list[list[str]] = []  # the inputs of each embeddings request
        self.models = models
        self.requests: list[dict[str, Any]] = []
        self.arrivals: list[float] = []  # when each request arrived (time.time()), in order
        self.keys: list[str | None] = []  # each request's Authorization header, in order
        self.disconnects = 0  # requests whose client went away before the reply ended
        self._script: list[Reply] = list(replies)
        self._by_model: dict[str, list[Reply]] = {}
        self._changed = asyncio.Condition()
        self._closing = asyncio.Event()
        self._ids = itertools.count(1)
        # proto IPPROTO_TCP (not 0) so that asyncio sets TCP_NODELAY on accepted
        # connections: without it Nagle + delayed ACKs add 40 ms to every reply
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.host, self.port = self._sock.getsockname()[:2]
        self.base_url = f"http://{self.host}:{self.port}/v1"
        self._filter = _DropCutLog()
        self._task: asyncio.Task[None] | None = None
        self.app = Starlette(
            routes=[
                Route("/v1/chat/completions", self._completions, methods=["POST"]),
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/v1/embeddings", self._embeddings, methods=["POST"]),
            ]
        )

    def script(self, *replies: Reply) -> None:
        """Queue replies; each request takes the next one."""
        self._script.extend(replies)

    def script_for(self, model: str, *replies: Reply) -> None:
        """Queue replies for requests naming ``model``; they go before the shared script."""
        self._by_model.setdefault(model, []).extend(replies)

    def requests_for(self, model: str) -> list[dict[str, Any]]:
        return [r for r in self.requests if r.get("model") == model]

    async def wait_requests(self, n: int, timeout: float = 5) -> None:
        """Return once ``n`` requests have arrived; ``TimeoutError`` after ``timeout``."""
        async with asyncio.timeout(timeout), self._changed:
            await self._changed.wait_for(lambda: len(self.requests) >= n)

    async def wait_disconnects(self, n: int, timeout: float = 5) -> None:
        """Return once ``n`` clients have hung up on an unfinished reply."""
        async with asyncio.timeout(timeout), self._changed:
            await self._changed.wait_for(lambda: self.disconnects >= n)

    async def start(self) -> None:
        if self._task is not None:
            return
        self._sock.listen(128)  # connections queue in the backlog until uvicorn accepts
        logging.getLogger("uvicorn.error").addFilter(self._filter)
        config = uvicorn.Config(
            self.app,
            http="h11",
            lifespan="off",
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=5,
        )
        server = _Server(config, self._closing)
        self._task = asyncio.create_task(server.serve(sockets=[self._sock]))

    async def aclose(self) -> None:
        """Stop serving: unfinished replies end at once. Idempotent."""
        self._closing.set()
        task, self._task = self._task, None
        try:
            if task is not None:
                await task
        finally:
            self._sock.close()
            logging.getLogger("uvicorn.error").removeFilter(self._filter)

    async def __aenter__(self) -> FakeLLM:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def _completions(self, request: Request) -> Response:
        arrived = time.time()
        body = await request.json()
        async with self._changed:
            self.requests.append(body)
            self.arrivals.append(arrived)
            self.keys.append(request.headers.get("authorization"))
            self._changed.notify_all()
        own = self._by_model.get(str(body.get("model")))
        if own:
            reply: Reply | None = own.pop(0)
        else:
            reply = self._script.pop(0) if self._script else self.default
        if reply is None:
            return JSONResponse(_error_body("script exhausted", 500), status_code=500)
        if isinstance(reply, Auto):
            reply = resolve_auto(body)
        return ReplyResponse(
            reply,
            body,
            ident=f"chatcmpl-{next(self._ids)}",
            closing=self._closing,
            on_disconnect=self._disconnected,
            cached_tokens=self._cached_tokens(body) if self.prompt_cache else None,
        )

    def _cached_tokens(self, body: dict[str, Any]) -> int:
        """The tokens of the longest run of leading messages an earlier request with the
        same model and tools began with; every run of this request's is kept."""
        head = json.dumps([body.get("model"), body.get("tools")], sort_keys=True)
        prefix = hashlib.sha256(head.encode())
        tokens = cached = 0
        for message in body.get("messages") or []:
            prefix.update(json.dumps(message, sort_keys=True).encode())
            digest = prefix.copy().digest()
            tokens += message_tokens(message)
            if digest in self._prefixes:
                cached = tokens
            self._prefixes.add(digest)
        return cached

    async def _disconnected(self) -> None:
        async with self._changed:
            self.disconnects += 1
            self._changed.notify_all()

    async def _models(self, request: Request) -> Response:
        now = int(time.time())
        data = [
            {"id": m, "object": "model", "created": now, "owned_by": "fake"} for m in self.models
        ]
        return JSONResponse({"object": "list", "data": data})

    async def _embeddings(self, request: Request) -> Response:
        body = await request.json()
        inputs = body.get("input")
        inputs = [inputs] if isinstance(inputs, str) else inputs
        if not isinstance(inputs, list) or not all(isinstance(i, str) for i in inputs):
            return JSONResponse(_error_body("input: a string or strings", 400), status_code=400)
        async with self._changed:
            self.embeddings.append(inputs)
            self._changed.notify_all()
        vectors = await asyncio.to_thread(self.embedder, inputs)  # a real model is slow
        data = [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)]
        tokens = sum(len(i.split()) for i in inputs)
        return JSONResponse(
            {
                "object": "list",
                "data": data,
                "model": body.get("model", ""),
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )


def hashed_embeddings(texts: Sequence[str], dims: int = 64) -> list[list[float]]:
    """Unit vectors of hashed lower-case words: a fast, deterministic stand-in."""
    out = []
    for item in texts:
        v = [0.0] * dims
        for word in re.findall(r"[a-z0-9]+", item.lower()):
            v[int.from_bytes(hashlib.blake2s(word.encode(), digest_size=4).digest()) % dims] += 1
        norm = math.sqrt(sum(x * x for x in v)) or 1.0
        out.append([x / norm for x in v])
    return out


def _error_body(message: str, status: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": "fake_error", "code": str(status)}}


_BUILDERS: dict[str, Callable[..., Reply]] = {
    "text": text,
    "tool_calls": lambda *, calls=(), **kw: tool_calls(*(tuple(c) for c in calls), **kw),
    "error": error,
    "hang": hang,
    "cut": cut,
    "empty": empty,
    "auto": auto,
}


def load_script(path: str) -> list[Reply]:
    """Read replies from JSON: ``[{"kind": "text", "content": "hi"}, {"kind": "tool_calls",
    "calls": [["name", {"arg": 1}]]}, {"kind": "error", "status": 429}, ...]``."""
    with open(path, encoding="utf-8") as f:
        items = json.load(f)
    return list(_iter_replies(items))


def _iter_replies(items: list[dict[str, Any]]) -> Iterator[Reply]:
    for item in items:
        kwargs = dict(item)
        yield _BUILDERS[kwargs.pop("kind")](**kwargs)


async def _serve(port: int, replies: list[Reply]) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with FakeLLM(*replies, default=auto(), port=port) as fake:
        print(f"fake LLM serving {fake.base_url}", flush=True)
        await stop.wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m loopmesh.testing.fake_llm", description=__doc__
    )
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--script", help="JSON file of replies served before auto mode")
    args = parser.parse_args(argv)
    asyncio.run(_serve(args.port, load_script(args.script) if args.script else []))


if __name__ == "__main__":
    main()
