"""A streamed model reply larger than the server's max_payload: its events and the
session's snapshot are cut to fit, ``payload_truncated`` events say so, and the turn ends
and is acked like any other."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from loop_worker.engine.settings import LoopSettings
from loop_worker.sink import JetStreamEvents
from loopmesh.server import NatsServer
from loopmesh.testing.durable import SUBJECTS, drained, stream_events
from loopmesh.testing.fake_replies import text, tool_calls
from schemas import SessionSnapshot, Turn, decode
from schemas.events import Error, LoopEnd, PayloadTruncated, ToolCallEvent, ToolErrorEvent
from tests.loop_worker.durable import Mesh, Watch, mesh_on, send_turn

MAX_PAYLOAD = 64 * 1024
REPLY = "".join(f"line {i:06d} of a very long answer\n" for i in range(8_000))  # 264 KB


@pytest.fixture
async def small_mesh(tmp_path: Path) -> AsyncIterator[Mesh]:
    config = tmp_path / "nats.conf"
    config.write_text(f"max_payload: {MAX_PAYLOAD}\n")
    async with (
        NatsServer(tmp_path / "nats", extra_args=("-c", str(config))) as server,
        mesh_on(server.url) as mesh,
    ):
        yield mesh


async def test_a_reply_larger_than_max_payload_is_cut_in_its_events_and_snapshot(
    small_mesh: Mesh,
) -> None:
    mesh = small_mesh
    assert mesh.nc.max_payload == MAX_PAYLOAD
    mesh.fake.script(text(REPLY, chunk_size=4096))
    loop = LoopSettings(
        max_iterations=3, message_max_chars=1_000_000, max_no_tool_reminders=0,
        max_continuation_nudges=0, max_deflection_nudges=0,
    )  # fmt: skip
    await mesh.loop_worker(loop=loop)
    turn = Turn(id="t1", tenant="acme", session="s1", input="tell all", created_at=time.time())
    async with Watch(mesh.nc) as watch:
        await send_turn(mesh.nc, turn)
        end = await watch.wait("loop_end", "t1", timeout=60)
    assert isinstance(end, LoopEnd)
    kept, _, marker = end.content.partition("\n[cut by loopmesh: ")
    assert REPLY.startswith(kept) and len(kept) > 10_000
    assert marker.startswith(f"{len(kept.encode())} of {len(REPLY.strip())} bytes kept")
    stored = await stream_events(mesh.nc, "acme", "s1")
    types = [e.type for e, _ in stored]
    assert types.count("loop_end") == 1 and types[-1] == "loop_end"
    notices = [(i, e) for i, (e, _) in enumerate(stored) if isinstance(e, PayloadTruncated)]
    assert {"llm_response", "message", "loop_end"} <= {n.what for _, n in notices}, types
    for i, notice in notices:
        assert notice.size > MAX_PAYLOAD >= notice.kept and notice.max_payload == MAX_PAYLOAD
        assert types[i + 1] == notice.what  # announced just before the event it describes
    streamed = "".join(e.text for e, _ in stored if e.type == "content_delta")
    assert streamed == REPLY  # the deltas carried it whole
    kv = await mesh.nc.jetstream().key_value(SUBJECTS.sessions_bucket)
    snapshot = decode((await kv.get("acme.s1")).value or b"", SessionSnapshot)
    assert snapshot.turn_id == "t1" and snapshot.status == "idle"
    assistant = [m.content for m in snapshot.messages if m.role == "assistant"]
    assert assistant and "[cut by loopmesh: " in str(assistant[-1])
    await drained(mesh.nc, SUBJECTS.turns_stream)  # the turn was acked


async def test_an_event_too_large_with_no_long_text_to_cut_becomes_an_error_event(
    small_mesh: Mesh,
) -> None:
    nc = small_mesh.nc
    sink = JetStreamEvents(nc, SUBJECTS)
    sink.begin("acme.s1.t1")
    many = {f"k{i}": "v" * 100 for i in range(2_000)}  # 230 KB of short texts
    await sink.emit(
        ToolCallEvent(tenant="acme", session="s1", turn_id="t1", call_id="c1", arguments=many)
    )
    await sink.flush("acme.s1.t1")
    [(event, _)] = await stream_events(nc, "acme", "s1")
    assert isinstance(event, Error) and event.code == "payload_too_large"
    assert "tool_call event" in event.message and str(MAX_PAYLOAD) in event.message


async def test_a_tool_call_whose_arguments_pass_max_payload_gets_an_error_result(
    small_mesh: Mesh, tmp_path: Path
) -> None:
    """The model asks for a call too big for any NATS message: nothing is published and
    the model gets an error it can act on; a later call in the same turn still runs."""
    mesh = small_mesh
    big = "x" * (MAX_PAYLOAD + 1000)
    ledger = tmp_path / "n"
    mesh.fake.script(
        tool_calls(("local__echo", {"text": big})),
        tool_calls(("local__count", {"path": str(ledger), "label": "small"})),
    )
    await mesh.tool_worker()
    await mesh.loop_worker(loop=LoopSettings(message_max_chars=1_000_000))
    turn = Turn(id="t1", tenant="acme", session="s1", input="go", created_at=time.time())
    async with Watch(mesh.nc) as watch:
        await send_turn(mesh.nc, turn)
        end = await watch.wait("loop_end", "t1", timeout=60)
        errors = watch.of("tool_error", "t1")
    assert isinstance(end, LoopEnd) and end.reason == "task_completion"
    [error] = errors
    assert isinstance(error, ToolErrorEvent) and error.code == "payload_too_large"
    assert f"max_payload is {MAX_PAYLOAD} bytes" in error.message, error.message
    assert ledger.read_text() == "small\n"  # the next call ran, once
    kv = await mesh.nc.jetstream().key_value(SUBJECTS.sessions_bucket)
    snapshot = decode((await kv.get("acme.s1")).value or b"", SessionSnapshot)
    calls = [c for m in snapshot.messages for c in m.tool_calls if c.name == "local__echo"]
    assert json.loads(calls[0].arguments)["cut_by_loopmesh"].startswith("[cut by loopmesh: ")
    requests = mesh.fake.requests
    tool_messages = [m for m in requests[1]["messages"] if m.get("role") == "tool"]
    assert "payload_too_large" in str(tool_messages[-1]["content"])
