"""The one zero-latency OpenAI-compatible server every system of ``python -m bench`` talks
to over HTTP, scripted per session, and as cheap per request as a Python server can be: a
minimal HTTP/1.1 server (keep-alive, ``Content-Length`` bodies) on asyncio's protocols
and uvloop, with msgspec for the JSON. loopmesh's test fake (``loopmesh.testing.fake_llm``,
uvicorn + h11 + starlette) spends about 1 ms of CPU per streamed request on an idle core;
this one about 0.25 ms (``GET /bench/stats`` says how
much in each run).

A turn's input ends in ``echo N``: the server answers with a call of the offered tool
whose name ends in ``echo`` until the conversation holds N tool results after that input,
then calls the offered ``task_completion`` tool (loopmesh) or replies with text (the
peers, which have no such tool). The input is the last user message without a ``name``
(loopmesh's engine names the user messages it adds itself), so a session of several turns
runs each the same way. Streamed requests (``stream: true``) get the chunks OpenAI
sends, shaped as the test fake's (``loopmesh.testing.fake_stream``): the role, the
content or the tool call (its arguments in fragments of 7 characters), the finish
reason, the usage when ``stream_options.include_usage`` asks, ``[DONE]``; all of them
in one write, with a ``Content-Length``. Every system gets the same bytes.

It notes when each request arrives, keyed by the session's first user message, so one
clock measures every system's iterations: the gap between two requests of one session is
one iteration (an LLM call, a tool call and the system's own work). ``GET /bench/gaps``
returns and clears them; ``GET /bench/stats`` returns the requests served, the content
tokens streamed and the CPU seconds this process has used.

With a pace (``BenchLLM(pace=Pace(...))``, or ``--ttft-ms``, ``--tokens-per-s`` and
``--tokens``), a streamed reply comes at a model's speed instead: ``tokens`` content
chunks of one token each, stamped with the time each was written, then the tool call
(``bench/llm_stream.py``). A ``bench-turn=<id>`` in a turn's input has the server keep
what it streamed for that turn: its replies' time from request to last write, tokens and
characters (``GET /bench/turns`` returns and clears them). The load bench runs on it
(``python -m bench.load``).

With a provider's limit (``BenchLLM(limit=ProviderLimit(...))``, or ``--tpm`` and
``--window-s``: ``bench/llm_limit.py``), a chat request past the tokens per minute is
answered 429 with ``Retry-After``; ``GET /bench/stats`` adds the requests so answered
(``rejected``) and the tokens accepted. The rate-limit bench runs on it
(``python -m bench.ratelimit``).

    python -m bench.llm_server --port N [--ttft-ms 200 --tokens-per-s 50 --tokens 20]
                               [--tpm 60000 --window-s 60]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import re
import signal
import time
from collections.abc import Callable
from typing import Any

import msgspec

from bench.llm_limit import ProviderLimit, retry_headers
from bench.llm_stream import Pace, PacedReply, Streamed
from loopmesh.aio import run

_ECHO = re.compile(r"echo (\d+)\s*$")
_TURN = re.compile(r"bench-turn=(\S+)")
_MAX_HEAD = 64 * 1024
_MAX_BODY = 16 * 1024 * 1024
FRAGMENT = 7  # characters of a tool call's arguments per chunk (as the test fake)

_encode = msgspec.json.encode
_decode = msgspec.json.decode


class BadRequest(Exception):
    """A request this server does not read (the message says why)."""


def _text(message: dict[str, Any]) -> str:
    content = message.get("content") or ""
    if isinstance(content, list):
        return " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


#: What starts a paced reply on a connection's transport; it calls back when it is done.
Start = Callable[[Any, Callable[[], None]], PacedReply]


class BenchLLM:
    """The server; ``async with BenchLLM() as llm`` serves on a free loopback port."""

    def __init__(
        self,
        port: int = 0,
        host: str = "127.0.0.1",
        pace: Pace | None = None,
        limit: ProviderLimit | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.pace = pace or Pace()
        self.limit = limit
        self.arrivals: dict[str, list[float]] = {}  # unpaced only: gaps mean nothing paced
        self.turns: dict[str, Streamed] = {}  # bench-turn id -> what was streamed for it
        self.requests = 0
        self.tokens = 0  # paced content tokens streamed
        self._ids = itertools.count(1)
        self._server: asyncio.Server | None = None
        self.connections: set[Any] = set()  # the open connections' transports

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    async def __aenter__(self) -> BenchLLM:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Connection(self), self.host, self.port, backlog=1024
        )
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.close()
            for transport in list(self.connections):  # idle keep-alive connections
                transport.close()
            await self._server.wait_closed()

    # -- the routes -------------------------------------------------------------------

    def respond(self, method: str, path: str, body: bytes, arrived: float) -> bytes | Start:
        """The whole HTTP response to one request, or (a paced reply) what starts it on
        the connection's transport."""
        if method == "POST" and path == "/v1/chat/completions":
            try:
                request = _decode(body)
            except msgspec.DecodeError as exc:
                return _json(400, {"error": {"message": f"body: {exc}", "type": "bad_request"}})
            if not isinstance(request, dict):
                return _json(400, {"error": {"message": "body: not an object"}})
            return self._completion(request, arrived)
        if method == "GET" and path == "/bench/gaps":
            gaps = [
                (b - a) * 1000
                for times in self.arrivals.values()
                for a, b in itertools.pairwise(times)
            ]
            self.arrivals = {}
            return _json(200, {"gaps_ms": gaps})
        if method == "GET" and path == "/bench/stats":
            stats = {"requests": self.requests, "tokens": self.tokens, "cpu_s": time.process_time()}
            if self.limit is not None:
                stats["rejected"] = self.limit.rejected
                stats["accepted_tokens"] = self.limit.accepted_tokens
            return _json(200, stats)
        if method == "GET" and path == "/bench/turns":
            turns, self.turns = self.turns, {}
            return _json(200, {"turns": turns})
        return _json(404, {"error": {"message": f"no route {method} {path}"}})

    def _completion(self, request: dict[str, Any], arrived: float) -> bytes | Start:
        self.requests += 1
        messages: list[dict[str, Any]] = request.get("messages") or []
        if not self.pace.on:
            users = [m for m in messages if m.get("role") == "user"]
            key = _text(users[0]) if users else ""
            self.arrivals.setdefault(key, []).append(arrived)
        names = [(t.get("function") or {}).get("name", "") for t in request.get("tools") or []]
        current, done = _turn_input(messages)
        match = _ECHO.search(current)
        wanted = int(match.group(1)) if match else 1
        echo = next((n for n in names if n.endswith("echo")), "echo")
        finish = next((n for n in names if n.endswith("task_completion")), None)
        call: tuple[str, str] | None = None
        if done < wanted:
            call = (echo, _encode({"text": f"hi {done}"}).decode())
        elif finish:
            call = (finish, _encode({"result": "done"}).decode())
        reply = _Reply(request, f"c{next(self._ids)}", call, "" if call else "done")
        if self.limit is not None:
            wait = self.limit.take(reply.usage()["total_tokens"])
            if wait is not None:
                body = {"error": {"message": "tokens per minute exceeded", "type": "tokens"}}
                return _response(429, b"application/json", _encode(body), retry_headers(wait))
        if request.get("stream") and self.pace.on:
            found = _TURN.search(current)
            turn = found.group(1) if found else None

            def start(transport: Any, finished: Callable[[], None]) -> PacedReply:
                def done(paced: PacedReply) -> None:
                    self._streamed(turn, paced)
                    finished()

                paced = PacedReply(
                    transport, self.pace, arrived=arrived, head=reply.head(),
                    token=reply.content_chunk(), tail=reply.tail(), done=done,
                )  # fmt: skip
                paced.begin()
                return paced

            return start
        if request.get("stream"):
            return _response(200, b"text/event-stream", reply.events())
        return _json(200, reply.whole())

    def _streamed(self, turn: str | None, paced: PacedReply) -> None:
        self.tokens += paced.tokens
        if turn is not None:
            s = self.turns.setdefault(turn, Streamed())
            s.model_s += paced.model_s
            s.tokens += paced.tokens
            s.chars += paced.chars
            s.replies += 1


def _turn_input(messages: list[dict[str, Any]]) -> tuple[str, int]:
    """The turn's input (its last user message without a ``name``: the engine names the
    ones it adds) and how many tool results follow it."""
    results = 0
    for m in reversed(messages):
        if m.get("role") == "tool":
            results += 1
        elif m.get("role") == "user" and not m.get("name"):
            return _text(m), results
    return "", results


class _Reply:
    """One completion: a tool call or a text, streamed or whole."""

    def __init__(
        self, request: dict[str, Any], ident: str, call: tuple[str, str] | None, content: str
    ) -> None:
        self.request = request
        self.call = call
        self.content = content
        self.base = {
            "id": ident,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": str(request.get("model") or "fake-model"),
        }

    def _chunk(self, delta: dict[str, Any], finish: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return b"data: " + _encode({**self.base, "choices": [choice]}) + b"\n\n"

    def events(self) -> bytes:
        out = [self.head()]
        for i in range(0, len(self.content), 8):
            out.append(self._chunk({"content": self.content[i : i + 8]}))
        out.append(self.tail())
        return b"".join(out)

    def head(self) -> bytes:
        return self._chunk({"role": "assistant", "content": ""})

    def content_chunk(self) -> tuple[bytes, bytes]:
        """A content chunk's bytes before and after its JSON string."""
        before, _, after = self._chunk({"content": "\0"}).partition(b'"\\u0000"')
        return before, after

    def tail(self) -> bytes:
        """The chunks after the content: the tool call, the finish, the usage, [DONE]."""
        out = []
        if self.call is not None:
            name, arguments = self.call
            first = {
                "index": 0,
                "id": f"call_{self.base['id']}_0",
                "type": "function",
                "function": {"name": name, "arguments": ""},
            }
            out.append(self._chunk({"tool_calls": [first]}))
            for i in range(0, len(arguments), FRAGMENT):
                fragment = {"index": 0, "function": {"arguments": arguments[i : i + FRAGMENT]}}
                out.append(self._chunk({"tool_calls": [fragment]}))
        out.append(self._chunk({}, "tool_calls" if self.call else "stop"))
        if (self.request.get("stream_options") or {}).get("include_usage"):
            usage = {**self.base, "choices": [], "usage": self.usage()}
            out.append(b"data: " + _encode(usage) + b"\n\n")
        out.append(b"data: [DONE]\n\n")
        return b"".join(out)

    def usage(self) -> dict[str, int]:
        messages = self.request.get("messages") or []
        prompt = sum(len(str(m.get("content") or "")) for m in messages)
        out = len(self.content) + (len(self.call[0]) + len(self.call[1]) if self.call else 0)
        p, c = prompt // 4 + 1, out // 4 + 1
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def whole(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.call is not None:
            name, arguments = self.call
            message["tool_calls"] = [
                {
                    "id": f"call_{self.base['id']}_0",
                    "type": "function",
                    "function": {"name": name, "arguments": arguments},
                }
            ]
        choice = {
            "index": 0,
            "message": message,
            "finish_reason": "tool_calls" if self.call else "stop",
            "logprobs": None,
        }
        return {
            **self.base,
            "object": "chat.completion",
            "choices": [choice],
            "usage": self.usage(),
        }


_REASONS = {
    200: b"OK", 400: b"Bad Request", 404: b"Not Found", 413: b"Content Too Large",
    429: b"Too Many Requests",
}  # fmt: skip


def _response(status: int, content_type: bytes, body: bytes, headers: bytes = b"") -> bytes:
    head = b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n%s\r\n" % (
        status, _REASONS.get(status, b"Error"), content_type, len(body), headers,
    )  # fmt: skip
    return head + body


def _json(status: int, body: dict[str, Any]) -> bytes:
    return _response(status, b"application/json", _encode(body))


class _Connection(asyncio.Protocol):
    """One client connection: requests read in order, each answered in one write, or
    over time (a paced reply: the next request waits for its end)."""

    def __init__(self, app: BenchLLM) -> None:
        self.app = app
        self.buffer = bytearray()
        self.arrived = 0.0
        self.transport: Any = None  # uvloop's transports are no asyncio.Transport
        self.paced: PacedReply | None = None
        self.close_after = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.app.connections.add(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.transport is not None:
            self.app.connections.discard(self.transport)
        if self.paced is not None:
            self.paced.cancel()

    def data_received(self, data: bytes) -> None:
        if not self.buffer:
            self.arrived = time.perf_counter()  # the first bytes of a request
        self.buffer += data
        if self.paced is None:
            self._answer()

    def _paced_done(self) -> None:
        self.paced = None
        if self.close_after:
            self.transport.close()
        elif self.buffer:
            self._answer()

    def _answer(self) -> None:
        try:
            while self._one():
                self.arrived = time.perf_counter()
        except BadRequest as exc:
            assert self.transport is not None
            status = 413 if "too large" in str(exc) else 400
            self.transport.write(_json(status, {"error": {"message": str(exc)}}))
            self.transport.close()

    def _one(self) -> bool:
        """Answer the buffer's first request if it is all there; whether it was."""
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(self.buffer) > _MAX_HEAD:
                raise BadRequest("request head too large")
            return False
        lines = bytes(self.buffer[:end]).decode("latin-1").split("\r\n")
        try:
            method, target, _version = lines[0].split(" ")
            headers = {
                name.strip().lower(): value.strip()
                for name, value in (line.split(":", 1) for line in lines[1:])
            }
            length = int(headers.get("content-length", "0"))
        except ValueError:
            raise BadRequest(f"malformed request head: {lines[0][:80]!r}") from None
        if "transfer-encoding" in headers:
            raise BadRequest("chunked request bodies are not read: send a Content-Length")
        if length < 0 or length > _MAX_BODY:
            raise BadRequest(f"body too large: {length} bytes")
        start = end + 4
        if len(self.buffer) < start + length:
            return False
        body = bytes(self.buffer[start : start + length])
        del self.buffer[: start + length]
        assert self.transport is not None
        answer = self.app.respond(method, target.split("?", 1)[0], body, self.arrived)
        self.close_after = headers.get("connection", "").lower() == "close"
        if not isinstance(answer, bytes):
            self.paced = answer(self.transport, self._paced_done)
            return False  # the next request, if any, once this reply is all written
        self.transport.write(answer)
        if self.close_after:
            self.transport.close()
            return False
        return bool(self.buffer)


async def _serve(port: int, pace: Pace, limit: ProviderLimit | None) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with BenchLLM(port=port, pace=pace, limit=limit) as fake:
        print(f"bench LLM serving {fake.base_url}", flush=True)
        await stop.wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        prog="python -m bench.llm_server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--port", type=int, default=0, help="0: a free one (printed)")
    parser.add_argument("--ttft-ms", type=float, default=0.0, help="time to first token")
    parser.add_argument("--tokens-per-s", type=float, default=50.0)
    parser.add_argument("--tokens", type=int, default=0, help="content tokens per reply")
    parser.add_argument("--tpm", type=int, default=0, help="tokens per minute (0: no limit)")
    parser.add_argument("--window-s", type=float, default=60.0, help="the limit's window")
    args = parser.parse_args()
    pace = Pace(ttft_s=args.ttft_ms / 1000, tokens_per_s=args.tokens_per_s, tokens=args.tokens)
    limit = ProviderLimit(args.tpm, args.window_s) if args.tpm else None
    run(_serve(args.port, pace, limit))
