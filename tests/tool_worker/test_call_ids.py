"""A request whose call id is not its own turn's is refused before the effect record is
touched: the call id keys the record, so another turn's id would read its result or
record over it."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError

from loopmesh.testing.durable import wait_for
from schemas import ToolCallRequest, ToolResult, decode, encode, new_id
from tool_worker import Registry, to_tool, tool

from .harness import SUBJECTS, Requester, running

#: What the forged request claims instead of the genuine call's fields.
FORGERIES = [
    pytest.param({"tenant": "t2"}, "tenant 't2'", id="another-tenant"),
    pytest.param({"session": "s2"}, "session 's2'", id="another-session"),
    pytest.param({"turn_id": "turn2"}, "turn 'turn2'", id="another-turn"),
    pytest.param({"iteration": 3}, "iteration 3", id="another-iteration"),
]


def secret_registry(runs: list[str]) -> Registry:
    @tool(name="secret")
    def secret(tag: str) -> str:
        """Answers with a secret; ``runs`` shows every time it ran."""
        runs.append(tag)
        return f"the secret of {tag}"

    return Registry([to_tool(secret)])


class Forger:
    """Publishes a request on the tools stream under a fresh ``Nats-Msg-Id`` (the call
    id's own would be dropped by the stream as a duplicate) and collects its replies."""

    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self.inbox = nc.new_inbox()
        self.replies: list[ToolResult] = []
        self.replied = asyncio.Event()

    async def __aenter__(self) -> Forger:
        self._sub = await self.nc.subscribe(self.inbox, cb=self._on_reply)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._sub.unsubscribe()

    async def _on_reply(self, msg: Msg) -> None:
        self.replies.append(decode(msg.data, ToolResult))
        self.replied.set()

    async def publish(self, genuine: ToolCallRequest, **claims: Any) -> None:
        forged = msgspec.structs.replace(
            genuine, reply_to=self.inbox, arguments={"tag": "forged"}, **claims
        )
        subject = SUBJECTS.tool("default", forged.server, forged.tool)
        await self.nc.jetstream().publish(
            subject, encode(forged), headers={"Nats-Msg-Id": new_id()}
        )

    async def reply(self) -> ToolResult:
        async with asyncio.timeout(30):
            await self.replied.wait()
        return self.replies[0]


async def acked(js: JetStreamContext) -> Any:
    """The pool consumer's info once nothing awaits its ack and nothing is pending."""
    infos: list[Any] = []

    async def settled() -> bool:
        consumer = SUBJECTS.pool_consumer("default")
        infos.append(await js.consumer_info(SUBJECTS.tools_stream, consumer))
        return infos[-1].num_ack_pending == 0 and infos[-1].num_pending == 0

    await wait_for(settled, timeout=30, what="every delivery acked or terminated")
    return infos[-1]


@pytest.mark.parametrize(("claims", "named"), FORGERIES)
async def test_another_turns_call_id_is_refused_and_its_recorded_result_not_leaked(
    nc: Client, js: JetStreamContext, requester: Requester, claims: dict[str, Any], named: str
) -> None:
    runs: list[str] = []
    effects = await js.key_value(SUBJECTS.effects_bucket)
    async with running(nc, secret_registry(runs)) as worker, Forger(nc) as forger:
        genuine = requester.request("local", "secret", {"tag": "genuine"})
        await requester.publish(genuine)
        result = await requester.result(genuine.call_id, timeout=30)
        assert (result.status, result.content) == ("ok", "the secret of genuine")
        await acked(js)  # the reply goes out before the record is stored, the ack after
        before = await effects.get(genuine.call_id)

        await forger.publish(genuine, **claims)
        refused = await forger.reply()
        info = await acked(js)
        stats = dict(worker.stats)

    assert refused.status == "error" and refused.error is not None
    assert refused.error.code == "invalid_call_id"
    assert genuine.call_id in refused.error.message and named in refused.error.message
    assert refused.content == "" and "secret" not in msgspec.json.encode(refused).decode()
    assert forger.replies == [refused]
    assert runs == ["genuine"]  # the forged request never ran the tool
    after = await effects.get(genuine.call_id)
    assert (after.revision, after.value) == (before.revision, before.value)
    assert (stats["rejected"], stats["calls"], stats["recorded"]) == (1, 1, 0)
    assert info.num_redelivered == 0  # terminated, not handed back


async def test_a_forged_request_cannot_record_a_result_for_a_call_yet_to_run(
    nc: Client, js: JetStreamContext, requester: Requester
) -> None:
    runs: list[str] = []
    effects = await js.key_value(SUBJECTS.effects_bucket)
    genuine = requester.request("local", "secret", {"tag": "genuine"})
    async with running(nc, secret_registry(runs)) as worker, Forger(nc) as forger:
        await forger.publish(genuine, tenant="t2")
        refused = await forger.reply()
        assert refused.error is not None and refused.error.code == "invalid_call_id"
        await acked(js)
        with pytest.raises(KeyNotFoundError):
            await effects.get(genuine.call_id)  # nothing recorded under the genuine id

        await requester.publish(genuine)
        result = await requester.result(genuine.call_id, timeout=30)
    assert (result.status, result.content) == ("ok", "the secret of genuine")
    assert runs == ["genuine"]
    assert worker.stats["rejected"] == 1
