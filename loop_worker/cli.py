"""``loopmesh loop-worker``: run agent-loop turns from NATS, durably."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import msgspec

from loopmesh import llama
from loopmesh.aio import unless
from loopmesh.cli import config_from_args
from loopmesh.metrics import MetricsServer
from loopmesh.nats import connect
from loopmesh.process import keep_running
from loopmesh.provision import provision_all
from loopmesh.settings import environ, replace
from loopmesh.shutdown import shutdown_on_signals

from .config import LoopWorkerConfig
from .engine.constrained import ConstrainedLLM
from .engine.llm import OpenAILLM
from .engine.protocols import LLM
from .engine.ratelimit import RateLimiter
from .engine.settings import LLMSettings, LoopSettings
from .limiter import SharedLimiter
from .service import LoopWorker

log = logging.getLogger("loopmesh.loop_worker")

HELP = """Run agent-loop turns from the turns stream.

The worker pulls turns from the shared durable consumer, runs many sessions at once
(one lease per session), checkpoints every iteration, and acks a turn once its last
event is stored; a turn of a worker that dies is resumed by another from its last
checkpoint. The LLM is any OpenAI-compatible endpoint ([llm] base_url, api_key, model).
SIGTERM stops it gracefully."""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-active", type=int, help="turns run at once (default 256)")
    parser.add_argument("--name", help="the worker's name in events and leases")
    parser.add_argument("--metrics-port", type=int, help="serve /metrics and /healthz here")
    parser.add_argument("--llm-base-url", metavar="URL", help="overrides [llm] base_url")
    parser.add_argument("--model", help="overrides [llm] model")
    parser.add_argument(
        "--no-provision", action="store_true",
        help="do not create missing streams and buckets (the turns consumer is always ensured)",
    )  # fmt: skip


def config_of(args: argparse.Namespace) -> LoopWorkerConfig:
    """The configuration from ``--config``, the environment and the command line."""
    config = config_from_args(LoopWorkerConfig, args)
    service: dict[str, object] = {}
    if getattr(args, "max_active", None) is not None:
        service["max_active_turns"] = args.max_active
    if getattr(args, "name", None):
        service["name"] = args.name
    if getattr(args, "metrics_port", None) is not None:
        service["metrics_port"] = args.metrics_port
    if getattr(args, "no_provision", False):
        service["provision"] = False
    llm: dict[str, object] = {}
    if getattr(args, "llm_base_url", None):
        llm["base_url"] = args.llm_base_url
    if getattr(args, "model", None):
        llm["model"] = args.model
    return msgspec.structs.replace(
        config,
        loop_worker=replace(config.loop_worker, "the command line", **service),
        llm=replace(config.llm, "the command line", **llm),
    )


async def main(args: argparse.Namespace) -> int:
    config = config_of(args)
    async with shutdown_on_signals() as stop:
        await serve(config, stop)
    return 0


#: The variables that choose the LLM of ``up`` (else it runs the embedded demo model).
CONFIGURE_LLM = "LOOPMESH_LLM__BASE_URL, LOOPMESH_LLM__API_KEY, LOOPMESH_LLM__MODEL"


def needs_embedded_llm(config: LoopWorkerConfig) -> bool:
    """No LLM configured for loopmesh: no ``[llm] base_url``, ``api_key`` or ``model``
    (the config file, ``LOOPMESH_LLM__*``, ``--llm-base-url``, ``--model``). Variables of
    other tools choose nothing: with only OPENAI_API_KEY set, ``up`` runs the demo model."""
    llm = config.llm
    return not (llm.base_url or llm.api_key or llm.model != LLMSettings().model)


def up_service(args: argparse.Namespace) -> Callable[[asyncio.Event, str], Awaitable[None]]:
    """The loop worker as a service of ``loopmesh up``. With no LLM endpoint configured it
    first starts the embedded llama.cpp server on the tiny demo model, and says so."""

    async def service(stop: asyncio.Event, nats_url: str) -> None:
        config = config_of(args)
        config = msgspec.structs.replace(
            config, nats=msgspec.structs.replace(config.nats, url=nats_url)
        )
        if not needs_embedded_llm(config):
            endpoint = config.llm.base_url or environ("OPENAI_BASE_URL") or "OpenAI"
            _say(f"llm       {endpoint} · model {config.llm.model}")
            await serve(config, stop, provision=False, announce=True)
            return
        if not llama.available():
            _say(
                "llm       none configured, and the embedded demo model is not installed: "
                f"{llama.INSTALL_HINT}; or set [llm] base_url / api_key / model "
                f"({CONFIGURE_LLM}). Turns will fail until then."
            )
            await serve(config, stop, provision=False, announce=True)
            return
        _say("llm       starting the embedded llama.cpp server (SmolLM2-135M-Instruct)...")
        server = llama.LlamaServer()
        if not await _start_unless_stopped(server, stop):
            return
        try:
            _say(
                f"llm       {server.base_url} · SmolLM2-135M-Instruct, a TINY DEMO MODEL: enough "
                "to watch the system work, not to do real work. For a real endpoint set "
                f"[llm] base_url, api_key and model (or {CONFIGURE_LLM})."
            )
            embedded_config = msgspec.structs.replace(
                config,
                llm=demo_llm_settings(config.llm, server),
                loop=demo_loop_settings(config.loop),
            )
            await serve_beside(server, embedded_config, stop)
        finally:
            await server.stop()

    return service


async def serve_beside(
    server: llama.LlamaServer, config: LoopWorkerConfig, stop: asyncio.Event
) -> None:
    """Serve turns on the embedded model while it runs: a model server that dies is
    reported and restarted (:func:`loopmesh.process.keep_running`); one that keeps dying
    stops the worker, and :class:`~loopmesh.process.ChildDied` says why."""
    done = asyncio.Event()  # stop, or the model server given up on
    watch = asyncio.create_task(keep_running("llama.cpp server", server, stop, _say))
    watch.add_done_callback(lambda _: done.set())
    try:
        await serve(config, done, provision=False, announce=True)
    except BaseException:
        watch.cancel()
        await asyncio.wait({watch})
        raise
    await watch  # ChildDied, if that is why the worker stopped


def demo_llm_settings(llm: LLMSettings, server: llama.LlamaServer) -> LLMSettings:
    """The LLM settings for the embedded demo model on ``server``: its sampling options
    (see :mod:`loopmesh.llama`), unless ``[llm]`` sets them."""
    return msgspec.structs.replace(
        llm,
        base_url=server.base_url,
        api_key="local",
        model=server.model,
        max_tokens=llm.max_tokens or llama.MAX_TOKENS,
        temperature=0.0 if llm.temperature is None else llm.temperature,
        seed=llama.SEED if llm.seed is None else llm.seed,
        copy_repeat_penalty=(
            llama.COPY_REPEAT_PENALTY
            if llm.copy_repeat_penalty is None
            else llm.copy_repeat_penalty
        ),
    )


def demo_loop_settings(loop: LoopSettings) -> LoopSettings:
    """The loop settings for the embedded demo model: the constrained tool choice (a
    135M model seldom calls a tool unaided; see ``engine/constrained.py``)."""
    return msgspec.structs.replace(loop, tool_choice_strategy="constrained")


async def copying_llm(
    settings: LLMSettings, stack: contextlib.AsyncExitStack, *, limiter: RateLimiter | None = None
) -> OpenAILLM | None:
    """The constrained strategy's LLM for its second step, when ``copy_repeat_penalty``
    sets one of its own."""
    penalty = settings.copy_repeat_penalty
    if penalty is None or penalty == settings.repeat_penalty:
        return None
    copying = OpenAILLM(msgspec.structs.replace(settings, repeat_penalty=penalty), limiter=limiter)
    return await stack.enter_async_context(copying)


async def _start_unless_stopped(server: llama.LlamaServer, stop: asyncio.Event) -> bool:
    """Start ``server``; give up (and stop it) if ``stop`` is set first."""
    if await unless(stop, server.start()):
        return True
    await server.stop()
    return False


def _say(line: str) -> None:
    print(line, flush=True)


async def _announce_ready(worker: LoopWorker, stop: asyncio.Event) -> None:
    ready = asyncio.ensure_future(worker.ready.wait())
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({ready, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        ready.cancel()
        stopped.cancel()
    if worker.ready.is_set():
        _say(f"loop      loop worker ready ({worker.name}); it takes turns now")


async def serve(
    config: LoopWorkerConfig, stop: asyncio.Event, *, provision: bool = True, announce: bool = False
) -> None:
    """Connect, provision, and run a loop worker until ``stop`` is set. With
    ``announce``, print a line once it takes turns (``up`` is quiet otherwise)."""
    nc = await connect(config.nats, name="loop-worker")
    try:
        if provision and config.loop_worker.provision:
            for action in await provision_all(nc, config.nats, agents=config.agents):
                log.info("%s", action)  # a change is never silent
        limiter = SharedLimiter.for_worker(nc, config)  # [llm.limits], and 429 pauses
        async with (
            OpenAILLM(config.llm, limiter=limiter) as openai_llm,
            contextlib.AsyncExitStack() as stack,
        ):
            llm: LLM = openai_llm
            if config.loop.tool_choice_strategy == "constrained":
                copying = await copying_llm(config.llm, stack, limiter=limiter)
                llm = ConstrainedLLM(openai_llm, copying=copying)
            worker = LoopWorker(nc, config, llm=llm, limiter=limiter)
            port = config.loop_worker.metrics_port
            if port is not None:
                await stack.enter_async_context(
                    MetricsServer(
                        config.loop_worker.metrics_host, port, healthy=lambda: nc.is_connected
                    )
                )
            async with asyncio.TaskGroup() as tg:
                if announce:
                    tg.create_task(_announce_ready(worker, stop))
                await worker.run(stop)
    finally:
        with contextlib.suppress(Exception):
            await nc.drain()
