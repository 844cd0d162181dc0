"""A delivery of a turn that another delivery finished meanwhile is not run again.

A turn whose worker stalls past AckWait is delivered again; the second delivery waits
for the session's lease while the first finishes, acks the turn and releases the lease.
Once that delivery gets the lease, its turn is no longer in the (work-queue) stream, and
the session's next turn may have run since: running it now would run it twice, after
its successor (the chaos suite found a session whose snapshot counted a turn twice)."""

import time

from loopmesh.testing.durable import (
    SUBJECTS,
    connect_fast,
    provision_short,
    stream_events,
    wait_for,
)
from loopmesh.testing.fake_llm import FakeLLM
from loopmesh.testing.fake_replies import auto
from schemas import Turn
from tests.loop_worker.durable import Mesh, send_turn


async def test_a_delivery_whose_turn_left_the_stream_while_it_waited_for_the_lease_is_not_run(
    nats_server,
):
    nc = await connect_fast(nats_server.url)
    await provision_short(nc)
    js = nc.jetstream()
    leases = await js.key_value(SUBJECTS.leases_bucket)
    async with FakeLLM(default=auto()) as llm:
        mesh = Mesh(nats_server.url, llm.base_url, nc)
        try:
            worker = await mesh.loop_worker()
            # the first delivery's worker, as the second sees it: holding the lease
            await leases.put("acme.s1", b'{"owner": "first", "turn_id": "t1"}')
            turn = Turn(id="t1", tenant="acme", session="s1", input="hi", created_at=time.time())
            seq = await send_turn(nc, turn)
            held = worker.service._held
            await wait_for(lambda: len(held) == 1, timeout=30, what="the delivery")
            # the first delivery finishes: the turn is acked (leaves the stream), the
            # lease released
            await js.delete_msg(SUBJECTS.turns_stream, seq)
            await leases.delete("acme.s1")
            await wait_for(lambda: not held, timeout=30, what="the delivery to end")
            assert await stream_events(nc, "acme", "s1") == []  # it did not run
            sessions = await js.key_value(SUBJECTS.sessions_bucket)
            assert [k async for k in _keys(sessions)] == []  # no checkpoint either
        finally:
            await mesh.close()
            await nc.close()


async def _keys(kv):
    try:
        for key in await kv.keys():
            yield key
    except Exception:  # nats-py raises when the bucket has no keys
        return
