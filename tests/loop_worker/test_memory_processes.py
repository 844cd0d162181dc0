"""A memory that outlives a session, on real loop-worker processes and the bundled MiniLM:
an agent with ``memory = "auto"`` saves a fact of a user in one session, and a turn of
another session, run by another worker, finds it recalled in its prompt; once the
model forgets it, and once the user's memories are erased, no turn recalls it, and
nothing of the user is left in the bucket."""

from __future__ import annotations

import json

import pytest

from loop_worker.engine.recall import memory_id
from loopmesh import minilm
from loopmesh.kv import kv_values
from loopmesh.memory import MemoryStore
from loopmesh.testing.durable import (
    SUBJECTS,
    Proc,
    connect_fast,
    provision_short,
    worker_env,
)
from loopmesh.testing.fake_llm import FakeLLM
from loopmesh.testing.fake_replies import auto
from schemas.events import LoopEnd, ToolCallEvent
from tests.loop_worker.durable import Watch, send_turn, turn

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(minilm.missing() is not None, reason=str(minilm.missing())),
]

READY = "loop worker ready"
CONFIG = """
[[agents]]
name = "friend"
description = "Remembers what you tell it."
memory = "auto"
"""
FACT = "Ada's favourite colour is teal."


def save(text: str) -> str:
    return "call memory__save " + json.dumps({"text": text})


@pytest.fixture
async def mesh(nats_server, tmp_path):
    nc = await connect_fast(nats_server.url)
    await provision_short(nc)
    config = tmp_path / "loopmesh.toml"
    config.write_text(CONFIG)
    procs: list[Proc] = []
    async with FakeLLM(default=auto()) as llm:
        for name in ("w1", "w2"):
            env = worker_env(nats_server.url, llm.base_url, name=name)
            env |= {"LOOPMESH_CONFIG": str(config), "OPENBLAS_NUM_THREADS": "1"}
            procs.append(await Proc("-m", "loop_worker", env=env).start(READY))

        class M:
            pass

        m = M()
        m.nc, m.llm, m.procs = nc, llm, procs
        try:
            yield m
        finally:
            for proc in procs:
                await proc.close()
            await nc.close()


async def ask(mesh, session: str, text: str) -> tuple[LoopEnd, list, str]:
    """Run one turn of ada's in ``session``; its end, its events and the last user message
    of its first LLM request (where the recalled memories are)."""
    asked = len(mesh.llm.requests)
    async with Watch(mesh.nc, "acme", session) as watch:
        await send_turn(mesh.nc, turn("t1", text, session=session, agent="friend", user="ada"))
        end = await watch.wait("loop_end", "t1", timeout=60)
        events = list(watch.events)
    first = mesh.llm.requests[asked]["messages"]
    user = [m for m in first if m["role"] == "user" and m.get("name") != "loopmesh"][-1]
    assert isinstance(end, LoopEnd)
    return end, events, user["content"]


async def test_a_fact_saved_in_one_session_is_recalled_in_another_until_forgotten(mesh):
    end, events, _ = await ask(mesh, "s1", save(FACT))
    assert end.reason == "task_completion", end
    [call] = [e for e in events if isinstance(e, ToolCallEvent) and e.server == "memory"]
    assert (call.tool, call.arguments) == ("save", {"text": FACT})

    end, _, prompt = await ask(mesh, "s2", "What colour do I like?")
    assert end.reason == "task_completion"
    assert FACT in prompt and "[memory " in prompt  # recalled, with its source
    assert "session s1" in prompt

    saved = memory_id(call.call_id)
    end, events, _ = await ask(mesh, "s3", "call memory__forget " + json.dumps({"id": saved}))
    [result] = [e for e in events if e.type == "tool_result" and e.server == "memory"]
    assert result.content == f"forgot {saved}"
    _, _, prompt = await ask(mesh, "s4", "What colour do I like?")
    assert FACT not in prompt

    # the user's erase: every memory of ada's, and every trace of them in the bucket
    await ask(mesh, "s5", save("Ada plays the cello."))
    _, _, prompt = await ask(mesh, "s6", "What instrument do I play?")
    assert "Ada plays the cello." in prompt
    store = MemoryStore(mesh.nc.jetstream(), SUBJECTS.memory_bucket)
    assert await store.erase("acme", "user", "ada") == 1
    _, _, prompt = await ask(mesh, "s7", "What instrument do I play?")
    assert "cello" not in prompt
    assert await kv_values(mesh.nc.jetstream(), SUBJECTS.memory_bucket, "acme.user.ada.*") == {}
    info = await mesh.nc.jetstream().stream_info(
        f"KV_{SUBJECTS.memory_bucket}", subjects_filter=f"$KV.{SUBJECTS.memory_bucket}.>"
    )
    assert not [s for s in (info.state.subjects or {}) if ".user.ada." in s]
