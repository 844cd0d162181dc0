"""What every system of ``python -m bench`` shares: the fake LLM's process, the CPU meter
over the bench's whole process tree, and the load driver."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import platform
import shutil
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import httpx
import msgspec
import openai
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from bench.llm_stream import Pace, Streamed

ROOT = Path(__file__).resolve().parents[1]
TICK_S = 1 / os.sysconf("SC_CLK_TCK")
T = TypeVar("T")


def need_binary(name: str, hint: str, *extra_dirs: str) -> str:
    """The path of ``name``, or ``SystemExit`` with how to install it."""
    for d in extra_dirs:
        p = Path(d) / name
        if p.is_file() and os.access(p, os.X_OK):
            return str(p)
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if not found:
        raise Missing(f"{name} not found: {hint}")
    return found


class Missing(Exception):
    """A server or package a system needs is not installed (the message says how)."""


@contextlib.contextmanager
def peer_imports(*modules: str) -> Iterator[None]:
    """Around a peer's imports of its third-party ``modules`` (the ``bench`` extra's):
    one of them missing is ``Missing``, and the peer's row says it is not installed. Any
    other import error, a project module's or one inside the peer's package, goes on as
    the failure it is, and the row says what broke."""
    try:
        yield
    except ModuleNotFoundError as e:
        if e.name not in modules:
            raise
        raise Missing(f"{e.name} not installed: make bench (the bench extra)") from e


# -- CPU of the process tree -----------------------------------------------------------


def _stat(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()


def tree_cpu(exclude: set[int]) -> float:
    """utime + stime of this process and every descendant, but ``exclude``'s trees."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                ppid = int(_stat(int(entry.name))[1])
            except (OSError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    total, todo = 0.0, [os.getpid()]
    while todo:
        pid = todo.pop()
        if pid in exclude:
            continue
        try:
            f = _stat(pid)
        except OSError:
            continue
        total += (int(f[11]) + int(f[12])) * TICK_S
        todo += children.get(pid, [])
    return total


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def machine() -> str:
    model = next(
        (ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
         if ln.startswith("model name")), platform.machine(),
    )  # fmt: skip
    system = f"{platform.system()} {platform.release()}"
    return f"{model}, {os.cpu_count()} cores, {system}, Python {platform.python_version()}"


def bench_main(prog: str, work: Coroutine[Any, Any, T]) -> tuple[T, float]:
    """Run a bench's ``work`` as ``python -m <prog>`` does: the command line and the
    machine first; a failure says why on stderr and exits 1. What ``work`` returned, and
    the seconds it took."""
    logging.basicConfig(level=logging.WARNING)
    command = f"python -m {prog} " + " ".join(sys.argv[1:])
    print(f"{command}\nmachine: {machine()}; load average before: {loadavg()}", flush=True)
    started = time.time()
    try:
        result = asyncio.run(work)
    except (Exception, ExceptionGroup) as exc:
        print(f"\n{prog} failed: {describe(exc)}", file=sys.stderr)
        raise SystemExit(1) from None
    return result, time.time() - started


def describe(exc: BaseException) -> str:
    """The first real error inside ``exc`` (task groups wrap them), with its type and
    the notes on the way to it."""
    notes = list(getattr(exc, "__notes__", []))
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
        notes += getattr(exc, "__notes__", [])
    return "\n".join([f"{type(exc).__name__}: {exc}", *notes])


# -- the fake LLM ----------------------------------------------------------------------


class LLMServer:
    """``python -m bench.llm_server`` in its own process (its CPU counts for no system),
    on a free port; ``pace``: its replies streamed at a model's speed."""

    def __init__(self, pace: Pace | None = None, *args: str) -> None:
        self.pace = pace or Pace()
        self.args = args  # more of its options (``--tpm``, say)

    async def __aenter__(self) -> LLMServer:
        p = self.pace
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bench.llm_server", "--port", "0",
            "--ttft-ms", f"{p.ttft_s * 1000:g}", "--tokens-per-s", f"{p.tokens_per_s:g}",
            "--tokens", str(p.tokens), *self.args,
            cwd=str(ROOT), env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        assert self.proc.stdout is not None
        line = (await asyncio.wait_for(self.proc.stdout.readline(), 30)).decode()
        if not line.startswith("bench LLM serving http://"):
            self.proc.kill()
            await self.proc.wait()
            raise RuntimeError(f"bench.llm_server did not start: {line!r}")
        self.base_url = line.split()[-1]  # http://127.0.0.1:<port>/v1
        self.root = self.base_url.removesuffix("/v1")
        self.http = httpx.AsyncClient()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.http.aclose()
        if self.proc.returncode is None:
            self.proc.terminate()
        await self.proc.wait()

    async def _get(self, path: str) -> Any:
        r = await self.http.get(self.root + path)
        r.raise_for_status()
        return r.json()

    async def gaps(self) -> list[float]:
        return list((await self._get("/bench/gaps"))["gaps_ms"])

    async def stats(self) -> tuple[int, float]:
        """(requests served, CPU seconds the server's process has used) so far."""
        r = await self._get("/bench/stats")
        return int(r["requests"]), float(r["cpu_s"])

    async def limited(self) -> tuple[int, int, int]:
        """(requests, requests answered 429, tokens accepted) so far (``--tpm``)."""
        r = await self._get("/bench/stats")
        return int(r["requests"]), int(r.get("rejected", 0)), int(r.get("accepted_tokens", 0))

    async def tokens(self) -> int:
        """Paced content tokens streamed so far."""
        return int((await self._get("/bench/stats"))["tokens"])

    async def turns(self) -> dict[str, Streamed]:
        """What was streamed per ``bench-turn`` since the last call (and forget it)."""
        r = await self.http.get(self.root + "/bench/turns")
        r.raise_for_status()
        return msgspec.json.decode(r.content, type=dict[str, dict[str, Streamed]])["turns"]


# -- the systems and the driver --------------------------------------------------------


class System(Protocol):
    name: str
    durability: str

    async def session(self, sid: str, k: int) -> None:
        """One session: ``k`` echo iterations then the finish, to its end."""


@dataclass
class Figures:
    name: str
    durability: str
    gaps: list[float] = field(default_factory=list)
    throughput: dict[int, float] = field(default_factory=dict)
    cpu_ms_per_turn: float = 0.0
    llm_cpu_ms_per_turn: float = 0.0  # the fake LLM's, not counted in cpu_ms_per_turn
    llm_requests_per_turn: float = 0.0
    error: str = ""

    def p(self, q: float) -> float:
        ordered = sorted(self.gaps)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0

    @property
    def p50(self) -> float:
        return statistics.median(self.gaps) if self.gaps else 0.0


async def drive(run: Callable[[str], Awaitable[Any]], clients: int, total: int, tag: str) -> float:
    """Sessions/s with ``clients`` concurrent clients running ``total`` sessions."""
    each = max(1, total // clients)

    async def client(i: int) -> None:
        for n in range(each):
            await run(f"{tag}c{i}n{n}")

    started = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(clients)))
    return clients * each / (time.perf_counter() - started)


async def measure(
    system: System, llm: LLMServer, k: int, concurrency: list[int], turns: int, overhead_runs: int
) -> Figures:
    fig = Figures(system.name, system.durability)
    await drive(lambda s: system.session(s, 1), 8, 16, "warm")
    await llm.gaps()
    for i in range(overhead_runs):
        await system.session(f"over{i}", k)
    fig.gaps = await llm.gaps()
    top = max(concurrency)
    for c in concurrency:
        if c == top:
            before = tree_cpu({llm.proc.pid})
            requests, llm_cpu = await llm.stats()
        n = max(turns, c)
        fig.throughput[c] = await drive(lambda s: system.session(s, 1), c, n, f"t{c}")
        if c == top:
            spent = tree_cpu({llm.proc.pid}) - before
            sessions = c * max(1, n // c)
            fig.cpu_ms_per_turn = spent / sessions * 1000
            requests_after, llm_cpu_after = await llm.stats()
            fig.llm_cpu_ms_per_turn = (llm_cpu_after - llm_cpu) / sessions * 1000
            fig.llm_requests_per_turn = (requests_after - requests) / sessions
    return fig


ECHO_TOOL = {
    "type": "function",
    "function": {
        "name": "echo",
        "description": "Return the text.",
        "parameters": {
            "type": "object",
            "properties": {"text": {"type": "string"}},
            "required": ["text"],
        },
    },
}


async def chat(client: Any, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """One streamed completion, requested as loopmesh's engine requests it (the same
    bytes to and from the fake server for every system), assembled into an assistant
    message."""
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    # The request as loopmesh sends it: the client's post() with a plain JSON body,
    # which skips create()'s typed-params transform (0.2 ms of CPU per message).
    body = {
        "model": "fake-model", "messages": messages, "tools": [ECHO_TOOL], "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    stream = await client.post(
        "/chat/completions", body=body, cast_to=ChatCompletion, stream=True,
        stream_cls=openai.AsyncStream[ChatCompletionChunk],
    )  # fmt: skip
    async with stream:
        async for chunk in stream:
            for choice in chunk.choices:
                delta = choice.delta
                if delta.content:
                    content.append(delta.content)
                for tc in delta.tool_calls or ():
                    call = calls.setdefault(
                        tc.index, {"id": "", "type": "function",
                                   "function": {"name": "", "arguments": ""}}
                    )  # fmt: skip
                    if tc.id:
                        call["id"] = tc.id
                    if tc.function and tc.function.name:
                        call["function"]["name"] += tc.function.name
                    if tc.function and tc.function.arguments:
                        call["function"]["arguments"] += tc.function.arguments
    message: dict[str, Any] = {"role": "assistant", "content": "".join(content)}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message
