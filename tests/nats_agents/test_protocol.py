"""The NATS Agent Protocol against a real nats-server, a real loop worker and the
protocol's real client (``synadia-ai-agents``): discovery, a prompt streamed to its
answer, a failed turn's error, a newly defined agent, bad input, conversations."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from synadia_ai.agents import Agents, Envelope, ProtocolError, ResponseChunk, StatusChunk

from loopmesh.errors import ConfigError
from loopmesh.testing.durable import ROOT, SUBJECTS, Proc, kv_read, wait_for
from loopmesh.testing.fake_replies import ToolCalls, error, hang, tool_calls
from nats_agents.service import NatsAgents, serve
from nats_agents.settings import NatsAgentsConfig
from schemas import AgentSpec, SessionSnapshot, decode, encode
from tests.loop_worker.durable import Mesh, Watch
from tests.nats_agents.conftest import CALC, TENANT, WRITER, discover, host_on

ANSWER = "17 * 23 is 391, and 391 / 17 is 23."
ERROR_CODE = "Nats-Service-Error-Code"
ERROR = "Nats-Service-Error"


async def raw_prompt(nc: Client, subject: str, payload: bytes, timeout: float = 15) -> list[Msg]:
    """Every message of one prompt's reply stream, the terminator (§6.5) last."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    try:
        await nc.publish(subject, payload, reply=inbox)
        msgs = []
        while True:
            msg = await sub.next_msg(timeout=timeout)
            msgs.append(msg)
            if not msg.data and not msg.headers:
                return msgs
    finally:
        await sub.unsubscribe()


def answer(text: str) -> ToolCalls:
    """The model's reply that answers with ``text`` (``task_completion``)."""
    return tool_calls(("task_completion", {"result": text}))


def chunk(msg: Msg) -> Any:
    return json.loads(msg.data)


async def test_the_client_discovers_both_agents_and_prompts_one_getting_the_answer_streamed(
    mesh: Mesh, host: NatsAgents, agents: Agents, tmp_path: Path
):
    assert mesh.fake is not None
    mesh.fake.script_for(
        "calc-model",
        tool_calls(
            ("local__count", {"path": str(tmp_path / "n"), "label": "a", "seconds": 1.0}),
            content="Let me count them first.",
        ),
        answer(ANSWER),
    )

    found = await discover(agents)
    assert set(found) == {"default", "calc", "writer"}
    calc, writer = found["calc"], found["writer"]
    assert (calc.owner, calc.protocol_version) == ("acme", "0.3")
    assert (calc.description, writer.description) == (CALC.description, WRITER.description)
    assert calc.prompt_subject == "agents.prompt.loopmesh.acme.calc"
    assert calc.metadata["loopmesh_agent"] == "calc"

    chunks, results_then = [], []
    async with Watch(mesh.nc, TENANT, "s-calc") as session:
        prompt = Envelope(prompt="What is 17 * 23, and 391 / 17?", session="s-calc")
        async for c in calc.prompt(prompt):  # to the end of the stream
            chunks.append(c)
            if isinstance(c, ResponseChunk):  # the tool results the turn had by then
                results_then.append(len(session.of("tool_result")))

    assert chunks[0] == StatusChunk(status="ack")
    texts = [c.text for c in chunks if isinstance(c, ResponseChunk)]
    assert texts == ["Let me count them first.", "\n\n" + ANSWER]
    assert results_then[0] == 0 < results_then[1]  # streamed as the turn went: a step at a time
    requests = mesh.fake.requests_for("calc-model")  # a turn of calc, by its definition
    assert len(requests) == 2 and not mesh.fake.requests_for("writer-model")
    assert CALC.instructions in requests[0]["messages"][0]["content"]
    assert "What is 17 * 23, and 391 / 17?" in json.dumps(requests[0]["messages"])


async def test_a_prompt_whose_turn_fails_ends_with_the_protocols_error_then_the_terminator(
    mesh: Mesh, host: NatsAgents, agents: Agents, caller: Client
):
    assert mesh.fake is not None
    mesh.fake.script_for("writer-model", error(500, "the model is down"), error(500, "down"))
    writer = (await discover(agents))["writer"]

    seen: list[Any] = []
    with pytest.raises(ProtocolError, match=r"service error 500: turn .* ended with llm_failed"):
        async for c in writer.prompt("Write a haiku."):
            seen.append(c)
    assert seen == [StatusChunk(status="ack")]

    ack, failure, end = await raw_prompt(caller, writer.prompt_subject, b"Write a haiku.")
    assert chunk(ack) == {"type": "status", "data": "ack"}
    assert failure.headers is not None and failure.headers[ERROR_CODE] == "500"
    assert "ended with llm_failed" in failure.headers[ERROR]
    assert end.data == b"" and not end.headers


async def test_discovery_sees_a_newly_defined_agent_from_its_first_heartbeat(
    mesh: Mesh, host: NatsAgents, agents: Agents, caller: Client
):
    assert "poet" not in await discover(agents)
    beats = await caller.subscribe("agents.hb.loopmesh.acme.*")
    poet = AgentSpec(name="poet", description="Writes poems.", instructions="Rhyme.")
    kv = await mesh.nc.jetstream().key_value(SUBJECTS.agents_bucket)

    await kv.put("poet", encode(poet))  # as `nats kv put` or `loopmesh agents --apply` would

    beat = await beats.next_msg(timeout=10)  # the others beat every 30 s
    assert beat.subject == "agents.hb.loopmesh.acme.poet"
    assert json.loads(beat.data)["instance_id"] == host.hosts["poet"].instance_id
    found = await discover(agents)
    assert found["poet"].description == "Writes poems."
    texts = [c.text async for c in found["poet"].prompt("A poem, please.") if hasattr(c, "text")]
    assert "".join(texts).strip()

    await kv.delete("poet")

    async def withdrawn() -> bool:
        return "poet" not in await discover(agents)

    await wait_for(withdrawn, what="the deleted agent to leave discovery")


async def test_a_changed_description_is_registered_again(
    mesh: Mesh, host: NatsAgents, agents: Agents
):
    before = (await discover(agents))["calc"].instance_id
    kv = await mesh.nc.jetstream().key_value(SUBJECTS.agents_bucket)
    await kv.put("calc", encode(AgentSpec(name="calc", description="Adds, only.")))

    async def registered_again() -> bool:
        calcs = [a for a in await agents.discover() if a.session_name == "calc"]
        return [a.description for a in calcs] == ["Adds, only."]

    await wait_for(registered_again, what="calc's new description, and only it")
    assert (await discover(agents))["calc"].instance_id != before


BAD = [
    (b"", "zero-byte payload"),
    (b'{"prompt": "  \\n "}', "`prompt` is empty"),
    (b'{"text": "no prompt field"}', "malformed envelope"),
    (b'{"prompt": "hi", "session": "a.b"}', "`session` must be 1-64 characters"),
    (b'{"prompt": "hi", "session": 7}', "`session` must be 1-64 characters"),
    (
        b'{"prompt": "hi", "attachments": [{"filename": "a.txt", "content": "no base64!"}]}',
        "`attachments[0]`.content is not standard padded base64",
    ),
    (b"x" * 100_001, "`prompt` is 100001 characters; this endpoint takes at most 100000"),
]


async def test_bad_input_is_refused_with_400_naming_what_was_wrong_and_runs_no_turn(
    mesh: Mesh, host: NatsAgents, agents: Agents, caller: Client
):
    assert mesh.fake is not None
    subject = (await discover(agents))["calc"].prompt_subject
    for payload, said in BAD:
        failure, end = await raw_prompt(caller, subject, payload)  # no ack: refused at once
        assert failure.headers is not None, payload[:60]
        assert failure.headers[ERROR_CODE] == "400", payload[:60]
        assert said in failure.headers[ERROR], (payload[:60], failure.headers[ERROR])
        assert end.data == b"" and not end.headers
    assert not mesh.fake.requests


async def test_a_conversation_continues_in_the_session_its_prompts_name(
    mesh: Mesh, host: NatsAgents, agents: Agents
):
    assert mesh.fake is not None
    mesh.fake.script_for("calc-model", *[answer(a) for a in ("Hello Ada.", "You are Ada.", "Hm?")])
    calc = (await discover(agents))["calc"]

    first = [c async for c in calc.prompt(Envelope(prompt="I am Ada.", session="conv-1"))]
    second = [c async for c in calc.prompt(Envelope(prompt="Who am I?", session="conv-1"))]
    alone = [c async for c in calc.prompt("Who am I?")]  # no session: a conversation of its own

    assert [c.text for c in second if isinstance(c, ResponseChunk)] == ["You are Ada."]
    assert first and alone
    requests = mesh.fake.requests_for("calc-model")
    assert "I am Ada." in json.dumps(requests[1]["messages"])
    assert "I am Ada." not in json.dumps(requests[2]["messages"])
    stored = await kv_read(mesh.nc, SUBJECTS.sessions_bucket, "acme.conv-1")
    snapshot = decode(stored or b"", SessionSnapshot)
    assert (snapshot.agent, snapshot.turns) == ("calc", 2)


async def test_a_prompt_into_another_agents_session_is_a_conflict(
    mesh: Mesh, host: NatsAgents, agents: Agents
):
    found = await discover(agents)
    _ = [c async for c in found["calc"].prompt(Envelope(prompt="count", session="mine"))]
    with pytest.raises(ProtocolError, match=r"service error 409: .*agent_mismatch"):
        _ = [c async for c in found["writer"].prompt(Envelope(prompt="hi", session="mine"))]


async def test_a_prompt_in_flight_when_its_host_stops_ends_with_an_error_naming_its_session(
    mesh: Mesh, agents: Agents
):
    assert mesh.fake is not None
    mesh.fake.script_for("calc-model", hang(30))
    async with host_on(mesh.url, drain_s=0.2) as host:
        calc = (await discover(agents))["calc"]
        stream = calc.prompt(Envelope(prompt="take your time", session="slow"))
        assert await anext(stream) == StatusChunk(status="ack")
        await mesh.fake.wait_requests(1, timeout=10)  # the turn runs
        stopping = asyncio.ensure_future(host.hosts["calc"].stop(0.2))
        with pytest.raises(ProtocolError, match=r"service error 500: .*goes on in session slow"):
            await anext(stream)
        await stopping


async def test_without_a_tenant_the_host_does_not_start():
    with pytest.raises(ConfigError, match=r"\[nats_agents\] tenant"):
        await serve(NatsAgentsConfig(), asyncio.Event())  # before it connects to anything
    with pytest.raises(ConfigError, match="carries no tenant"):
        NatsAgents(None, NatsAgentsConfig())  # type: ignore[arg-type]


async def test_the_example_lists_the_agents_and_prints_an_answer_as_it_streams(
    mesh: Mesh, host: NatsAgents
):
    assert mesh.fake is not None
    mesh.fake.script_for("calc-model", answer(ANSWER))
    listing = await example("--url", mesh.url)
    assert [line.split()[:2] for line in listing] == [
        ["calc", "acme"], ["default", "acme"], ["writer", "acme"]
    ]  # fmt: skip
    assert listing[0].endswith(CALC.description)
    assert await example("--url", mesh.url, "--session", "ex1", "calc", "17 * 23?") == [ANSWER]


async def example(*args: str, path: Path | None = ROOT / "examples" / "nats_agent.py") -> list[str]:
    """The lines a script (by default the example) prints, once it exited 0."""
    proc = Proc(*([str(path)] if path else []), *args)
    await proc.start()
    assert proc.proc is not None
    assert await asyncio.wait_for(proc.proc.wait(), 60) == 0, proc.output()
    await proc.close()
    return proc.lines


async def test_the_snippet_in_docs_agents_md_runs(mesh: Mesh, host: NatsAgents, tmp_path: Path):
    assert mesh.fake is not None
    mesh.fake.script_for("calc-model", answer("391"), answer("23"))
    doc = (ROOT / "docs" / "AGENTS.md").read_text().split("## The NATS Agent Protocol", 1)[1]
    snippet = re.search(r"```python\n(.*?)```", doc, re.DOTALL)
    assert snippet is not None
    script = tmp_path / "snippet.py"
    script.write_text(snippet.group(1).replace("nats://127.0.0.1:4222", mesh.url))
    assert await example(str(script), path=None) == ["391", "23"]
    assert "391" in json.dumps(mesh.fake.requests_for("calc-model")[1]["messages"])  # one session
