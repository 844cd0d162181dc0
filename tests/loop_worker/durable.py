"""Helpers for the durable loop-worker tests: provisioning with short timeouts, a
minimal in-test tool pool that follows the tool worker's side of the wire, an
in-process mesh of services (:func:`mesh_on`), and waiting on the events stream."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
from nats.aio.client import Client
from nats.js import api as js_api

from loopmesh.nats import connect
from loopmesh.provision import ensure_consumer
from loopmesh.settings import NatsSettings
from loopmesh.testing.durable import SUBJECTS, connect_fast, provision_short
from loopmesh.testing.fake_llm import FakeLLM
from loopmesh.testing.fake_replies import auto
from schemas import (
    DecodeError,
    Subjects,
    ToolCallRequest,
    ToolResult,
    ToolSpec,
    Turn,
    catalog_key,
    decode,
    encode,
    pool_consumer,
)
from schemas.events import Event, ToolResultEvent, decode_event, tool_event_msg_id

Handler = Callable[[ToolCallRequest], Awaitable[str]]


async def register_tool(nc: Client, spec: ToolSpec, subjects: Subjects = SUBJECTS) -> None:
    kv = await nc.jetstream().key_value(subjects.catalog_bucket)
    await kv.put(catalog_key(spec.server, spec.name), encode(spec))


@contextlib.asynccontextmanager
async def fake_pool(
    nc: Client,
    handler: Handler,
    *,
    pool: str = "default",
    reply: bool = True,
    subjects: Subjects = SUBJECTS,
) -> AsyncIterator[list[ToolCallRequest]]:
    """Serve ``pool`` like a tool worker: effects first, record, event, reply, ack.
    Yields the list of requests it ran."""
    js = nc.jetstream()
    await ensure_consumer(js, pool_consumer(subjects, pool, ack_wait_s=2.0))
    effects = await js.key_value(subjects.effects_bucket)
    sub = await js.pull_subscribe_bind(subjects.pool_consumer(pool), subjects.tools_stream)
    ran: list[ToolCallRequest] = []

    async def serve() -> None:
        while True:
            try:
                msgs = await sub.fetch(1, timeout=0.5)
            except TimeoutError:
                continue
            for msg in msgs:
                req = decode(msg.data, ToolCallRequest)
                try:
                    entry = await effects.get(req.call_id)
                    data = entry.value or b""
                except Exception:
                    ran.append(req)
                    content = await handler(req)
                    result = ToolResult(
                        call_id=req.call_id, content=content, server=req.server, tool=req.tool
                    )
                    data = encode(result)
                    await effects.put(req.call_id, data)
                    event = ToolResultEvent(
                        tenant=req.tenant, session=req.session, turn_id=req.turn_id,
                        iteration=req.iteration, call_id=req.call_id, server=req.server,
                        tool=req.tool, content=content, ts=time.time(),
                    )  # fmt: skip
                    await js.publish(
                        subjects.event(req.tenant, req.session, "tool_result"),
                        encode(event),
                        headers={"Nats-Msg-Id": tool_event_msg_id(req.call_id, "tool_result")},
                    )
                if reply and req.reply_to:
                    await nc.publish(req.reply_to, data)
                await msg.ack()

    task = asyncio.create_task(serve())
    try:
        yield ran
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await sub.unsubscribe()


def record_replies(nc: Client) -> list[str]:
    """Wrap ``nc.publish`` to record each publish's reply subject, in order (``""`` for a
    publish that asks for no ack); the list fills as the client publishes."""
    publish = nc.publish
    replies: list[str] = []

    async def recording(
        subject: str, payload: bytes = b"", reply: str = "", headers: Any = None
    ) -> None:
        replies.append(reply)
        await publish(subject, payload, reply=reply, headers=headers)

    nc.publish = recording  # type: ignore[method-assign]
    return replies


def consumer_config(ack_wait_s: float) -> js_api.ConsumerConfig:
    return js_api.ConsumerConfig(ack_wait=ack_wait_s)


def spec(name: str, *, server: str = "local", pool: str = "default", **kw: Any) -> ToolSpec:
    return ToolSpec(server=server, name=name, pool=pool, **kw)


def turn(turn_id: str, task: str, *, tenant: str = "acme", session: str = "s1", **kw: Any) -> Turn:
    """Turn ``turn_id`` of ``tenant``'s ``session``, created now, asking ``task``."""
    return Turn(
        id=turn_id, tenant=tenant, session=session, input=task, created_at=time.time(), **kw
    )


def count_task(path: Any, label: str = "a", *, seconds: float = 0.0, tool: str = "count") -> str:
    """A task the fake LLM (``auto()``) does by calling ``local__<tool>`` (``count`` or
    ``guarded``, tests/loop_worker/tools.py): it appends ``label`` to the file at
    ``path``, ``count`` then waits ``seconds``."""
    args: dict[str, Any] = {"path": str(path), "label": label, "seconds": seconds}
    if tool != "count":
        args.pop("seconds")
    return f"call local__{tool} {json.dumps(args)}"


async def turns_left(nc: Client, subjects: Subjects = SUBJECTS) -> int:
    """Turns still in the turns stream (a turn leaves it once acked or dead-lettered)."""
    return (await nc.jetstream().stream_info(subjects.turns_stream)).state.messages


# -- an in-process mesh: loop workers and a tool worker as tasks, each its own client ----


class Running:
    """A service running as a task with its own NATS client; ``await stop()``."""

    def __init__(self, service: Any, client: Client, task: asyncio.Task[None]) -> None:
        self.service = service
        self.client = client
        self.task = task
        self.stop_event = asyncio.Event()

    async def stop(self) -> None:
        self.stop_event.set()
        try:
            await asyncio.wait_for(asyncio.shield(self.task), 30)
        finally:
            await self.client.close()


class Mesh:
    """NATS, a fake LLM, and services started on demand; tests drive turns through it."""

    def __init__(
        self,
        url: str,
        llm_url: str,
        nc: Client,
        *,
        replicas: int = 1,
        partitions: int = 1,
        turn_partitions: int = 1,
        fake: FakeLLM | None = None,
    ) -> None:
        self.url = url
        self.llm_url = llm_url
        self.nc = nc
        self.replicas = replicas  # what the services provision with: 3 on a cluster
        self.partitions = partitions  # [nats] partitions of every service
        self.turn_partitions = turn_partitions  # [nats] turn_partitions, the same
        self.subjects = Subjects(partitions=partitions, turn_partitions=turn_partitions)
        self.fake = fake  # the fake LLM server at llm_url, when the test scripts it
        self.running: list[Running] = []

    def config(self, **service: Any) -> Any:
        from loop_worker.config import LoopWorkerConfig, ServiceSettings
        from loop_worker.engine.settings import LLMSettings, LoopSettings

        service.setdefault("ack_wait_s", 2.0)
        service.setdefault("lease_ttl_s", 2.0)
        service.setdefault("fetch_timeout_s", 0.2)
        service.setdefault("rescan_s", 0.5)
        loop = service.pop("loop", LoopSettings(max_iterations=6))
        webhooks = service.pop("webhooks", None)
        tenants = service.pop("tenants", {})  # [tenants]
        llm = {"max_retries": 0, **service.pop("llm_settings", {})}
        config = LoopWorkerConfig(
            nats=NatsSettings(
                url=self.url, reconnect_wait_s=0.05, replicas=self.replicas,
                partitions=self.partitions, turn_partitions=self.turn_partitions,
            ),
            llm=LLMSettings(
                base_url=self.llm_url, api_key="test", model="fake-model",
                backoff_initial_s=0.05, **llm,
            ),
            loop=loop,
            loop_worker=ServiceSettings(**service),
            tenants=tenants,
        )  # fmt: skip
        return config if webhooks is None else msgspec.structs.replace(config, webhooks=webhooks)

    async def loop_worker(self, name: str = "w1", *, llm: Any = None, **service: Any) -> Running:
        """A loop worker against the fake LLM server (or ``llm``, an engine ``LLM``), with
        its rate limiter as production has it (``llm_settings={"limits": ...}``: [llm])."""
        from loop_worker.engine.llm import OpenAILLM
        from loop_worker.limiter import SharedLimiter
        from loop_worker.service import LoopWorker

        config = self.config(name=name, **service)
        client = await connect(config.nats, name=name)
        limiter = SharedLimiter.for_worker(client, config)
        openai = OpenAILLM(config.llm, limiter=limiter)
        worker = LoopWorker(client, config, llm=llm or openai, limiter=limiter)
        running: Running

        async def run() -> None:
            try:
                await worker.run(running.stop_event)
            finally:
                await openai.aclose()

        running = Running(worker, client, asyncio.create_task(run()))
        self.running.append(running)
        await _ready(worker.ready, running.task)
        return running

    async def tool_worker(self, pool: str = "default") -> Running:
        from tool_worker.local import load_module
        from tool_worker.registry import Registry
        from tool_worker.service import ToolWorker

        client = await connect(NatsSettings(url=self.url, reconnect_wait_s=0.05), name="tools")
        worker = ToolWorker(
            client, Registry(load_module("tests.loop_worker.tools")), pool=pool, ack_wait_s=2.0,
            subjects=self.subjects,
        )  # fmt: skip
        stop = asyncio.Event()
        running = Running(worker, client, asyncio.create_task(worker.run(stop)))
        running.stop_event = stop
        self.running.append(running)
        await _ready(worker.ready, running.task)
        return running

    async def close(self) -> None:
        for running in reversed(self.running):
            if not running.task.done() or not running.client.is_closed:
                with contextlib.suppress(Exception):
                    await running.stop()


@contextlib.asynccontextmanager
async def mesh_on(
    url: str,
    *,
    replicas: int = 1,
    partitions: int = 1,
    turn_partitions: int = 1,
    provisioned: bool = False,
    workers: bool = False,
) -> AsyncIterator[Mesh]:
    """A :class:`Mesh` on the nats-server (or cluster) at ``url``, provisioned with short
    timeouts unless ``provisioned`` already, against a fake LLM answering by ``auto()``
    (``mesh.fake``); with ``workers``, a tool worker and a loop worker already serve.
    ``partitions``, ``turn_partitions``: ``[nats]``'s, of the provisioning and of every
    service (the server must have the turn mappings of the second)."""
    nc = await connect_fast(url)
    try:
        if not provisioned:
            subjects = Subjects(partitions=partitions, turn_partitions=turn_partitions)
            await provision_short(nc, replicas=replicas, subjects=subjects)
        async with FakeLLM(default=auto()) as llm:
            mesh = Mesh(
                url, llm.base_url, nc, replicas=replicas, partitions=partitions,
                turn_partitions=turn_partitions, fake=llm,
            )  # fmt: skip
            try:
                if workers:
                    await mesh.tool_worker()
                    await mesh.loop_worker()
                yield mesh
            finally:
                await mesh.close()
    finally:
        await nc.close()


def gateway_on(url: str, **settings: Any) -> Any:
    """The real gateway (``async with``) on the NATS at ``url``, on a free port, with
    ``settings`` (``gateway.settings.GatewaySettings``'s fields)."""
    from gateway.server import GatewayServer
    from gateway.settings import GatewayConfig, GatewaySettings

    settings.setdefault("port", 0)
    return GatewayServer(
        GatewayConfig(
            nats=NatsSettings(url=url, reconnect_wait_s=0.05),
            gateway=GatewaySettings(**settings),
        )
    )


async def _ready(ready: asyncio.Event, task: asyncio.Task[None]) -> None:
    waiter = asyncio.ensure_future(ready.wait())
    done, _ = await asyncio.wait({waiter, task}, timeout=60, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    if task in done:
        task.result()
        raise AssertionError("service ended before it was ready")
    if not ready.is_set():
        raise AssertionError("service not ready within 60s")


async def send_turn(nc: Client, turn: Any, subjects: Subjects = SUBJECTS) -> int:
    from loopmesh.turns import publish_turn

    return (await publish_turn(nc.jetstream(), subjects, turn)).seq


class Watch:
    """Every event of one session from now on (``since=0``: from its first), in stream
    order; wait on them."""

    def __init__(
        self,
        nc: Client,
        tenant: str = "acme",
        session: str = "s1",
        *,
        subjects: Subjects = SUBJECTS,
        since: int | None = None,
    ) -> None:
        self.events: list[Event] = []
        self._nc, self._tenant, self._session = nc, tenant, session
        self._since = since  # None: from now on; 0: every event kept
        self._subjects = subjects
        self._sub: Any = None
        self._changed = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Watch:
        from loopmesh.client.nats import follow_session

        self._sub = await follow_session(
            self._nc, self._subjects, self._tenant, self._session, since=self._since
        )
        self._task = asyncio.create_task(self._collect())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(Exception):
            await self._sub.unsubscribe()

    async def _collect(self) -> None:
        while True:
            msg = await self._sub.next_msg(timeout=None)
            try:
                event = decode_event(msg.data)
            except DecodeError:
                continue
            async with self._changed:
                self.events.append(event)
                self._changed.notify_all()

    def of(self, type_: str, turn_id: str | None = None) -> list[Event]:
        return [
            e for e in self.events if e.type == type_ and (turn_id is None or e.turn_id == turn_id)
        ]

    async def wait(
        self, type_: str, turn_id: str | None = None, *, count: int = 1, timeout: float = 10.0
    ) -> Event:
        """The ``count``-th event of ``type_`` (of ``turn_id``), waiting up to ``timeout``."""
        try:
            async with asyncio.timeout(timeout), self._changed:
                await self._changed.wait_for(lambda: len(self.of(type_, turn_id)) >= count)
        except TimeoutError:
            seen = [e.type for e in self.events]
            raise AssertionError(
                f"no {type_} for {turn_id} within {timeout}s; saw {seen}"
            ) from None
        return self.of(type_, turn_id)[count - 1]
