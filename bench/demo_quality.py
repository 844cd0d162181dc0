"""Does the embedded demo model do simple tool tasks right? Measured through the real stack.

    python -m bench.demo_quality [--runs 5] [--tasks arithmetic,time,fetch] [--verbose]

Starts ``loopmesh up`` as a person does (an embedded nats-server, the tool worker, the
loop worker with the embedded llama.cpp server on SmolLM2-135M, the gateway) and a
local web page on 127.0.0.1 (allowed to ``http_fetch`` by ``[tool_worker]
http_allowlist``), then runs each task ``--runs`` times with ``loopmesh run``, each in a
fresh session. A run succeeds when the task's tool was called (served by the tool
worker), the turn ended by ``task_completion`` and its answer holds the tool's result:
``391`` for the arithmetic, the hour and minute the clock tool returned for the time
(and no other time of day), the code on the page for the fetch. Prints the success
rate per task. Needs the ``local`` extra (``make run`` installs it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

PAGE = b"<html><body><h1>Notes</h1><p>The launch code is 4417.</p></body></html>"


@dataclass(frozen=True)
class Task:
    name: str
    prompt: str
    tool: str  # "server.tool"
    #: the text the answer must hold, from the tool's result
    expected: Callable[[str], str]
    #: what the answer says against the tool's result (result, answer → the parts)
    contradicts: Callable[[str, str], list[str]] = lambda result, answer: []


def tasks(page_url: str) -> list[Task]:
    return [
        Task("arithmetic", "What is 17 * 23?", "local.calculator", lambda _: "391"),
        Task("time", "What time is it?", "local.current_time", _hour_minute, _other_times),
        Task(
            "fetch",
            f"Fetch {page_url} and tell me what it says.",
            "local.http_fetch",
            lambda _: "4417",
        ),
    ]


def _hour_minute(result: str) -> str:
    """``2026-11-23T04:12:01+00:00`` → ``04:12``: what an answer to the time must say."""
    found = re.search(r"T(\d\d:\d\d)", result)
    return found.group(1) if found else "\0"  # no time in the result: nothing matches


#: A time of day as written (``11:16`` or ``11:16:40``), not a UTC offset's ``+00:00``.
_TIME = re.compile(r"(?<![\d:+-])(\d\d:\d\d(?::\d\d)?)")


def _other_times(result: str, answer: str) -> list[str]:
    """The times of day in ``answer`` that are not the result's (``11:17:45`` when the
    clock said ``11:16:40``): a right hour and minute followed by a made-up time fails."""
    found = re.search(r"T(\d\d:\d\d:\d\d)", result)
    said = found.group(1) if found else "\0"
    return [t for t in _TIME.findall(answer) if not said.startswith(t)]


@dataclass
class Outcome:
    ok: bool
    why: str


def judge(task: Task, events: list[dict[str, Any]]) -> Outcome:
    calls = [e for e in events if e.get("type") == "tool_call" and e.get("server") != "loop"]
    results = [e for e in events if e.get("type") == "tool_result" and e.get("server") != "loop"]
    ends = [e for e in events if e.get("type") == "loop_end"]
    called = [f"{c.get('server')}.{c.get('tool')}" for c in calls]
    if not ends:
        return Outcome(False, "no loop_end")
    end = ends[-1]
    if task.tool not in called:
        return Outcome(False, f"tools called {called or 'none'}; ended {end.get('reason')}")
    result = next(
        (str(r.get("content", "")) for r in results if f"{r['server']}.{r['tool']}" == task.tool),
        "",
    )
    if not result:
        return Outcome(False, f"{task.tool} returned no result")
    want = task.expected(result)
    answer = str(end.get("content") or "")
    if end.get("reason") != "task_completion":
        return Outcome(False, f"ended {end.get('reason')}: {answer[:120]!r}")
    if want not in answer:
        return Outcome(False, f"answer lacks {want!r}: {answer[:160]!r}")
    if wrong := task.contradicts(result, answer):
        return Outcome(False, f"answer also says {wrong}, not {result!r}: {answer[:160]!r}")
    return Outcome(True, f"answer {answer[:120]!r}")


class _Page(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(PAGE)))
        self.end_headers()
        self.wfile.write(PAGE)

    def log_message(self, format: str, *args: Any) -> None:
        pass


class Up:
    """``loopmesh up`` in a subprocess, on free ports, until :meth:`stop`."""

    def __init__(self, store: str, env: dict[str, str]) -> None:
        self.store = store
        self.env = env
        self.proc: asyncio.subprocess.Process | None = None
        self.url = ""
        self.lines: list[str] = []
        self._drain: asyncio.Task[None] | None = None

    async def start(self, timeout: float) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "loopmesh", "up", "--port", "-1", "--monitor-port", "-1",
            "--store-dir", self.store,
            env={**os.environ, **self.env},
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        line = await self._until("set LOOPMESH_NATS__URL=", timeout)
        found = re.search(r"set LOOPMESH_NATS__URL=(\S+)", line)
        assert found is not None
        self.url = found.group(1)
        await self._until("loop worker ready", timeout)
        self._drain = asyncio.create_task(self._read_rest())  # a full pipe would block it

    async def _read_rest(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        async for raw in self.proc.stdout:
            self.lines.append(raw.decode(errors="replace").rstrip())
            del self.lines[:-200]

    async def _until(self, text: str, timeout: float) -> str:
        assert self.proc is not None and self.proc.stdout is not None
        async with asyncio.timeout(timeout):
            while True:
                raw = await self.proc.stdout.readline()
                if not raw:
                    raise RuntimeError("loopmesh up exited:\n" + "\n".join(self.lines[-20:]))
                line = raw.decode(errors="replace").rstrip()
                self.lines.append(line)
                if text in line:
                    return line

    async def stop(self) -> None:
        if self.proc is None or self.proc.returncode is not None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            await asyncio.wait_for(self.proc.wait(), 60)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()
        if self._drain is not None:
            await self._drain


async def run_turn(url: str, prompt: str, timeout: float) -> list[dict[str, Any]]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "loopmesh", "run", "--nats-url", url, "--json",
        "--timeout", str(timeout), prompt,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    out, _ = await proc.communicate()
    events = []
    for line in out.decode(errors="replace").splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(event, dict):
            events.append(event)
    return events


async def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.demo_quality", description=__doc__)
    parser.add_argument("--runs", type=int, default=5, help="runs of each task (5)")
    parser.add_argument("--tasks", default="arithmetic,time,fetch", help="which tasks")
    parser.add_argument("--timeout", type=float, default=900.0, help="per turn, seconds")
    parser.add_argument("--verbose", action="store_true", help="print every run")
    args = parser.parse_args(argv)

    page = ThreadingHTTPServer(("127.0.0.1", 0), _Page)
    threading.Thread(target=page.serve_forever, daemon=True).start()
    page_url = f"http://127.0.0.1:{page.server_address[1]}/notes.html"
    chosen = [t for t in tasks(page_url) if t.name in args.tasks.split(",")]
    env = {
        "OPENAI_API_KEY": "",  # the embedded model, whatever the environment says
        "LOOPMESH_GATEWAY__PORT": "0",
        "LOOPMESH_TOOL_WORKER__HTTP_ALLOWLIST": '["127.0.0.1"]',
    }
    with tempfile.TemporaryDirectory(prefix="demo-quality-") as store:
        up = Up(store, env)
        try:
            await up.start(timeout=300)
            rates = []
            for task in chosen:
                wins = 0
                for n in range(1, args.runs + 1):
                    outcome = judge(task, await run_turn(up.url, task.prompt, args.timeout))
                    wins += outcome.ok
                    if args.verbose:
                        mark = "ok  " if outcome.ok else "FAIL"
                        print(f"{task.name:<10} run {n}: {mark} {outcome.why}", flush=True)
                rates.append((task, wins))
                print(f"{task.name:<10} {wins}/{args.runs}  {task.prompt!r}", flush=True)
        finally:
            await up.stop()
            page.shutdown()
    return 0 if all(wins * 5 >= args.runs * 4 for _, wins in rates) else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
