"""Test helpers: a requester that publishes calls the way the loop worker does, an event
log, in-process and out-of-process workers."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from loopmesh.testing.durable import wait_for
from schemas import AnyEvent, Subjects, ToolCallRequest, ToolResult, decode, encode
from schemas import call_id as make_call_id
from tool_worker import Registry
from tool_worker.service import ToolWorker

SUBJECTS = Subjects()
_INDEXES = itertools.count(1000)  # default indexes, apart from a test's own small ones
ROOT = Path(__file__).resolve().parents[2]


async def redeliver_after(js: JetStreamContext, seconds: float, pool: str = "default") -> None:
    """Set the pool consumer's AckWait to ``seconds``, below the workers' own (they send
    in-progress acks every third of theirs): a call that runs longer is delivered
    again while it runs, as when its in-progress acks are lost."""
    durable = SUBJECTS.pool_consumer(pool)
    info = await js.consumer_info(SUBJECTS.tools_stream, durable)
    config = dataclasses.replace(info.config, ack_wait=seconds)
    await js.add_consumer(SUBJECTS.tools_stream, config)


async def wait_settled(js: JetStreamContext, what: str, pool: str = "default") -> None:
    """Until the pool consumer has nothing pending and nothing awaiting its ack."""
    durable = SUBJECTS.pool_consumer(pool)

    async def settled() -> bool:
        info = await js.consumer_info(SUBJECTS.tools_stream, durable)
        return info.num_ack_pending == 0 and info.num_pending == 0

    await wait_for(settled, timeout=30, what=what)


class Requester:
    """Publishes ToolCallRequests to the tools stream and collects the replies."""

    def __init__(self, nc: Client, pool: str = "default") -> None:
        self.nc = nc
        self.pool = pool
        self.inbox = nc.new_inbox()
        self.results: dict[str, asyncio.Future[ToolResult]] = {}
        self.replies: list[ToolResult] = []

    async def __aenter__(self) -> Requester:
        self._sub = await self.nc.subscribe(self.inbox + ".*", cb=self._on_reply)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._sub.unsubscribe()

    async def _on_reply(self, msg: Msg) -> None:
        result = decode(msg.data, ToolResult)
        self.replies.append(result)
        fut = self.results.get(msg.subject.rsplit(".", 1)[1])
        if fut is not None and not fut.done():
            fut.set_result(result)

    def request(
        self, server: str, tool: str, arguments: dict[str, Any] | None = None, **kw: Any
    ) -> ToolCallRequest:
        """A request as the loop worker makes it: the call id is ``call_id`` of its
        tenant, session, turn, iteration and ``index`` (by default a fresh one, so a
        test's calls never share an id), unless ``call_id`` is given."""
        tenant, session = kw.pop("tenant", "t1"), kw.pop("session", "s1")
        turn_id, iteration = kw.pop("turn_id", "turn1"), kw.pop("iteration", 2)
        index = kw.pop("index", None)
        call_id = kw.pop("call_id", None) or make_call_id(
            tenant, session, turn_id, iteration, next(_INDEXES) if index is None else index
        )
        return ToolCallRequest(
            call_id=call_id,
            tenant=tenant,
            session=session,
            turn_id=turn_id,
            iteration=iteration,
            server=server,
            tool=tool,
            arguments=arguments or {},
            reply_to=f"{self.inbox}.{call_id}",
            created_at=time.time(),
            **kw,
        )

    async def publish(self, req: ToolCallRequest, payload: bytes | None = None) -> Any:
        self.results.setdefault(req.call_id, asyncio.get_running_loop().create_future())
        subject = SUBJECTS.tool(self.pool, req.server, req.tool)
        return await self.nc.jetstream().publish(
            subject, payload or encode(req), headers={"Nats-Msg-Id": req.call_id}
        )

    async def result(self, call_id: str, timeout: float = 10.0) -> ToolResult:
        fut = self.results.setdefault(call_id, asyncio.get_running_loop().create_future())
        async with asyncio.timeout(timeout):
            return await asyncio.shield(fut)

    async def call(
        self,
        server: str,
        tool: str,
        arguments: dict[str, Any] | None = None,
        *,
        timeout: float = 10.0,
        **kw: Any,
    ) -> ToolResult:
        req = self.request(server, tool, arguments, **kw)
        await self.publish(req)
        return await self.result(req.call_id, timeout)


class EventLog:
    """Every event published under the prefix, as it arrives (core subscription)."""

    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self.events: list[Any] = []
        self._changed = asyncio.Event()

    async def __aenter__(self) -> EventLog:
        self._sub = await self.nc.subscribe(SUBJECTS.all_events, cb=self._on_event)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._sub.unsubscribe()

    async def _on_event(self, msg: Msg) -> None:
        self.events.append(decode(msg.data, AnyEvent))
        self._changed.set()

    async def wait_for(self, predicate: Callable[[Any], bool], timeout: float = 10.0) -> Any:
        async with asyncio.timeout(timeout):
            while True:
                for event in self.events:
                    if predicate(event):
                        return event
                self._changed.clear()
                await self._changed.wait()


@contextlib.asynccontextmanager
async def running(nc: Client, registry: Registry, **kw: Any) -> AsyncIterator[ToolWorker]:
    """A ToolWorker running in this process until the block ends."""
    kw.setdefault("catalog", False)
    worker = ToolWorker(nc, registry, **kw)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        async with asyncio.timeout(30):
            ready = asyncio.create_task(worker.ready.wait())
            await asyncio.wait([ready, task], return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                ready.cancel()
                task.result()
        yield worker
    finally:
        stop.set()
        await task


class WorkerProcess:
    """``python -m tool_worker`` in a subprocess; ``ready()`` waits for its log line."""

    def __init__(self, url: str, *args: str, env: dict[str, str] | None = None) -> None:
        self.argv = [sys.executable, "-m", "tool_worker", "--nats-url", url, *args]
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
        self.lines: list[str] = []
        self.proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None
        self._line = asyncio.Event()

    async def start(self) -> WorkerProcess:
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv,
            env=self.env,
            cwd=ROOT,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        self._reader = asyncio.create_task(self._read())
        return self

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        async for raw in self.proc.stderr:
            self.lines.append(raw.decode(errors="replace").rstrip())
            self._line.set()

    async def wait_for_line(self, text: str, timeout: float = 30.0) -> str:
        async with asyncio.timeout(timeout):
            while True:
                for line in self.lines:
                    if text in line:
                        return line
                if self._reader is not None and self._reader.done():
                    raise AssertionError("worker exited:\n" + "\n".join(self.lines))
                self._line.clear()
                await self._line.wait()

    async def ready(self, timeout: float = 120.0) -> WorkerProcess:
        """Its start-up line; a Python process importing the tool worker takes its time on
        a loaded machine, several started at once longer still (over 30 s seen)."""
        await self.wait_for_line("serving pool=", timeout)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)

    def terminate(self) -> None:
        os.kill(self.pid, signal.SIGTERM)

    async def wait(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        async with asyncio.timeout(timeout):
            code = await self.proc.wait()
            if self._reader is not None:
                await self._reader
        return code

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
        if self.proc is not None:
            await self.wait()
