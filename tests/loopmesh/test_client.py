"""``loopmesh.Client`` over NATS and through the gateway: a real nats-server, a real loop
worker and tool worker (in-process), the fake OpenAI server as the model, and the real
gateway with API keys. Every test runs on both transports unless it is about one."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from gateway.server import GatewayServer
from loopmesh import Client
from loopmesh.agents import apply_agents
from loopmesh.client import (
    ClientError,
    InvalidRequest,
    NotFound,
    NotSetUp,
    SessionEvent,
    TurnRefused,
    Unauthorized,
    Unavailable,
)
from loopmesh.server import NatsServer
from loopmesh.settings import NatsSettings
from loopmesh.testing.durable import SUBJECTS, stream_events
from schemas import AgentSpec
from schemas.events import (
    ApprovalDecided,
    ApprovalRequired,
    Error,
    Event,
    LoopEnd,
    LoopStart,
    Paused,
    ToolCallEvent,
    ToolResultEvent,
    TurnAccepted,
)
from tests.gateway.conftest import ACME_KEY, KEYS
from tests.gateway.proxy import Proxy
from tests.loop_worker.durable import Mesh, count_task, gateway_on
from tests.loopmesh.commands.test_commands import TRANSPORTS, mesh

__all__ = ["mesh"]  # the fixture, shared


@pytest.fixture
async def gateway(mesh: Mesh) -> AsyncIterator[GatewayServer]:
    async with gateway_on(mesh.url, api_keys=KEYS) as gw:
        yield gw


@pytest.fixture(params=TRANSPORTS)
async def client(request, mesh: Mesh, gateway: GatewayServer) -> AsyncIterator[Client]:
    """Tenant acme's client: its NATS tenant, or its gateway key."""
    if request.param == "gateway":
        c = Client(gateway=gateway.url, api_key=ACME_KEY)
    else:
        c = Client(nats_url=mesh.url, tenant="acme")
    async with c:
        yield c


def guarded_task(path: Path) -> str:
    """A task whose tool call waits for a person's approval."""
    return count_task(path, "ok", tool="guarded")


async def collect(events: AsyncIterator[Event], timeout: float = 60) -> list[Event]:
    async with asyncio.timeout(timeout):
        return [event async for event in events]


async def test_run_yields_a_turns_typed_events_from_its_start_to_its_loop_end(
    client: Client, mesh: Mesh, tmp_path: Path
):
    target = tmp_path / "n"
    events = await collect(client.run(count_task(target), session="s1"))
    assert target.read_text() == "a\n"  # the tool ran, once
    assert isinstance(events[0], TurnAccepted) and isinstance(events[1], LoopStart)
    assert isinstance(events[-1], LoopEnd) and events[-1].reason == "task_completion"
    call = next(e for e in events if isinstance(e, ToolCallEvent) and e.server == "local")
    result = next(e for e in events if isinstance(e, ToolResultEvent) and e.server == "local")
    assert (call.tool, result.call_id) == ("count", call.call_id)
    # exactly the turn's stored events, in their order, and nothing of another turn
    stored = [e for e, _ in await stream_events(mesh.nc, "acme", "s1")]
    assert events == [e for e in stored if e.turn_id == events[0].turn_id]
    assert {e.tenant for e in events} == {"acme"}


async def test_submit_returns_the_turn_and_events_reads_it_from_where_it_said(
    client: Client, tmp_path: Path
):
    first = await client.submit(count_task(tmp_path / "n"), session="s1", turn_id="t1")
    assert (first.turn_id, first.session) == ("t1", "s1")
    items = client.events("s1", since=first.since, turn="t1")
    got: list[SessionEvent] = []
    async with asyncio.timeout(60):
        async for item in items:
            got.append(item)
            if isinstance(item.event, LoopEnd):
                break
    assert got[0].event.type == "turn_accepted" and got[-1].event.reason == "task_completion"  # type: ignore[attr-defined]
    assert {i.event.turn_id for i in got} == {"t1"}
    # the same id again is the same turn: it does not run twice, and its events are there
    again = await client.submit(count_task(tmp_path / "n"), session="s1", turn_id="t1")
    assert again.turn_id == "t1" and again.since == 0
    assert (tmp_path / "n").read_text() == "a\n"


async def test_a_batch_turn_runs_through_its_lane(client: Client, mesh: Mesh):
    """Interactive unless the caller asks for batch; a batch turn runs all the same."""
    events = await collect(client.run("hello", session="s1", priority="batch"))
    assert events[-1].reason == "task_completion"  # type: ignore[attr-defined]
    js = mesh.nc.jetstream()
    info = await js.consumer_info(SUBJECTS.turns_stream, SUBJECTS.tenant_consumer("acme", "batch"))
    assert info.delivered.stream_seq > 0  # it came through the tenant's batch consumer


async def test_events_resume_after_a_sequence_with_nothing_missed_or_repeated(
    client: Client, tmp_path: Path
):
    for _ in range(2):
        await collect(client.run(count_task(tmp_path / "n"), session="s1"))
    everything = [i async for i in client.events("s1", follow=False)]
    seqs = [i.seq for i in everything]
    assert seqs == sorted(set(seqs)) and len({i.event.turn_id for i in everything}) == 2
    assert all(isinstance(i.event, Event) and i.data.startswith(b"{") for i in everything)
    middle = seqs[len(seqs) // 2]
    rest = [i async for i in client.events("s1", since=middle, follow=False)]
    assert [i.seq for i in rest] == [s for s in seqs if s > middle]
    second = everything[-1].event.turn_id
    of_turn = [i async for i in client.events("s1", turn=second, follow=False)]
    assert [i.seq for i in of_turn] == [i.seq for i in everything if i.event.turn_id == second]


@pytest.mark.parametrize("decision", ["approve", "deny"])
async def test_approve_and_deny_decide_a_call_that_waits_for_a_person(
    decision: str, client: Client, tmp_path: Path
):
    target = tmp_path / "g"
    events: list[Event] = []
    async with asyncio.timeout(60):
        async for event in client.run(guarded_task(target), session="s1"):
            events.append(event)
            if isinstance(event, ApprovalRequired):
                decide = client.approve if decision == "approve" else client.deny
                await decide("s1", event.call_id, reason="looked at it")
    decided = next(e for e in events if isinstance(e, ApprovalDecided))
    assert decided.approved is (decision == "approve") and decided.reason == "looked at it"
    assert isinstance(events[-1], LoopEnd)
    assert target.exists() is (decision == "approve")


async def test_cancel_stops_the_running_turn(client: Client, tmp_path: Path):
    async with asyncio.timeout(60):
        async for event in client.run(guarded_task(tmp_path / "g"), session="s1"):
            if isinstance(event, ApprovalRequired):  # it waits for a person: stop it instead
                await client.cancel("s1", reason="enough")
            last = event
    assert isinstance(last, LoopEnd) and last.reason == "cancelled"
    assert last.error == "enough"


async def test_agents_lists_the_named_agents_default_first(client: Client, mesh: Mesh):
    assert [a.name for a in await client.agents()] == ["default"]
    calc = AgentSpec(name="calc", description="Counts.", model="calc-model")
    await apply_agents(mesh.nc.jetstream(), SUBJECTS, [calc])
    agents = await client.agents()
    assert [a.name for a in agents] == ["default", "calc"]
    assert agents[1].model == "calc-model" and agents[1].revision > 0


async def test_a_turn_refused_for_a_busy_session_raises_turn_refused(
    client: Client, tmp_path: Path
):
    waiting = client.run(guarded_task(tmp_path / "g"), session="s1")
    async with asyncio.timeout(60):
        async for event in waiting:
            if isinstance(event, ApprovalRequired):
                break  # the first turn waits for a person
        with pytest.raises(TurnRefused) as refused:
            await collect(client.run("hello", session="s1", on_busy="reject"))
    assert refused.value.code == "session_busy" and refused.value.session == "s1"
    assert "busy with turn" in str(refused.value)
    if client.where.startswith("gateway"):
        assert refused.value.status == 409 and refused.value.event is None
    else:  # the loop worker said so with an error event and the turn's loop_end
        assert isinstance(refused.value.event, Error)
        assert refused.value.end is not None and refused.value.end.reason == "rejected"
    await waiting.aclose()
    await client.cancel("s1")


async def test_a_turn_of_an_unknown_agent_raises_turn_refused(client: Client):
    with pytest.raises(TurnRefused) as refused:
        await collect(client.run("hello", session="s2", agent="nobody"))
    if client.where.startswith("gateway"):
        assert (refused.value.status, refused.value.field) == (422, "agent")
    else:
        assert refused.value.code == "unknown_agent"
    assert "no agent 'nobody' is defined" in str(refused.value)


async def test_fork_and_rewind_take_a_session_to_a_turn(client: Client, tmp_path: Path):
    t1 = (await collect(client.run("remember heron", session="b1")))[-1].turn_id
    t2 = (await collect(client.run(count_task(tmp_path / "n"), session="b1")))[-1].turn_id
    fork = await client.fork("b1", at_turn=t1, into="b2")
    assert (fork.session, fork.source, fork.at_turn, fork.turns) == ("b2", "b1", t1, (t1,))
    rewind = await client.rewind("b1", before_turn=t2)
    assert (rewind.session, rewind.to_turn, rewind.undone) == ("b1", t1, (t2,))
    assert [(c.tool, c.status) for c in rewind.calls] == [("count", "ok")]  # it stays done
    assert rewind.messages == fork.messages
    with pytest.raises(InvalidRequest, match="undone") as info:
        await client.fork("b1", at_turn=t2)
    assert info.value.field == "at_turn"  # (status 422 through the gateway, 0 over NATS)
    with pytest.raises(NotFound):
        await client.rewind("nope", before_turn=t1)
    with pytest.raises(ValueError, match="exactly one"):
        await client.fork("b1")
    with pytest.raises(ClientError) as busy:
        await client.fork("b1", at_turn=t1, into="b2")
    assert busy.value.code == "conflict"
    after = (await collect(client.run("and now?", session="b1")))[-1]
    assert after.reason == "task_completion"  # the next turn runs from the rewound session


async def test_the_gateway_says_unauthorized_and_not_found(mesh: Mesh, gateway: GatewayServer):
    async with Client(gateway=gateway.url, api_key="wrong") as client:
        with pytest.raises(Unauthorized, match="the gateway answered 401 unauthorized"):
            await client.agents()
    async with Client(gateway=gateway.url, api_key=ACME_KEY) as client:
        with pytest.raises(NotFound, match="no session 'nobody'") as missing:
            [i async for i in client.events("nobody", follow=False)]
        assert missing.value.status == 404
        with pytest.raises(NotFound):
            await client.approve("nobody", "c1")
        with pytest.raises(InvalidRequest, match="needs NATS") as nats_only:
            await client.cancel("s1", turn_id="t1")
        assert nats_only.value.field == "turn_id"


async def test_unreachable_and_unprovisioned_loopmesh_are_unavailable(nats_server):
    async with Client(gateway="http://127.0.0.1:9") as client:
        with pytest.raises(Unavailable, match=r"cannot reach the gateway at http://127\.0\.0\.1:9"):
            await client.agents()
    with pytest.raises(NotSetUp, match="has no stream LOOPMESH_TURNS") as bare:
        async with Client(nats_url=nats_server.url):
            pass
    assert bare.value.missing == "LOOPMESH_TURNS" and isinstance(bare.value, ClientError)
    await nats_server.stop()
    with pytest.raises(Unavailable, match="cannot connect to NATS"):
        async with Client(nats_url=nats_server.url, nats=NatsSettings(connect_timeout_s=0.5)):
            pass


async def test_bad_arguments_are_refused_before_anything_is_sent(mesh: Mesh):
    client = Client(nats_url=mesh.url)
    with pytest.raises(ValueError, match=r"invalid session id 's\.1'"):
        await client.submit("hi", session="s.1")
    with pytest.raises(ValueError, match="invalid call id"):
        await client.approve("s1", "c 1")
    with pytest.raises(ValueError, match="not empty"):
        await client.submit("  ")
    with pytest.raises(TypeError, match="no option sesion"):
        await client.submit("hi", sesion="s1")  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="either a gateway or NATS"):
        Client(gateway="http://127.0.0.1:8080", nats_url=mesh.url)
    await client.close()


async def test_close_is_idempotent_and_a_closed_client_says_so(mesh: Mesh):
    client = Client(nats_url=mesh.url)
    assert [a.name for a in await client.agents()] == ["default"]  # connects on first use
    await client.close()
    await client.close()
    with pytest.raises(RuntimeError, match="closed"):
        await client.agents()


async def test_pause_holds_the_turn_and_resume_lets_it_go_on(client: Client, tmp_path: Path):
    async with asyncio.timeout(60):
        async for event in client.run(count_task(tmp_path / "n", seconds=0.5), session="s1"):
            if isinstance(event, ToolCallEvent) and event.server == "local":
                await client.pause("s1")
            elif isinstance(event, Paused):
                await client.resume("s1")
            last = event
    assert isinstance(last, LoopEnd) and last.reason == "task_completion"


async def test_nats_refusing_the_credentials_is_unauthorized(tmp_path: Path):
    async with NatsServer(tmp_path / "nats", extra_args=("--user", "u", "--pass", "right")) as s:
        wrong = s.url.replace("nats://", "nats://u:wrong@")
        with pytest.raises(Unauthorized, match=r"(?i)authorization violation"):
            async with Client(nats_url=wrong):
                pass


async def test_through_the_gateway_a_dropped_stream_resumes_with_nothing_missed_or_twice(
    mesh: Mesh, gateway: GatewayServer, tmp_path: Path
):
    host, port = gateway.url.removeprefix("http://").split(":")
    async with Proxy(host, int(port)) as proxy, Client(gateway=proxy.url, api_key=ACME_KEY) as c:
        events: list[Event] = []
        async with asyncio.timeout(60):
            async for event in c.run(guarded_task(tmp_path / "g"), session="s1"):
                events.append(event)
                if isinstance(event, ApprovalRequired):
                    proxy.down()  # the network drops the stream (and the approval waits)
                    proxy.up()
                    await c.approve("s1", event.call_id)
        assert proxy.dropped and bytes(proxy.requests).count(b"GET /v1/sessions/s1/events") == 2
    stored = [e for e, _ in await stream_events(mesh.nc, "acme", "s1")]
    assert events == stored  # the one turn's events, each once, in order
    assert isinstance(events[-1], LoopEnd) and events[-1].reason == "task_completion"


def test_a_turns_options_are_what_the_gateways_turn_body_takes():
    from gateway.api import PostTurn
    from loopmesh.client import TurnOptions
    from loopmesh.client.gateway import TURN_FIELDS

    assert set(TURN_FIELDS) == set(PostTurn.__struct_fields__)
    ids = {"session", "turn_id"}  # the path and the Idempotency-Key
    assert set(TurnOptions.__annotations__) - ids == set(TURN_FIELDS) - {"input"}


async def test_memories_are_added_listed_forgotten_and_erased(client: Client) -> None:
    ada = await client.remember("Ada keeps bees.", user="ada")
    await client.remember("Ada plays the cello.", user="ada")
    await client.remember("I answer briefly.", agent="default")
    assert ada.kind == "user" and ada.name == "ada" and ada.source is not None
    assert [m.text for m in await client.memories(user="ada")] == [
        "Ada keeps bees.",
        "Ada plays the cello.",
    ]
    assert await client.forget(ada.id, user="ada") is True
    assert await client.forget(ada.id, user="ada") is False
    assert await client.erase_memories(user="ada") == 1
    assert await client.memories(user="ada") == []
    assert [m.text for m in await client.memories(agent="default")] == ["I answer briefly."]
    with pytest.raises(InvalidRequest, match="exactly one of `user` and `agent`"):
        await client.memories()
    with pytest.raises(InvalidRequest, match="text"):
        await client.remember("", user="ada")
