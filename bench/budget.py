"""Every message a one-call turn sends, by kind: the table of docs/ARCHITECTURE.md ("A
one-call turn's message budget").

    python -m bench.budget [--turns 20] [--echo 1]

An embedded nats-server, a loop-worker process with the zero-latency model
(``bench.instant_worker``) and a tool-worker process. A tap (a core subscription to
``>`` on its own connection) sees every message published on the server, requests,
replies and acks included. After a warm-up turn, ``--turns`` turns of ``--echo`` echo
calls run one after another in one session (its next turn on the worker that ran the
last one, the common case); the tap's messages are counted by kind, per turn, beside
the messages each stream and bucket stored.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import tempfile
from pathlib import Path

from bench.harness import Ends, Mesh, S, turn
from loopmesh.aio import run
from loopmesh.nats import connect
from loopmesh.settings import NatsSettings

STORES = {
    "events": S.events_stream, "turns": S.turns_stream, "tools": S.tools_stream,
    "sessions": f"KV_{S.sessions_bucket}", "leases": f"KV_{S.leases_bucket}",
    "effects": f"KV_{S.effects_bucket}", "control": f"KV_{S.control_bucket}",
}  # fmt: skip


def kind(subject: str, headers: dict[str, str] | None, reply: str = "") -> str:
    """What a message on ``subject`` is, for the table (a consumer's delivery keeps the
    stream subject and has a ``$JS.ACK`` reply)."""
    if reply.startswith("$JS.ACK."):
        return "delivery of a " + kind(subject, headers)
    parts = subject.split(".")
    if subject.startswith(f"{S.prefix}.events."):
        return f"event {parts[4]}"  # <prefix>.events.<tenant>.<session>.<type>[.<partition>]
    if subject.startswith(f"{S.prefix}.turns."):
        return "turn"
    if subject.startswith(f"{S.prefix}.tools."):
        return "tool call"
    if subject.startswith("$KV."):
        op = (headers or {}).get("KV-Operation", "put").lower()
        return f"KV {parts[1]} {op}"
    if subject.startswith("$JS.ACK."):
        return "ack of a delivery (turn, call, in-progress)"
    if subject.startswith("$JS.API.DIRECT.GET."):
        return f"direct get {parts[4]}"
    if subject.startswith("$JS.API.CONSUMER.MSG.NEXT."):
        return "pull request (fetch)"
    if subject.startswith("$JS.API."):
        return "JetStream API " + ".".join(parts[2:4])
    if subject.startswith("$JS.EVENT."):
        return "server advisory"
    return "reply or ack (to an inbox)"


async def stored(js: object) -> dict[str, int]:
    out = {}
    for label, stream in STORES.items():
        info = await js.stream_info(stream)  # type: ignore[attr-defined]
        out[label] = info.state.last_seq
    for name in S.events_streams[1:]:  # the events of the other partitions, if any
        info = await js.stream_info(name)  # type: ignore[attr-defined]
        out["events"] += info.state.last_seq
    return out


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        async with Mesh(Path(tmp), ack_wait_s=30, lease_ttl_s=30) as mesh:
            await mesh.tool_worker()
            await mesh.instant_worker("w1", args.echo)
            ends = Ends(mesh.nc)
            await ends.start()
            tap = await connect(NatsSettings(url=mesh.server.url), name="tap")
            seen: collections.Counter[str] = collections.Counter()
            counting = False

            async def count(msg: object) -> None:
                if counting:
                    seen[kind(msg.subject, msg.headers, msg.reply)] += 1  # type: ignore[attr-defined]

            await tap.subscribe(">", cb=count)
            await tap.flush()
            text = f"echo {args.echo}"
            await ends.run(turn("warm", "budget", text))
            await asyncio.sleep(0.5)  # the warm-up's acks and releases are in
            js = mesh.nc.jetstream()
            before = await stored(js)
            counting = True
            for i in range(args.turns):
                await ends.run(turn(f"t{i}", "budget", text))
            await asyncio.sleep(0.5)
            counting = False
            after = await stored(js)
            await tap.close()
    n = args.turns
    # the tap's own view of the client's publishes and loop_end subscription is in it
    print(f"messages per turn of {args.echo} echo call(s), {n} turns in one session:")
    for name, count in sorted(seen.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"  {count / n:6.2f}  {name}")
    print(f"  {sum(seen.values()) / n:6.2f}  in all")
    print("stored per turn:")
    for label in STORES:
        print(f"  {(after[label] - before[label]) / n:6.2f}  {label}")
    print(f"  {sum(after[k] - before[k] for k in STORES) / n:6.2f}  in all")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--echo", type=int, default=1)
    run(main(parser.parse_args()))
