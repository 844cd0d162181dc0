"""Publish one turn to loopmesh with plain nats-py, and print its events until it ends.

    .venv/bin/python examples/publish_turn.py "What is 17 * 23?"
    .venv/bin/python examples/publish_turn.py --url nats://127.0.0.1:4222 \\
        --tenant local --session s1 "What is 17 * 23?"
    .venv/bin/python examples/publish_turn.py --agent calc --session c1 "What is 17 * 23?"

Only the wire contract is used (README, "The wire contract"): a turn is JSON published
with JetStream to ``loopmesh.turns.<tenant>.<session>`` with ``Nats-Msg-Id`` =
``<tenant>.<session>.<turn id>`` (ids are scoped: the stream deduplicates across tenants);
its events arrive on ``loopmesh.events.<tenant>.<session>.<type>``. Subscribe to the
events BEFORE publishing: a plain subscription does not replay, and the first events
of a turn come within milliseconds. Exits 0 when the turn completed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid

import nats


async def run(
    url: str, tenant: str, session: str, text: str, timeout: float, agent: str | None = None
) -> int:
    nc = await nats.connect(url)
    turn_id = uuid.uuid4().hex
    ended: asyncio.Future[dict] = asyncio.get_running_loop().create_future()

    async def on_event(msg: nats.aio.msg.Msg) -> None:
        event = json.loads(msg.data)
        if event["turn_id"] != turn_id:
            return  # another turn of the same session
        detail = {
            k: v for k, v in event.items() if k not in ("v", "tenant", "session", "turn_id", "ts")
        }
        print(event["type"], json.dumps(detail)[:200], flush=True)
        if event["type"] == "loop_end" and not ended.done():
            ended.set_result(event)

    # 1. subscribe first, ...
    sub = await nc.subscribe(f"loopmesh.events.{tenant}.{session}.>", cb=on_event)
    await nc.flush()  # the server has the subscription before the turn goes out
    # 2. ... then publish the turn (deduplicated by its id) and wait for the stream's ack
    turn = {"id": turn_id, "tenant": tenant, "session": session, "input": text,
            "created_at": time.time()}  # fmt: skip
    if agent is not None:  # a named agent (docs/AGENTS.md); unset: the session's
        turn["agent"] = agent
    # (said before the publish: its first events may come before the stream's ack)
    print(f"publishing turn {turn_id}", flush=True)
    await nc.jetstream().publish(
        f"loopmesh.turns.{tenant}.{session}",
        json.dumps(turn).encode(),
        headers={"Nats-Msg-Id": f"{tenant}.{session}.{turn_id}"},
    )
    try:
        end = await asyncio.wait_for(ended, timeout)
    except TimeoutError:
        print(f"no loop_end within {timeout:g}s: is a loop worker running (`loopmesh up`)?")
        return 1
    finally:
        await sub.unsubscribe()
        await nc.close()
    print(end.get("content", ""))
    return 0 if end["reason"] in ("task_completion", "converse", "ask_question") else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("text", help="the task")
    parser.add_argument("--url", default="nats://127.0.0.1:4222")
    parser.add_argument("--tenant", default="local")
    parser.add_argument("--session", default="s1")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--agent", help="the named agent that runs the turn")
    args = parser.parse_args()
    return asyncio.run(
        run(args.url, args.tenant, args.session, args.text, args.timeout, args.agent)
    )


if __name__ == "__main__":
    raise SystemExit(main())
