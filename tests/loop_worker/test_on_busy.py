"""A turn that arrives while an earlier turn of its session still runs (``Turn.on_busy``),
on real workers, on one server and on the R3 cluster: ``reject`` refuses it,
``interrupt`` stops the earlier turn at its next safe point (after its tool call is
recorded, never between the two) and starts from what it left, ``rollback`` also returns
the session to its snapshot from before the interrupted turn began."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from loopmesh.controls import send_control
from loopmesh.testing.durable import SUBJECTS, kv_read, stream_events, wait_for
from loopmesh.testing.fake_llm import tool_calls
from schemas import Control, Pause, Resume, SessionSnapshot, Turn, decode
from schemas.events import Error, LoopEnd, RolledBack
from tests.conftest import WITH_TURN_PARTITIONS
from tests.loop_worker.durable import Mesh, Watch, mesh_on, send_turn, turn

pytestmark = pytest.mark.parametrize("durable", WITH_TURN_PARTITIONS, indirect=True)


@pytest.fixture
async def mesh(durable):
    async with mesh_on(
        durable.url, replicas=durable.replicas, turn_partitions=durable.turn_partitions,
        workers=True,
    ) as mesh:  # fmt: skip
        yield mesh


def slow_count(path: Path, seconds: float = 1.5) -> tuple[str, dict[str, object]]:
    return ("local__count", {"path": str(path), "label": "a", "seconds": seconds})


DONE = ("task_completion", {"result": "done"})


async def first_turn_running_its_tool(mesh: Mesh, watch: Watch, ledger: Path) -> None:
    """t1 asks for a slow count; return once the tool runs (its line is written)."""
    await send_turn(mesh.nc, turn("t1", "count slowly"))
    await wait_for(ledger.exists, timeout=30, what="t1's tool to start")


async def test_reject_refuses_the_turn_and_the_running_one_goes_on(mesh: Mesh, tmp_path: Path):
    ledger = tmp_path / "n"
    mesh.fake.script(tool_calls(slow_count(ledger)), tool_calls(DONE))
    # a term's advisory would be buried by a worker as a dead letter: refused, then acked
    terms = await mesh.nc.subscribe("$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.>")
    async with Watch(mesh.nc) as watch:
        await first_turn_running_its_tool(mesh, watch, ledger)
        await send_turn(mesh.nc, turn("t2", "and now this", on_busy="reject"))
        rejected = await watch.wait("loop_end", "t2", timeout=30)
        first = await watch.wait("loop_end", "t1", timeout=30)
    assert isinstance(rejected, LoopEnd) and rejected.reason == "rejected"
    errors = watch.of("error", "t2")
    assert len(errors) == 1, [(e.type, e.turn_id, getattr(e, "message", "")) for e in watch.events]
    [error] = errors
    assert isinstance(error, Error) and error.code == "session_busy"
    assert "busy with turn t1" in error.message
    assert isinstance(first, LoopEnd) and first.reason == "task_completion"
    assert ledger.read_text() == "a\n"
    assert len(mesh.fake.requests) == 2  # t1's two calls; t2 never reached the model
    await mesh.nc.flush()
    assert terms.pending_msgs == 0, "the rejected turn was termed"


async def test_interrupt_stops_the_running_turn_after_its_call_is_recorded(
    mesh: Mesh, tmp_path: Path
):
    ledger = tmp_path / "n"
    mesh.fake.script(tool_calls(slow_count(ledger)), tool_calls(DONE))
    async with Watch(mesh.nc) as watch:
        await first_turn_running_its_tool(mesh, watch, ledger)
        await send_turn(mesh.nc, turn("t2", "stop that, do this", on_busy="interrupt"))
        first = await watch.wait("loop_end", "t1", timeout=30)
        second = await watch.wait("loop_end", "t2", timeout=30)
    assert isinstance(first, LoopEnd) and first.reason == "interrupted"
    assert "interrupted by turn t2" in (first.error or "")
    assert isinstance(second, LoopEnd) and second.reason == "task_completion"
    # the call ran once and its result was recorded before t1 stopped: t2 reads it
    assert ledger.read_text() == "a\n"
    assert [e.type for e in watch.of("tool_result", "t1")] == ["tool_result"]
    assert len(mesh.fake.requests) == 2  # t1 asked once; t2 once
    said = mesh.fake.requests[1]["messages"]
    assert any(m["role"] == "tool" and m["content"] == "counted a" for m in said)
    users = [m["content"] for m in said if m["role"] == "user" and "name" not in m]
    assert users[0] == "count slowly" and users[-1].endswith("stop that, do this"), users


def guarded(path: Path) -> tuple[str, dict[str, object]]:
    """A call that waits for a person's approval (a safe point), until interrupted."""
    return ("local__guarded", {"path": str(path), "label": "g"})


@pytest.mark.parametrize("mode", ["interrupt", "rollback"])
async def test_an_interrupt_reaches_every_unfinished_earlier_turn_started_or_not(
    mesh: Mesh, tmp_path: Path, mode: str
):
    """t0 waits for an approval, t1 and t2 wait their order behind it: t3 interrupts all
    three, and each ends ``interrupted`` (t1 and t2 read their interrupt when they
    start); t3 then runs. A ``rollback`` leaves none of their inputs in the session."""
    ledger = tmp_path / "n"
    mesh.fake.script(tool_calls(guarded(ledger)), tool_calls(DONE))
    async with Watch(mesh.nc) as watch:
        await send_turn(mesh.nc, turn("t0", "write it"))
        await watch.wait("approval_required", "t0", timeout=30)
        await send_turn(mesh.nc, turn("t1", "then this"))
        await send_turn(mesh.nc, turn("t2", "and this"))
        await send_turn(mesh.nc, turn("t3", "no, only this", on_busy=mode))
        ends = [await watch.wait("loop_end", t, timeout=30) for t in ("t0", "t1", "t2", "t3")]
    reasons = [(e.turn_id, e.reason) for e in ends if isinstance(e, LoopEnd)]
    assert reasons == [
        ("t0", "interrupted"), ("t1", "interrupted"), ("t2", "interrupted"),
        ("t3", "task_completion"),
    ], reasons  # fmt: skip
    assert not ledger.exists()
    assert len(mesh.fake.requests) == 2  # t0 asked once, t3 once; t1 and t2 never
    if mode == "rollback":
        assert [(e.turn_id, e.by_turn) for e in watch.of("rolled_back")] == [
            ("t0", "t3"), ("t1", "t3"), ("t2", "t3")
        ]  # fmt: skip
        expected = ["no, only this"]
    else:
        expected = ["write it", "then this", "and this", "no, only this"]
    users: list[str] = []

    async def stored() -> bool:  # a replica of the bucket may answer a revision behind
        nonlocal users
        value = await kv_read(mesh.nc, SUBJECTS.sessions_bucket, "acme.s1")
        snapshot = decode(value or b"", SessionSnapshot)
        users = [m.content for m in snapshot.messages if m.role == "user"]
        return snapshot.turn_id == "t3" and snapshot.status == "idle"

    await wait_for(stored, timeout=10, what="t3's last checkpoint")
    assert users == expected


async def test_a_users_pause_of_the_session_survives_an_interrupt(mesh: Mesh, tmp_path: Path):
    """A session-wide pause applies to the turns created before it. An interrupt sent
    after it keeps its own record: the pause still holds for the interrupting turn t1
    (created before the pause), which starts paused and goes on once resumed."""
    ledger = tmp_path / "n"
    mesh.fake.script(tool_calls(guarded(ledger)), tool_calls(DONE))
    created = time.time()
    await send_control(mesh.nc, SUBJECTS, Pause(tenant="acme", session="s1"))
    interrupting = Turn(
        id="t1", tenant="acme", session="s1", input="do this instead", created_at=created,
        on_busy="interrupt",
    )  # fmt: skip
    async with Watch(mesh.nc) as watch:
        await send_turn(mesh.nc, turn("t0", "write it"))  # created after the pause
        await watch.wait("approval_required", "t0", timeout=30)
        await send_turn(mesh.nc, interrupting)
        first = await watch.wait("loop_end", "t0", timeout=30)
        assert isinstance(first, LoopEnd) and first.reason == "interrupted"
        await wait_for(
            lambda: bool(watch.of("paused", "t1") or watch.of("loop_end", "t1")),
            timeout=30,
            what="t1 to pause or end",
        )
        assert watch.of("paused", "t1") and not watch.of("loop_end", "t1")
        recorded = await kv_read(mesh.nc, SUBJECTS.control_bucket, "acme.s1")
        assert isinstance(decode(recorded or b"", Control), Pause)
        await send_control(mesh.nc, SUBJECTS, Resume(tenant="acme", session="s1"))
        second = await watch.wait("loop_end", "t1", timeout=30)
    assert isinstance(second, LoopEnd) and second.reason == "task_completion"


async def test_rollback_returns_the_session_to_before_the_interrupted_turn(
    mesh: Mesh, tmp_path: Path
):
    ledger = tmp_path / "n"
    mesh.fake.script(
        tool_calls(DONE),  # t0: the conversation before
        tool_calls(slow_count(ledger)),
        tool_calls(DONE),
    )
    async with Watch(mesh.nc) as watch:
        await send_turn(mesh.nc, turn("t0", "hello"))
        await watch.wait("loop_end", "t0", timeout=30)
        await first_turn_running_its_tool(mesh, watch, ledger)
        await send_turn(mesh.nc, turn("t2", "forget that", on_busy="rollback"))
        first = await watch.wait("loop_end", "t1", timeout=30)
        second = await watch.wait("loop_end", "t2", timeout=30)
    assert isinstance(first, LoopEnd) and first.reason == "interrupted"
    assert isinstance(second, LoopEnd) and second.reason == "task_completion"
    [rolled] = watch.of("rolled_back", "t1")
    assert isinstance(rolled, RolledBack)
    assert (rolled.by_turn, rolled.to_turn) == ("t2", "t0")
    assert [(c.server, c.tool, c.status) for c in rolled.calls] == [("local", "count", "ok")]
    # t1's events stay in the stream, rolled_back after them, then its loop_end
    stored = [(e.type, e.turn_id) for e, _ in await stream_events(mesh.nc, "acme", "s1")]
    mine = [t for t, turn_id in stored if turn_id == "t1"]
    assert mine[-2:] == ["rolled_back", "loop_end"] and "tool_result" in mine
    # the side effect stays; the conversation t2 starts from is t0's
    assert ledger.read_text() == "a\n"
    said = json.dumps(mesh.fake.requests[2]["messages"])
    assert "hello" in said and "count slowly" not in said and "counted a" not in said
    value = await kv_read(mesh.nc, SUBJECTS.sessions_bucket, "acme.s1")
    snapshot = decode(value or b"", SessionSnapshot)
    texts = [m.content for m in snapshot.messages]
    assert "count slowly" not in texts and "forget that" in " ".join(texts)


async def test_the_gateway_answers_409_to_a_turn_that_rejects_a_busy_session(
    mesh: Mesh, tmp_path: Path, durable
):
    """The gateway looks before it publishes: a busy session's ``reject`` turn is
    answered 409 (code ``session_busy``) and never reaches the stream; once the running
    turn has ended, the same turn is accepted."""
    import httpx

    from gateway.server import GatewayServer
    from gateway.settings import GatewayConfig, GatewaySettings
    from loopmesh.settings import NatsSettings

    ledger = tmp_path / "n"
    mesh.fake.script(tool_calls(slow_count(ledger)), tool_calls(DONE), tool_calls(DONE))
    config = GatewayConfig(
        nats=NatsSettings(
            url=durable.url, reconnect_wait_s=0.05, turn_partitions=durable.turn_partitions
        ),
        gateway=GatewaySettings(port=0, no_auth=True),
    )
    async with (
        GatewayServer(config) as gw,
        httpx.AsyncClient(base_url=gw.url) as http,
        Watch(mesh.nc, "local", "s1") as watch,
    ):
        r = await http.post("/v1/sessions/s1/turns", json={"input": "count slowly"})
        assert r.status_code == 202, r.text
        await wait_for(ledger.exists, timeout=30, what="the first turn's tool to start")
        busy = {"input": "now this", "on_busy": "reject"}
        r = await http.post("/v1/sessions/s1/turns", json=busy)
        assert r.status_code == 409, r.text
        assert r.json()["error"]["code"] == "session_busy"
        assert "busy with turn" in r.json()["error"]["message"]
        await watch.wait("loop_end", timeout=30)
        r = await http.post("/v1/sessions/s1/turns", json=busy)
        assert r.status_code == 202, r.text
        await watch.wait("loop_end", count=2, timeout=30)
    assert [e.reason for e in watch.of("loop_end")] == ["task_completion", "task_completion"]


@pytest.mark.parametrize("mode", ["reject", "interrupt"])
async def test_an_interactive_turn_sees_a_running_batch_turn_of_its_session(
    mesh: Mesh, tmp_path: Path, mode: str
):
    """The two lanes are one session: an interactive turn behind a batch one that runs
    is refused (``reject``) or interrupts it, as within one lane."""
    ledger = tmp_path / "n"
    mesh.fake.script(tool_calls(slow_count(ledger)), tool_calls(DONE))
    async with Watch(mesh.nc) as watch:
        await send_turn(mesh.nc, turn("t1", "count slowly", priority="batch"))
        await wait_for(ledger.exists, timeout=30, what="t1's tool to start")
        await send_turn(mesh.nc, turn("t2", "now this", on_busy=mode))
        second = await watch.wait("loop_end", "t2", timeout=30)
        first = await watch.wait("loop_end", "t1", timeout=30)
    if mode == "reject":
        assert isinstance(second, LoopEnd) and second.reason == "rejected"
        assert isinstance(first, LoopEnd) and first.reason == "task_completion"
        [error] = watch.of("error", "t2")
        assert isinstance(error, Error) and "busy with turn t1" in error.message
    else:
        assert isinstance(first, LoopEnd) and first.reason == "interrupted"
        assert isinstance(second, LoopEnd) and second.reason == "task_completion"
    assert ledger.read_text() == "a\n"
