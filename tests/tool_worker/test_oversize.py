"""A tool result larger than the server's max_payload is cut to fit, recorded cut, and
said so in a ``payload_truncated`` event; a repeat of the call gets the same text."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client

from loopmesh.provision import provision
from loopmesh.server import NatsServer
from schemas import ToolResult, decode, definitions, encode
from schemas.events import PayloadTruncated, ToolResultEvent
from tool_worker import Registry, load_module

from .harness import SUBJECTS, EventLog, Requester, running

MAX_PAYLOAD = 64 * 1024


@pytest.fixture
async def small_nc(tmp_path: Path) -> AsyncIterator[Client]:
    """A client of a nats-server whose max_payload is 64 KiB, everything provisioned."""
    config = tmp_path / "nats.conf"
    config.write_text(f"max_payload: {MAX_PAYLOAD}\n")
    async with NatsServer(tmp_path / "nats", extra_args=("-c", str(config))) as server:
        nc = await nats.connect(server.url)
        try:
            await provision(nc.jetstream(), definitions(SUBJECTS))
            yield nc
        finally:
            await nc.close()


async def test_a_result_larger_than_max_payload_is_cut_recorded_and_announced(
    small_nc: Client, tmp_path: Path
) -> None:
    assert small_nc.max_payload == MAX_PAYLOAD
    runs = tmp_path / "runs"
    tools = [t for t in load_module("tests.tool_worker.sample_tools") if t.name == "huge"]
    async with (
        Requester(small_nc) as requester,
        EventLog(small_nc) as events,
        running(small_nc, Registry(tools)),
    ):
        args = {"path": str(runs), "size": 300_000}
        req = requester.request("local", "huge", args)
        await requester.publish(req)
        result = await requester.result(req.call_id, timeout=30)
        notice = await events.wait_for(lambda e: isinstance(e, PayloadTruncated), timeout=30)
        shown = await events.wait_for(lambda e: isinstance(e, ToolResultEvent), timeout=30)
        # The call again (a resumed turn asks for it again): answered from the record.
        requester.results.pop(req.call_id)
        subject = SUBJECTS.tool("default", "local", "huge")
        headers = {"Nats-Msg-Id": f"{req.call_id}-again"}  # past the stream's dedup
        await small_nc.jetstream().publish(subject, encode(req), headers=headers)
        again = await requester.result(req.call_id, timeout=30)
    assert result.status == "ok", result.error
    kept, _, marker = result.content.partition("\n[cut by loopmesh: ")
    assert "the quick brown fox" in kept and marker.startswith(f"{len(kept)} of 300000 bytes kept")
    assert len(encode(result)) <= MAX_PAYLOAD
    assert isinstance(notice, PayloadTruncated)
    assert (notice.what, notice.call_id) == ("tool_result", req.call_id)
    assert notice.fields == ("content",)
    assert notice.size > 300_000 and notice.kept == len(encode(result))
    assert notice.max_payload == MAX_PAYLOAD
    assert isinstance(shown, ToolResultEvent) and shown.truncated
    effects = await small_nc.jetstream().key_value(SUBJECTS.effects_bucket)
    recorded = decode((await effects.get(req.call_id)).value or b"", ToolResult)
    assert recorded == result
    assert again == result  # the repeat is answered from the record, the same text
    assert runs.read_text() == "ran\n"  # and the tool ran once
