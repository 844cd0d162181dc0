"""A durable mesh's test helpers that tests and benches share: short-lived JetStream
set-ups, reading a session's stored events, waiting on state in NATS, and services run
as real processes (by module name: nothing here imports a service).

    await provision_short(nc)              # AckWait and lease TTL of 2 s
    events = await stream_events(nc, "acme", "s1")
    snapshot = await kv_read(nc, SUBJECTS.sessions_bucket, "acme.s1")   # from the leader
    worker = await Proc("-m", "loop_worker", env=worker_env(url, llm_url)).start("serving")
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import nats.js.errors
from nats.aio.client import Client
from nats.js.errors import NotFoundError

from loopmesh.jetstream import KVEntry, retry
from loopmesh.nats import connect
from loopmesh.process import terminate
from loopmesh.provision import ensure_consumer, has_msg_ttl, provision
from loopmesh.settings import NatsSettings
from schemas import Subjects, decode, definitions
from schemas.events import AnyEvent, Event
from schemas.streams import tenant_consumer

SUBJECTS = Subjects()

#: The repository's root: the working directory and ``PYTHONPATH`` of :class:`Proc`.
ROOT = Path(__file__).resolve().parents[2]


async def connect_fast(url: str, name: str = "test") -> Client:
    """A client that reconnects quickly and forever, as the services' clients do."""
    return await connect(NatsSettings(url=url, reconnect_wait_s=0.05), name=name)


async def provision_short(
    nc: Client,
    *,
    lease_ttl_s: float = 2.0,
    subjects: Subjects = SUBJECTS,
    replicas: int = 1,
) -> None:
    """Everything loopmesh needs, with a lease TTL short enough for tests (``replicas``:
    3 on a cluster). The tenants' turns consumers are the workers' to make, with their
    ``ack_wait_s``."""
    defs = definitions(subjects, lease_ttl_s=lease_ttl_s, replicas=replicas)
    # A cluster just started may not know its peers' JetStream resources yet: provision
    # waits for them.
    await provision(nc.jetstream(), defs, msg_ttl=has_msg_ttl(nc), placement_wait_s=START_S)


async def tenant_consumer_of(
    nc: Client,
    tenant: str = "acme",
    *,
    ack_wait_s: float = 2.0,
    max_deliver: int = 10,
    subjects: Subjects = SUBJECTS,
) -> str:
    """Make ``tenant``'s turns consumer as a loop worker does at the tenant's first turn
    (with its ``[loop_worker]`` settings: keep them the same); return its name."""
    c = tenant_consumer(subjects, tenant, ack_wait_s=ack_wait_s, max_deliver=max_deliver)
    await ensure_consumer(nc.jetstream(), c)
    return c.durable


async def stream_events(
    nc: Client, tenant: str, session: str, subjects: Subjects = SUBJECTS
) -> list[tuple[Event, dict[str, str]]]:
    """Every stored event of a session, in stream order, with its headers, read from the
    stream's leader until it has no further one. A passing error (a leader being
    elected) is retried, any other raised: a reader that stopped at the first error
    would report events lost that are stored."""
    js = nc.jetstream()
    out: list[tuple[Event, dict[str, str]]] = []
    subject = subjects.session_events(tenant, session)
    stream = subjects.events_stream_of(tenant, session)  # its partition's
    seq = 0
    while True:
        try:
            msg = await retry(
                lambda after=seq: js.get_msg(  # type: ignore[misc]
                    stream, seq=after + 1, subject=subject, next=True
                ),
                f"read the events of {tenant}.{session}",
            )
        except nats.js.errors.NotFoundError:
            return out
        if not msg.seq or msg.seq <= seq:
            raise AssertionError(f"events stream answered sequence {msg.seq} after {seq}")
        seq = msg.seq
        out.append((decode(msg.data or b"", AnyEvent), dict(msg.headers or {})))


async def kv_entry(nc: Client, bucket: str, key: str) -> KVEntry | None:
    """The last revision of ``key`` in ``bucket`` as the bucket's stream leader has it
    (its ``value`` is ``None`` for a delete marker), or ``None``. Tests read here: on a
    replicated bucket a KV get is a direct get, which a follower that has not applied
    the last write yet may answer (docs/ARCHITECTURE.md, "On a cluster")."""
    try:
        msg = await nc.jetstream().get_last_msg(f"KV_{bucket}", f"$KV.{bucket}.{key}")
    except NotFoundError:
        return None
    deleted = bool(msg.headers and msg.headers.get("KV-Operation"))
    return KVEntry(msg.seq or 0, None if deleted else msg.data or b"")


async def kv_read(nc: Client, bucket: str, key: str) -> bytes | None:
    """The value of ``key`` in ``bucket`` as its leader has it (:func:`kv_entry`), or
    ``None`` (no key, or a delete marker)."""
    entry = await kv_entry(nc, bucket, key)
    return None if entry is None else entry.value


async def wait_for(
    predicate: Callable[[], Awaitable[bool] | bool],
    *,
    timeout: float = 10.0,
    what: str = "",
    every: float = 0.02,
) -> None:
    """Poll ``predicate`` every ``every`` seconds until true, failing after ``timeout``
    (state in NATS has no event to wait on from a test). A predicate that asks the
    gateway polls no faster than the key's rate limit allows, or the polling itself is
    answered 429."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        await asyncio.sleep(every)


async def drained(nc: Client, stream: str, *, timeout: float = 10.0) -> None:
    """Wait until the work-queue ``stream`` holds no message: a turn is acked just after
    its ``loop_end`` goes out, so a test that saw the ``loop_end`` may be a moment early."""

    async def empty() -> bool:
        return (await nc.jetstream().stream_info(stream)).state.messages == 0

    await wait_for(empty, timeout=timeout, what=f"{stream} to hold no message")


# -- services as real processes -------------------------------------------------------

#: How long a process gets to print a line it prints on its way up: starting Python and
#: importing loopmesh, several processes at once (``loopmesh up``), takes over 30 s on a
#: loaded 2-core machine.
START_S = 120.0


class Proc:
    """A service in its own process (``python -m ...``), its log lines collected, so a
    test can wait for one and kill the process as a crash would."""

    def __init__(
        self, *args: str, env: dict[str, str] | None = None, python: str | None = None
    ) -> None:
        self.args = args
        self.env = env or {}
        self.python = python or sys.executable  # another venv's interpreter, say
        self.lines: list[str] = []
        self._changed = asyncio.Condition()
        self.proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None

    async def start(self, ready: str | None = None, timeout: float = START_S) -> Proc:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", **self.env}
        self.proc = await asyncio.create_subprocess_exec(
            self.python, *self.args, cwd=str(ROOT), env=env,
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        self._reader = asyncio.create_task(self._read())
        if ready is not None:
            await self.wait_line(ready, timeout)
        return self

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        async for raw in self.proc.stdout:
            async with self._changed:
                self.lines.append(raw.decode(errors="replace").rstrip())
                self._changed.notify_all()
        async with self._changed:
            self._changed.notify_all()

    async def wait_line(self, text: str, timeout: float = START_S) -> str:
        def found() -> str | None:
            return next((line for line in self.lines if text in line), None)

        try:
            async with asyncio.timeout(timeout), self._changed:
                await self._changed.wait_for(
                    lambda: (
                        found() is not None or (self._reader is not None and self._reader.done())
                    )
                )
        except TimeoutError:
            raise AssertionError(f"no {text!r} within {timeout}s:\n" + self.output()) from None
        line = found()
        if line is None:
            raise AssertionError(f"process ended before {text!r}:\n" + self.output())
        return line

    def output(self, last: int = 60) -> str:
        return "\n".join(self.lines[-last:])

    def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()

    async def terminate(self, timeout: float = 20.0) -> int:
        assert self.proc is not None
        return await terminate(self.proc, timeout)

    async def close(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
        if self.proc is not None:
            await self.proc.wait()
        if self._reader is not None:
            await self._reader


def worker_env(
    nats_url: str,
    llm_url: str,
    *,
    replicas: int = 1,
    partitions: int = 1,
    turn_partitions: int = 1,
    **service: Any,
) -> dict[str, str]:
    """Settings of a loop-worker process, as environment variables (``partitions``,
    ``turn_partitions``: ``[nats]``'s, which every process of a mesh must share)."""
    env = {
        "LOOPMESH_NATS__URL": nats_url,
        "LOOPMESH_NATS__REPLICAS": str(replicas),
        "LOOPMESH_NATS__PARTITIONS": str(partitions),
        "LOOPMESH_NATS__TURN_PARTITIONS": str(turn_partitions),
        "LOOPMESH_NATS__RECONNECT_WAIT_S": "0.05",
        "LOOPMESH_LLM__BASE_URL": llm_url,
        "LOOPMESH_LLM__API_KEY": "test",
        "LOOPMESH_LLM__MODEL": "fake-model",
        "LOOPMESH_LOOP__MAX_ITERATIONS": "6",
        "LOOPMESH_LOOP_WORKER__ACK_WAIT_S": "2",
        "LOOPMESH_LOOP_WORKER__LEASE_TTL_S": "2",
        "LOOPMESH_LOOP_WORKER__FETCH_TIMEOUT_S": "0.2",
        "LOOPMESH_LOOP_WORKER__RESCAN_S": "0.5",
    }
    for key, value in service.items():
        env[f"LOOPMESH_LOOP_WORKER__{key.upper()}"] = str(value)
    return env
