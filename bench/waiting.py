"""What parents waiting on children cost: ``--parents`` turns of an agent that calls
another agent, whose turn runs a tool that takes ``--seconds``, all at once.

    python -m bench.waiting [--parents 1000] [--seconds 40]

An embedded nats-server, one loop-worker process (``python -m loop_worker``, AckWait and
lease TTL 30 s), one tool-worker process (``bench.tools``, the slow ``count``) and the
fake OpenAI-compatible server (``auto``: the parent's input asks it to call the child
agent, the child's to call ``count``). While every parent waits on its child and every
child on its tool, it measures over ``--window`` seconds:

- the loop worker's CPU (per second, and per waiting parent);
- its resident memory, and per waiting parent;
- the messages nats-server received and sent per second (the in-progress acks, lease
  renewals and the callers' rechecks of their children that waiting costs).

A waiting parent holds its place in the loop worker, as a long tool call does
(docs/ARCHITECTURE.md, "Agents that call agents").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script too

from bench.harness import Mesh, cpu_seconds, pid_of, rss_kb
from loopmesh.aio import run
from loopmesh.testing.durable import Proc
from loopmesh.testing.fake_llm import FakeLLM
from loopmesh.testing.fake_replies import auto
from schemas import Turn, encode

AGENTS = """
[[agents]]
name = "parent"
description = "Asks the child."
agents = ["child"]

[[agents]]
name = "child"
description = "Counts slowly."
"""


async def varz(monitor: str) -> dict[str, Any]:
    async with httpx.AsyncClient() as http:
        return (await http.get(f"{monitor}/varz")).json()  # type: ignore[no-any-return]


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        config = root / "loopmesh.toml"
        config.write_text(AGENTS)
        ledger = root / "ledger"
        async with (
            FakeLLM(default=auto()) as llm,
            Mesh(root, ack_wait_s=30, lease_ttl_s=30) as mesh,
        ):
            await mesh.tool_worker(module="bench.tools", ack_wait_s=30, concurrency=4096)
            env = {
                "LOOPMESH_NATS__URL": mesh.server.url,
                "LOOPMESH_LLM__BASE_URL": llm.base_url, "LOOPMESH_LLM__API_KEY": "bench",
                "LOOPMESH_LLM__MODEL": "fake-model", "LOOPMESH_CONFIG": str(config),
                "LOOPMESH_LOOP_WORKER__MAX_ACTIVE_TURNS": str(2 * args.parents + 16),
                "LOOPMESH_LOOP_WORKER__MAX_WAITING_TURNS": str(2 * args.parents + 16),
                "LOOPMESH_LOOP__AGENT_TIMEOUT_S": str(args.seconds * 4),
            }  # fmt: skip
            worker = Proc("-m", "loop_worker", env=env)
            mesh.procs.append(worker)
            await worker.start("loop worker ready")
            pid = pid_of(worker)
            idle_rss = rss_kb(pid)
            count = json.dumps({"path": str(ledger), "label": "a", "seconds": args.seconds})
            task = "call agents__child " + json.dumps({"input": f"call local__count {count}"})
            js = mesh.nc.jetstream()
            started = time.monotonic()
            for i in range(args.parents):
                t = Turn(id=f"p{i}", tenant="bench", session=f"p{i}", input=task,
                         agent="parent", created_at=time.time())  # fmt: skip
                await js.publish(f"loopmesh.turns.bench.p{i}", encode(t),
                                 headers={"Nats-Msg-Id": t.msg_id})  # fmt: skip
            while not ledger.exists() or len(ledger.read_text().splitlines()) < args.parents:
                if time.monotonic() - started > args.seconds:
                    raise SystemExit("the children's tools did not all start in time")
                await asyncio.sleep(0.2)
            waiting_after = time.monotonic() - started
            before_cpu, before = cpu_seconds(pid), await varz(mesh.server.monitor_url)
            await asyncio.sleep(args.window)
            cpu = cpu_seconds(pid) - before_cpu
            after = await varz(mesh.server.monitor_url)
            rss = rss_kb(pid)
    n, w = args.parents, args.window
    msgs_in = (after["in_msgs"] - before["in_msgs"]) / w
    msgs_out = (after["out_msgs"] - before["out_msgs"]) / w
    print(f"{n} parents waiting on {n} children (each child's tool takes {args.seconds:g} s),")
    print(f"all waiting {waiting_after:.1f} s after they were published; over {w:g} s of waiting:")
    print(f"  loop worker CPU: {cpu / w * 1000:.1f} ms/s ({cpu / w / n * 1e6:.1f} µs/s per parent)")
    print(f"  loop worker RSS: {rss / 1024:.0f} MiB ({(rss - idle_rss) / n:.1f} KiB per parent"
          f" and its child, over {idle_rss / 1024:.0f} MiB idle)")  # fmt: skip
    print(f"  nats-server: {msgs_in:.0f} messages/s in, {msgs_out:.0f} out"
          f" ({msgs_in / n:.2f} in per parent per s)")  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--parents", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=60.0, help="the children's tool time")
    parser.add_argument("--window", type=float, default=20.0, help="seconds measured")
    run(main(parser.parse_args()))
