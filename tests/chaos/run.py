"""The workload of a chaos run, with the nemesis loose on it, and its record.

A 3-node cluster (R3), two loop workers and two tool workers as real processes, the
fake OpenAI-compatible server. Turns go out across sessions over ``span_s`` seconds;
each asks for one call of :func:`tests.chaos.tools.record` (whose executions land in a
ledger) and then completes. Meanwhile :mod:`.nemesis` applies its seeded schedule.
Once every node and worker is back, the run waits for every turn's ``loop_end`` (or
its deadline), then hands everything recorded to :func:`.checker.check`.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from nats.aio.client import Client

from loopmesh.cluster import NatsCluster
from loopmesh.jetstream import retry
from loopmesh.testing.durable import (
    SUBJECTS,
    Proc,
    connect_fast,
    provision_short,
    stream_events,
    worker_env,
)
from loopmesh.testing.fake_llm import FakeLLM
from loopmesh.testing.fake_replies import auto
from schemas import SessionSnapshot, Subjects, Turn, decode
from schemas.events import Event
from tests.loop_worker.durable import send_turn

from .checker import Accepted, Kill, Verdict, check
from .nemesis import Action, schedule

LEASE_TTL_S = 2.0
TENANT = "chaos"


@dataclass
class Outcome:
    seed: int
    verdict: Verdict
    actions: list[Action]
    done: list[str] = field(default_factory=list)  # what the nemesis did, as it did it
    elapsed_s: float = 0.0
    logs: str = ""
    trail: str = ""  # the stored events of the sessions with a problem
    observed: dict[str, object] = field(default_factory=dict)  # a partition run's counts

    def report(self) -> str:
        lines = [
            f"chaos seed {self.seed}: {'OK' if self.verdict.ok else 'FAILED'} "
            f"in {self.elapsed_s:.0f}s",
            f"  {self.verdict.summary()}",
            *(f"  nemesis {d}" for d in self.done),
            *(f"  observed {k}: {v}" for k, v in self.observed.items()),
            *(f"  problem: {p}" for p in self.verdict.problems()[:40]),
            *(f"  late: {p}" for p in self.verdict.late[:10]),
        ]
        if not self.verdict.ok:
            lines += [f"  replay: python -m tests.chaos --seed {self.seed}", self.trail]
        return "\n".join(lines)


class Workers:
    """The loop and tool workers, each slot restartable."""

    def __init__(
        self,
        url: str,
        llm_url: str,
        ledger: Path,
        launchers: dict[str, tuple[str, ...]] | None = None,
        loop_env: dict[str, str] | None = None,
        tool_env: dict[str, str] | None = None,
    ) -> None:
        self.url, self.llm_url, self.ledger = url, llm_url, ledger
        #: A command prefix per slot (``lw0``, ``tw1``...): its worker runs under it
        #: (``ip netns exec``, in a partition run).
        self.launchers = launchers or {}
        self.loop_env = loop_env or {}
        self.tool_env = tool_env or {}
        self.loop: list[Proc | None] = [None, None]
        self.tool: list[Proc | None] = [None, None]
        self.generation = 0
        self.dead: list[Proc] = []
        self.kills: list[Kill] = []
        self.crashed: list[str] = []  # workers that exited without being killed

    def check_alive(self) -> None:
        """Note every worker that exited on its own (a crash is a failure of the run)."""
        for kind, slots in (("loop", self.loop), ("tool", self.tool)):
            for i, proc in enumerate(slots):
                if proc is not None and proc.proc is not None:
                    code = proc.proc.returncode
                    if code is not None:
                        self.crashed.append(f"{kind} worker #{i} exited by itself (code {code})")
                        self.dead.append(proc)
                        slots[i] = None

    async def start_loop(self, i: int) -> None:
        self.generation += 1
        env = worker_env(
            self.url, self.llm_url, name=f"lw{i}-{self.generation}", replicas=3,
            lease_ttl_s=LEASE_TTL_S,
        ) | self.loop_env  # fmt: skip
        proc = self._proc(f"lw{i}", "-m", "loop_worker", env=env)
        self.loop[i] = proc
        await proc.start("loop worker ready", timeout=90)

    async def start_tool(self, i: int) -> None:
        proc = self._proc(
            f"tw{i}", "-m", "tool_worker", "--nats-url", self.url, "--no-provision",
            "--module", "tests.chaos.tools",
            env={
                "LOOPMESH_TOOL_WORKER__ACK_WAIT_S": "2", "LOOPMESH_NATS__REPLICAS": "3",
                "LOOPMESH_NATS__RECONNECT_WAIT_S": "0.05", **self.tool_env,
            },
        )  # fmt: skip
        self.tool[i] = proc
        await proc.start("serving pool=default", timeout=90)

    def _proc(self, slot: str, *args: str, env: dict[str, str]) -> Proc:
        launcher = self.launchers.get(slot)
        if launcher is None:
            return Proc(*args, env=env)
        return Proc(*launcher[1:], sys.executable, *args, env=env, python=launcher[0])

    async def kill(self, kind: str, i: int) -> int:
        slots = self.loop if kind == "loop" else self.tool
        self.check_alive()
        proc = slots[i]
        if proc is None or proc.proc is None:
            return 0  # it crashed: check_alive noted it
        pid = proc.proc.pid
        proc.kill()
        await proc.proc.wait()
        if kind == "tool":
            self.kills.append(Kill(pid=pid, at=time.time()))
        self.dead.append(proc)
        slots[i] = None
        return pid

    async def start(self) -> None:
        """Start both loop workers and both tool workers."""
        await asyncio.gather(
            *(self.start_loop(i) for i in range(2)), *(self.start_tool(i) for i in range(2))
        )

    def logs(self) -> str:
        out: list[str] = []
        for proc in [*self.dead, *self.loop, *self.tool]:
            if proc is not None:
                out.append(
                    f"--- {' '.join(proc.args)} {proc.env.get('LOOPMESH_LOOP_WORKER__NAME', '')}"
                )
                out.append(proc.output(last=100_000))
        return "\n".join(out)

    async def close(self, root: Path, outcome: Outcome) -> None:
        """Stop every worker; leave their output under ``root`` (``workers.log``, for a
        replay) and its end in ``outcome``."""
        logs = self.logs()
        (root / "workers.log").write_text(logs)
        outcome.logs = logs[-20_000:]
        for proc in [*self.loop, *self.tool]:
            if proc is not None:
                await proc.terminate(timeout=10)
        for proc in [*self.dead, *self.loop, *self.tool]:
            if proc is not None:
                await proc.close()


async def run(
    seed: int,
    root: Path,
    *,
    turns: int = 50,
    sessions: int = 10,
    span_s: float = 20.0,
    tool_seconds: float = 0.3,
    deadline_s: float = 120.0,
    turn_partitions: int = 1,
    say: Callable[[str], None] = lambda line: None,
) -> Outcome:
    """One chaos run under ``root`` (its stores, its ledger); see the module docstring.
    ``turn_partitions``: ``[nats] turn_partitions`` of every process, the nodes started
    with its mappings."""
    started = time.monotonic()
    actions = schedule(seed, lease_ttl_s=LEASE_TTL_S, span_s=span_s)
    outcome = Outcome(seed, Verdict(), actions)
    ledger = root / "ledger.jsonl"
    ledger.parent.mkdir(parents=True, exist_ok=True)
    ledger.touch()
    # a node killed or restarted on the floor's nats-server 2.10 takes up to a minute on a
    # loaded machine to be current with the meta leader again
    s = Subjects(turn_partitions=turn_partitions)
    cluster = NatsCluster(root / "cluster", ready_timeout=120.0, mappings=s.turn_mappings)
    async with cluster, FakeLLM(default=auto()) as llm:
        nc = await connect_fast(cluster.url, name="chaos")
        turnp = {"LOOPMESH_NATS__TURN_PARTITIONS": str(turn_partitions)}
        workers = Workers(cluster.url, llm.base_url, ledger, loop_env=turnp, tool_env=turnp)
        try:
            await provision(nc, cluster, s)
            await workers.start()
            t0 = time.monotonic()
            accepted: list[Accepted] = []

            async def nemesis() -> None:
                for action in actions:
                    await asyncio.sleep(max(0.0, t0 + action.at - time.monotonic()))
                    done = await _apply(action, cluster, workers, s.turns_stream_of(TENANT))
                    at = time.monotonic() - t0
                    outcome.done.append(f"{at:6.2f}s {done}")
                    say(f"seed {seed}: {at:6.2f}s {done}")

            sending = send_turns(
                nc, ledger, accepted, turns=turns, sessions=sessions, span_s=span_s,
                tool_seconds=tool_seconds,
            )  # fmt: skip
            await asyncio.gather(sending, nemesis())
            outcome.verdict, stored = await judge(nc, workers, accepted, deadline_s)
            outcome.trail = _trail(outcome.verdict, stored)
        finally:
            await workers.close(root, outcome)
            await nc.close()
    outcome.elapsed_s = time.monotonic() - started
    return outcome


async def provision(nc: Client, cluster: NatsCluster, subjects: Subjects = SUBJECTS) -> None:
    """Every stream and bucket, R3 with the run's short lease TTL, each with its leader."""
    await provision_short(nc, lease_ttl_s=LEASE_TTL_S, replicas=3, subjects=subjects)
    for stream in await nc.jetstream().streams_info():  # each elects its leader
        await cluster.leader_of(stream.config.name or "")


async def send_turns(
    nc: Client,
    ledger: Path,
    accepted: list[Accepted],
    *,
    turns: int,
    sessions: int,
    span_s: float,
    tool_seconds: float,
) -> None:
    """Send ``turns`` turns over ``sessions`` sessions, ``span_s / turns`` apart, each
    with one call of the ledger's tool; note each one the stream accepted."""
    for n in range(turns):
        session, turn_id = f"c{n % sessions}", f"t{n // sessions}"
        label = f"{session}-{turn_id}"
        args = {"ledger": str(ledger), "label": label, "seconds": tool_seconds}
        turn = Turn(
            id=turn_id, tenant=TENANT, session=session,
            input=f"call local__record {json.dumps(args)}", created_at=time.time(),
        )  # fmt: skip
        await retry(lambda t=turn: send_turn(nc, t), f"send {label}", timeout=60)
        accepted.append(Accepted(session, turn_id, label))
        await asyncio.sleep(span_s / turns)


async def judge(
    nc: Client,
    workers: Workers,
    accepted: list[Accepted],
    deadline_s: float,
    *,
    same_key: bool = False,
) -> tuple[Verdict, dict[str, list[tuple[Event, str]]]]:
    """Wait for every accepted turn's end (or the deadline), then check what was
    recorded; the verdict, and the stored events it judged."""
    await _until_ended(nc, accepted, deadline_s)
    workers.check_alive()
    sessions = {a.session for a in accepted}
    stored = {s: await _events(nc, s) for s in sessions}
    verdict = check(
        accepted,
        stored,
        [json.loads(line) for line in workers.ledger.read_text().splitlines() if line],
        workers.kills,
        {s: await _snapshot(nc, s) for s in sessions},
        same_key=same_key,
    )
    verdict.crashes = workers.crashed
    return verdict, stored


async def _apply(
    action: Action, cluster: NatsCluster, workers: Workers, turns: str = SUBJECTS.turns_stream
) -> str:
    kind, i = action.kind, action.target
    if kind in ("kill_loop_worker", "kill_tool_worker"):
        which = "loop" if kind == "kill_loop_worker" else "tool"
        pid = await workers.kill(which, i)
        await asyncio.sleep(action.hold)
        await (workers.start_loop(i) if which == "loop" else workers.start_tool(i))
        return f"kill -9 {which} worker #{i} (pid {pid}), restarted after {action.hold}s"
    if kind == "kill_leader_node":
        node = cluster.node(await cluster.leader_of(turns))
        await node.crash()
        await asyncio.sleep(action.hold)
        await node.start()
        await cluster.wait_ready()
        return f"kill -9 node {node.name} (turns leader), restarted after {action.hold}s"
    if kind == "pause_node":
        node = cluster.nodes[i]
        node.pause()
        try:
            await asyncio.sleep(action.hold)
        finally:
            node.resume()
        await cluster.wait_ready()
        return f"SIGSTOP node {node.name} for {action.hold}s (lease TTL {LEASE_TTL_S}s)"
    assert kind == "rolling_restart", kind
    for node in cluster.nodes:
        await cluster.restart(node)
    return "restarted n1, n2, n3 one after another"


async def _events(nc: Client, session: str) -> list[tuple[Event, str]]:
    stored = await retry(lambda: stream_events(nc, TENANT, session), f"events of {session}")
    return [(event, headers.get("Nats-Msg-Id", "")) for event, headers in stored]


async def _snapshot(nc: Client, session: str) -> SessionSnapshot | None:
    kv = await nc.jetstream().key_value(SUBJECTS.sessions_bucket)
    try:
        entry = await kv.get(f"{TENANT}.{session}")
    except Exception:
        return None
    return decode(entry.value or b"", SessionSnapshot) if entry.value else None


async def _until_ended(nc: Client, accepted: list[Accepted], deadline_s: float) -> None:
    """Until every accepted turn has a ``loop_end``, or the deadline (the checker then
    names the turns that have none)."""
    deadline = time.monotonic() + deadline_s
    waiting: dict[str, set[str]] = {}
    for turn in accepted:
        waiting.setdefault(turn.session, set()).add(turn.turn_id)
    while waiting and time.monotonic() < deadline:
        for session in list(waiting):
            try:
                events = await stream_events(nc, TENANT, session)
            except Exception:
                continue
            ended = {e.turn_id for e, _ in events if e.type == "loop_end"}
            if waiting[session] <= ended:
                del waiting[session]
        await asyncio.sleep(0.5)  # polling the stream: a test has no event to wait on


def _trail(verdict: Verdict, stored: dict[str, list[tuple[Event, str]]]) -> str:
    named = {p.split("/")[0].split(":")[0] for p in verdict.problems()}
    lines = []
    for session in sorted(named & set(stored)):
        lines.append(f"  events of {session}:")
        for event, msg_id in stored[session]:
            worker = getattr(event, "worker", "")
            said = getattr(event, "message", "") if event.type in ("tool_error", "error") else ""
            lines.append(
                f"    {event.ts:.3f} {event.turn_id} {event.iteration} {event.type} {msg_id} "
                f"{worker} {said}"
            )
    return "\n".join(lines)
