"""loopmesh: the in-process engine (the lower bound) and the distributed mesh (a real
``python -m loop_worker`` and ``python -m tool_worker`` on an embedded nats-server), the
latter at JetStream's default sync and with ``sync_interval: always``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.harness import Ends, Mesh, loop_fields, turn
from loop_worker.engine import Engine
from loop_worker.engine.inmemory import InMemoryEvents, InMemoryStore, LocalTools
from loop_worker.engine.llm import OpenAILLM
from loop_worker.engine.settings import LLMSettings, LoopSettings
from loopmesh.server import NatsServer
from loopmesh.testing.durable import Proc

MAX_K = 64


class InProcess:
    name = "loopmesh in-process"
    durability = "none (memory)"

    def __init__(self, llm_url: str) -> None:
        self.llm_url = llm_url

    async def __aenter__(self) -> InProcess:
        tools = LocalTools()

        @tools.tool(description="Return the text.")
        async def echo(text: str) -> str:
            return text

        settings = LLMSettings(base_url=self.llm_url, api_key="bench", model="fake-model")
        self.llm = await OpenAILLM(settings).__aenter__()
        self.engine = Engine(
            settings=LoopSettings(**loop_fields(MAX_K)),
            llm=self.llm,
            tools=tools,
            events=InMemoryEvents(),
            store=InMemoryStore(),
            model="fake-model",
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.llm.__aexit__(None, None, None)

    async def session(self, sid: str, k: int) -> None:
        await self.engine.run(turn(sid, sid, f"{sid} echo {k}"))


class Distributed:
    def __init__(self, llm_url: str, store: Path, *, always: bool) -> None:
        self.llm_url = llm_url
        self.always = always
        self.name = "loopmesh (sync always)" if always else "loopmesh (default sync)"
        self.durability = (
            "JetStream fsync per write (sync_interval: always)"
            if always
            else "JetStream default: fsync every 2 min (sync_interval default)"
        )
        self.mesh = Mesh(store, ack_wait_s=30, lease_ttl_s=30)
        if always:
            store.mkdir(parents=True, exist_ok=True)
            conf = store / "sync.conf"
            conf.write_text("jetstream { sync_interval: always }\n")
            self.mesh.server = NatsServer(store, extra_args=("-c", str(conf)))

    async def __aenter__(self) -> Distributed:
        await self.mesh.__aenter__()
        await self.mesh.tool_worker(concurrency=512, module="bench.tools")
        env: dict[str, Any] = {
            "LOOPMESH_NATS__URL": self.mesh.server.url,
            "LOOPMESH_LOOP_WORKER__ACK_WAIT_S": "30",
            "LOOPMESH_LOOP_WORKER__LEASE_TTL_S": "30",
            "LOOPMESH_LOOP_WORKER__NAME": "bench1",
            "LOOPMESH_LOOP_WORKER__PROVISION": "false",
            "LOOPMESH_LOOP_WORKER__MAX_ACTIVE_TURNS": "512",
            "LOOPMESH_LLM__BASE_URL": self.llm_url,
            "LOOPMESH_LLM__API_KEY": "bench",
            "LOOPMESH_LLM__MODEL": "fake-model",
        }
        for field, value in loop_fields(MAX_K).items():
            env[f"LOOPMESH_LOOP__{field.upper()}"] = json.dumps(value)
        proc = Proc("-m", "loop_worker", env=env)
        self.mesh.procs.append(proc)
        await proc.start("loop worker ready")
        self.ends = Ends(self.mesh.nc)
        await self.ends.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.mesh.__aexit__(*exc)

    async def session(self, sid: str, k: int) -> None:
        await self.ends.run(turn(sid, sid, f"{sid} echo {k}"))
