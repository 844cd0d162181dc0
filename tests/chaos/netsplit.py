"""A chaos run whose nemesis cuts the network instead of killing processes.

The workload of :mod:`.run` (turns whose one tool call lands in a ledger), with every
NATS node and every worker in a network namespace of its own on one switch
(:mod:`loopmesh.testing.netns`), and the loop workers sharing a rate limit, so that one
of them leads the limiter. The nemesis (:func:`.nemesis.cut_schedule`) applies one
of each cut, then heals it:

- ``cut_node``: a node cut from the other two (clients still reach it): the one the
  rate-limit leader is connected to, whose renewals must then cross the cut while the
  asks of that node's other clients still reach it;
- ``cut_loop_worker``: a loop worker cut from everyone while it runs a turn, longer than
  its lease TTL and AckWait, so that the other worker takes the turn over;
- ``cut_tool_worker``: a tool worker cut from everyone during a call;
- ``cut_limiter_leader``: the loop worker that leads the rate limits, cut from everyone
  longer than the leader's TTL.

No process is killed. Besides :func:`.checker.check`'s verdict (with a call run again
under one idempotency key allowed), :mod:`.observed` records, as they happen, every
stored snapshot, the leader key's history and every answer the limiter leaders send;
:func:`.observed.zombies` and :func:`.observed.two_leaders` judge them.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from loopmesh.cluster import ClusterNode
from loopmesh.errors import NatsServerError
from loopmesh.testing.durable import connect_fast
from loopmesh.testing.fake_llm import FakeLLM
from loopmesh.testing.fake_replies import auto
from loopmesh.testing.netns import Member, PartitionedCluster, Switch

from .checker import Accepted, Verdict
from .nemesis import Action, cut_schedule
from .observed import Cut, Observer, two_leaders, zombies
from .run import LEASE_TTL_S, TENANT, Outcome, Workers, _trail, judge, provision, send_turns

ACK_WAIT_S = 2.0  # the loop and tool workers' (worker_env's, Workers.start_tool's)
LIMITER_TTL_S = 2.0
#: Every model request asks the leader; the ceiling is never reached.
LIMITS = json.dumps({"models": {"fake-model": {"rpm": 1_000_000}}})


async def run(
    seed: int,
    root: Path,
    *,
    turns: int = 40,
    sessions: int = 10,
    span_s: float = 24.0,
    tool_seconds: float = 0.5,
    deadline_s: float = 120.0,
    say: Callable[[str], None] = lambda line: None,
) -> Outcome:
    """One partition run under ``root``; see the module docstring."""
    started = time.monotonic()
    actions = cut_schedule(seed, longest_ttl_s=LEASE_TTL_S + ACK_WAIT_S, span_s=span_s)
    outcome = Outcome(seed, Verdict(), actions)
    ledger = root / "ledger.jsonl"
    ledger.parent.mkdir(parents=True, exist_ok=True)
    ledger.touch()
    (root / "ledger.jsonl.started").touch()
    async with Switch() as net:
        slots = {name: net.member(name) for name in ("lw0", "lw1", "tw0", "tw1")}
        cluster = PartitionedCluster(root / "cluster", net, ready_timeout=120.0)
        async with cluster, FakeLLM(default=auto(), host=net.host) as llm:
            nc = await connect_fast(cluster.url, name="chaos")
            loop_env = {
                "LOOPMESH_LLM__LIMITS": LIMITS,
                "LOOPMESH_LOOP_WORKER__LIMITER_TTL_S": str(LIMITER_TTL_S),
            }
            workers = Workers(
                cluster.url, llm.base_url, ledger,
                launchers={k: m.launcher for k, m in slots.items()}, loop_env=loop_env,
            )  # fmt: skip
            observer = Observer(nc, TENANT, cluster.urls)
            cuts: list[Cut] = []
            try:
                await provision(nc, cluster)
                await observer.start()
                await workers.start()
                t0 = time.monotonic()
                accepted: list[Accepted] = []

                async def nemesis() -> None:
                    for action in actions:
                        await asyncio.sleep(max(0.0, t0 + action.at - time.monotonic()))
                        cut = await _apply(action, net, slots, cluster, workers, observer)
                        cuts.append(cut)
                        at = time.monotonic() - t0
                        outcome.done.append(f"{at:6.2f}s {cut}")
                        say(f"seed {seed}: {at:6.2f}s {cut}")

                sending = send_turns(
                    nc, ledger, accepted, turns=turns, sessions=sessions, span_s=span_s,
                    tool_seconds=tool_seconds,
                )  # fmt: skip
                await asyncio.gather(sending, nemesis())
                verdict, stored = await judge(nc, workers, accepted, deadline_s, same_key=True)
                await observer.close()
                runs = [json.loads(line) for line in ledger.read_text().splitlines() if line]
                verdict.zombies = zombies(cuts, stored, observer.snapshots, accepted, runs)
                answers = observer.answers
                verdict.leaders = two_leaders(observer.settles.values())
                outcome.observed = {
                    "snapshots": len(observer.snapshots),
                    "answers": len(answers),
                    "grants": sum(a.granted for a in answers),
                    "grants used": sum(1 for s in observer.settles.values() if s.term),
                    "asks answered twice": len(answers) - len({a.reply for a in answers}),
                    "leader terms": observer.terms(),
                }
                outcome.verdict = verdict
                outcome.trail = _trail(verdict, stored)
            finally:
                net.heal()
                await observer.close()
                await workers.close(root, outcome)
                await nc.close()
    outcome.elapsed_s = time.monotonic() - started
    return outcome


async def _apply(
    action: Action,
    net: Switch,
    slots: dict[str, Member],
    cluster: PartitionedCluster,
    workers: Workers,
    observer: Observer,
) -> Cut:
    kind, i, hold = action.kind, action.target, action.hold
    if kind == "cut_node":  # the leader's, if it leads: its asks still reach it
        owner = await observer.leader()
        k = next((k for k in range(2) if _name(workers, k) == owner), None)
        found = await _node_of(cluster, slots[f"lw{k}"].address) if k is not None else None
        node = found or cluster.nodes[i]
        member = cluster.members[node.name]
        others = [cluster.members[n.name] for n in cluster.nodes if n is not node]
        start = time.time()
        net.cut(member, others)
        await asyncio.sleep(hold)
        net.heal(member)
        target = f"{node.name} (the limiter leader's)" if found else node.name
        end = time.time()
        try:
            await cluster.wait_ready()
        except NatsServerError as exc:  # slow to catch up: the verdict judges what it cost
            target += f", {exc} after the heal"
        return Cut(kind, target, start, end)
    if kind == "cut_loop_worker" or kind == "cut_limiter_leader":
        owner = await observer.leader()
        if kind == "cut_limiter_leader":
            i = next((k for k in range(2) if _name(workers, k) == owner), i)
        name = _name(workers, i)
        turns: tuple[tuple[str, str], ...] = ()
        if kind == "cut_loop_worker":  # in the middle of a turn
            turns = await observer.running(name, timeout=10.0)
        else:  # the leader is a loop worker: its turns are watched as well
            turns = await observer.running(name, timeout=0.0)
        member = slots[f"lw{i}"]
        start = time.time()
        net.isolate(member)
        await asyncio.sleep(hold)
        net.heal(member)
        target = f"{name} (the limiter leader)" if name == owner else name
        return Cut(kind, target, start, time.time(), turns)
    assert kind == "cut_tool_worker", kind
    proc = workers.tool[i]
    pid = proc.proc.pid if proc is not None and proc.proc is not None else 0
    calls = await _in_a_call(workers.ledger, pid, timeout=10.0)
    member = slots[f"tw{i}"]
    start = time.time()
    net.isolate(member)
    await asyncio.sleep(hold)
    net.heal(member)
    return Cut(kind, f"tool worker #{i} (pid {pid})", start, time.time(), calls=calls)


async def _node_of(cluster: PartitionedCluster, address: str) -> ClusterNode | None:
    """The node a client at ``address`` is connected to (None: none, or no answer)."""
    async with httpx.AsyncClient(timeout=5.0) as http:
        for node in cluster.nodes:
            try:
                connz = (await http.get(f"{node.monitor_url}/connz")).json()
            except (httpx.HTTPError, ValueError):
                continue
            if any(c.get("ip") == address for c in connz.get("connections") or ()):
                return node
    return None


def _name(workers: Workers, i: int) -> str:
    proc = workers.loop[i]
    return proc.env.get("LOOPMESH_LOOP_WORKER__NAME", "") if proc is not None else ""


async def _in_a_call(ledger: Path, pid: int, *, timeout: float) -> tuple[str, ...]:
    """The labels of the calls the tool worker ``pid`` runs, once it runs one (none
    after ``timeout``: it is cut anyway)."""
    deadline = time.monotonic() + timeout
    while True:
        ended = {(r["label"], r["start"]) for r in _lines(ledger)}
        calls = tuple(
            str(r["label"])
            for r in _lines(Path(f"{ledger}.started"))
            if r["pid"] == pid and (r["label"], r["start"]) not in ended
        )
        if calls or time.monotonic() > deadline:
            return calls
        await asyncio.sleep(0.05)  # polling a file a tool appends to


def _lines(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line]
