"""What ``bench/distributed.py`` and ``bench/floor.py`` run on: the turns and settings
both paths share, the load shape, the in-process engine, CPU meters read from
``/proc``, the distributed mesh (an embedded nats-server, services as processes,
a lean client for turns and their ``loop_end``), and what the ceiling benches
(``bench/ceiling.py``, ``bench/turns_ceiling.py``) share: their command line and their
load processes."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.instant_worker import InstantLLM  # noqa: E402
from loop_worker.engine import Engine  # noqa: E402
from loop_worker.engine.inmemory import InMemoryEvents, InMemoryStore, LocalTools  # noqa: E402
from loop_worker.engine.settings import LoopSettings  # noqa: E402
from loopmesh.cluster import NatsCluster  # noqa: E402
from loopmesh.jetstream import Publisher, acked, settled  # noqa: E402
from loopmesh.nats import connect  # noqa: E402
from loopmesh.server import NatsServer  # noqa: E402
from loopmesh.settings import NatsSettings  # noqa: E402
from loopmesh.testing.durable import Proc, provision_short  # noqa: E402
from schemas import Subjects, Turn, decode, encode  # noqa: E402
from schemas.events import AnyEvent, LoopEnd  # noqa: E402
from schemas.subjects import MAX_PARTITIONS  # noqa: E402

S = Subjects()
TENANT = "bench"
MODEL = "instant"  # no tiktoken encoding of its own: both paths count with the fallback


def loop_fields(iterations: int) -> dict[str, Any]:
    """The ``[loop]`` settings of both paths: room for ``iterations`` echo calls, no
    pruning or summaries."""
    return {
        "max_iterations": iterations + 2,
        "context_budget_tokens": 1_000_000,
        "summarize_with_llm": False,
    }


def turn(turn_id: str, session: str, text: str = "go", tenant: str = TENANT) -> Turn:
    return Turn(id=turn_id, tenant=tenant, session=session, input=text, created_at=time.time())


@dataclass(frozen=True)
class Load:
    """The throughput runs' shape: each client runs its turns one after another, in
    fresh sessions of ``per_session`` turns; a run is about ``total`` turns, split among
    its clients (at least one session each)."""

    per_session: int
    total: int

    def turns_each(self, clients: int) -> int:
        return max(self.per_session, self.total // clients)

    async def run(
        self, run_turn: Callable[[Turn], Awaitable[object]], clients: int, tag: str
    ) -> float:
        """Turns/s of ``clients`` concurrent clients."""
        each, per = self.turns_each(clients), self.per_session

        async def client(i: int) -> None:
            for k in range(each):
                await run_turn(turn(f"{tag}{i}x{k}", f"{tag}{i}s{k // per}"))

        started = time.perf_counter()
        await asyncio.gather(*(client(i) for i in range(clients)))
        return clients * each / (time.perf_counter() - started)

    async def warm_up(self, run_turn: Callable[[Turn], Awaitable[object]], tag: str) -> None:
        await Load(self.per_session, 0).run(run_turn, 16, tag)


# -- CPU time of processes ------------------------------------------------------------------

TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) * TICK_S  # fields 14 and 15 of proc(5)


def machine_busy_seconds() -> float:
    """CPU time every core of the machine has spent busy so far (``/proc/stat``)."""
    user, nice, system, _idle, _iowait, irq, softirq = map(
        int, Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8]
    )
    return (user + nice + system + irq + softirq) * TICK_S


class CpuMeter:
    """CPU seconds each named process spends between ``start()`` and ``stop()``, and
    what the rest of the machine spends meanwhile (``OTHERS``)."""

    OTHERS = "rest of the machine"

    def __init__(self, pids: Mapping[str, int]) -> None:
        self.pids = dict(pids)
        self.spent: dict[str, float] = {}
        self.wall = 0.0
        self.runs = 0

    def start(self) -> None:
        self._before = {name: cpu_seconds(pid) for name, pid in self.pids.items()}
        self._machine = machine_busy_seconds()
        self._started = time.perf_counter()

    def stop(self) -> None:
        """Add the time since ``start()`` (a meter adds up several runs)."""
        self.wall += time.perf_counter() - self._started
        spent = {n: cpu_seconds(p) - self._before[n] for n, p in self.pids.items()}
        machine = machine_busy_seconds() - self._machine
        spent[self.OTHERS] = max(0.0, machine - sum(spent.values()))
        for name, seconds in spent.items():
            self.spent[name] = self.spent.get(name, 0.0) + seconds
        self.runs += 1


# -- the ceiling benches: load processes of their own -----------------------------------


def counts(text: str) -> list[int]:
    """``--partitions 1,4``: comma-separated partition counts, each one a deployment may
    have (1 to :data:`~schemas.subjects.MAX_PARTITIONS`)."""
    try:
        found = [int(n) for n in text.split(",")]
    except ValueError:
        found = []
    if not found or not all(1 <= n <= MAX_PARTITIONS for n in found):
        raise argparse.ArgumentTypeError(f"counts of 1 to {MAX_PARTITIONS}, not {text!r}")
    return found


def at_least_one(text: str) -> int:
    """``--publishers 2``: a count of one or more."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"a count of 1 or more, not {text!r}")
    return int(text)


def ceiling_parser(doc: str | None, counted: str) -> argparse.ArgumentParser:
    """The ceiling benches' command line: ``--seconds``, ``--publishers``, ``--partitions``
    (the ``counted`` setting's counts to measure), and the hidden ``--publisher`` and
    ``--url`` that a bench gives the load processes it starts."""
    parser = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--publishers", type=at_least_one, default=2)
    parser.add_argument(
        "--partitions",
        type=counts,
        default=[1, 4],
        help=f"comma-separated {counted} counts to measure (default 1,4)",
    )
    parser.add_argument("--publisher", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--url", default="", help=argparse.SUPPRESS)
    return parser


def servers_cpu(pids: list[int]) -> float:
    """CPU seconds the servers ``pids`` have spent so far, all together."""
    return sum(cpu_seconds(pid) for pid in pids)


async def bench_process(module: str, *args: str, stdin: bool = False) -> asyncio.subprocess.Process:
    """``python -m <module> <args>`` from the project's root, its stdout piped (and its
    stdin, with ``stdin``): a bench's publishers and consumers run apart from it, so that
    one Python process is not the limit."""
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", module, *args, cwd=str(ROOT), stdout=asyncio.subprocess.PIPE,
        stdin=asyncio.subprocess.PIPE if stdin else None,
    )  # fmt: skip


async def bound_unacked(waiting: list[asyncio.Future[Any]], window: int) -> None:
    """A publisher's bounded window of acks: once ``waiting`` holds ``window`` of them,
    wait for its older half (``window`` 0: for all of them)."""
    if len(waiting) >= window:
        half = window // 2 or len(waiting)
        await asyncio.gather(*(settled(f, 30) for f in waiting[:half]))
        del waiting[:half]


# -- in-process ---------------------------------------------------------------------------


def local_engine(iterations: int) -> tuple[Engine, InMemoryEvents]:
    tools = LocalTools()

    @tools.tool(description="Return the text.")
    async def echo(text: str) -> str:
        return text

    events = InMemoryEvents()
    engine = Engine(
        settings=LoopSettings(**loop_fields(iterations)),
        llm=InstantLLM("local__echo"),
        tools=tools,
        events=events,
        store=InMemoryStore(),
        model=MODEL,
    )
    return engine, events


# -- distributed ------------------------------------------------------------------------


class Mesh:
    """An embedded nats-server (or, with ``nodes`` > 1, a cluster of that many, every
    stream and bucket on 3 replicas), provisioned, and the services started on it as
    processes, stopped with it."""

    def __init__(
        self,
        store: Path,
        *,
        ack_wait_s: float = 2.0,
        lease_ttl_s: float = 2.0,
        env: dict[str, str] | None = None,
        nodes: int = 1,
    ) -> None:
        self.server = NatsServer(store)
        self.cluster = NatsCluster(store / "cluster", size=nodes) if nodes > 1 else None
        self.replicas = min(3, nodes)
        self.ack_wait_s = ack_wait_s
        self.lease_ttl_s = lease_ttl_s
        self.env = env or {}  # more variables for every worker process (OTEL_*, say)
        if self.cluster is not None:
            self.env = {**self.env, "LOOPMESH_NATS__REPLICAS": str(self.replicas)}
        self.procs: list[Proc] = []

    @property
    def url(self) -> str:
        """The client URL (a cluster's: every node's, comma-separated)."""
        return self.cluster.url if self.cluster is not None else self.server.url

    @property
    def server_pids(self) -> dict[str, int]:
        """The nats-server processes by name: ``nats-server``, or one per node."""
        if self.cluster is None:
            return {"nats-server": self.server.pid or 0}
        return {f"nats-server {n.name}": n.pid or 0 for n in self.cluster.nodes}

    async def __aenter__(self) -> Mesh:
        if self.cluster is not None:
            await self.cluster.start()
        else:
            await self.server.start()
        try:
            self.nc = await connect(NatsSettings(url=self.url), name="bench")
            await provision_short(self.nc, lease_ttl_s=self.lease_ttl_s, replicas=self.replicas)
        except BaseException:
            await self._stop_servers()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        for proc in reversed(self.procs):
            await proc.close()
        await self.nc.close()
        await self._stop_servers()

    async def _stop_servers(self) -> None:
        if self.cluster is not None:
            await self.cluster.stop()
        await self.server.stop()

    async def tool_worker(
        self, concurrency: int = 512, module: str = "bench.tools", ack_wait_s: float = 2.0
    ) -> Proc:
        proc = Proc(
            "-m", "tool_worker", "--nats-url", self.url, "--no-provision",
            "--module", module, "--concurrency", str(concurrency),
            env={"LOOPMESH_TOOL_WORKER__ACK_WAIT_S": f"{ack_wait_s:g}", **self.env},
        )  # fmt: skip
        self.procs.append(proc)
        return await proc.start("serving pool=")

    async def gateway(self, env: dict[str, str] | None = None) -> tuple[Proc, str]:
        """``loopmesh gateway`` on a free loopback port, no auth (every request is tenant
        ``local``); the process and its base URL."""
        proc = Proc(
            "-m", "loopmesh", "gateway", "--nats-url", self.url, "--no-auth", "--port", "0",
            env={**self.env, **(env or {})},
        )  # fmt: skip
        self.procs.append(proc)
        line = await (await proc.start()).wait_line("gateway   http")
        return proc, line.split()[1]

    def _service_env(self, name: str) -> dict[str, str]:
        return {
            **self.env,
            "LOOPMESH_NATS__URL": self.url,
            "LOOPMESH_LOOP_WORKER__ACK_WAIT_S": str(self.ack_wait_s),
            "LOOPMESH_LOOP_WORKER__LEASE_TTL_S": str(self.lease_ttl_s),
            "LOOPMESH_LOOP_WORKER__NAME": name,
        }

    async def loop_worker_process(
        self, llm_url: str, name: str, env: dict[str, str] | None = None
    ) -> Proc:
        """``python -m loop_worker`` with an OpenAI-compatible LLM at ``llm_url`` (``env``:
        more settings, ``LOOPMESH_LOOP__*`` say)."""
        env = {
            **self._service_env(name),
            "LOOPMESH_LLM__BASE_URL": llm_url,
            "LOOPMESH_LLM__API_KEY": "bench",
            "LOOPMESH_LLM__MODEL": "fake-model",
            **(env or {}),
        }
        proc = Proc("-m", "loop_worker", env=env)
        self.procs.append(proc)
        return await proc.start("loop worker ready")

    async def instant_worker(self, name: str, iterations: int) -> Proc:
        """``python -m bench.instant_worker``: the same worker with :class:`InstantLLM`
        and the in-process side's loop settings."""
        env = {
            **self._service_env(name),
            "LOOPMESH_LLM__MODEL": MODEL,
            "LOOPMESH_LOOP_WORKER__PROVISION": "false",  # keep this bench's provisioning
            "LOOPMESH_LOOP_WORKER__MAX_ACTIVE_TURNS": "512",
        }
        for field, value in loop_fields(iterations).items():
            env[f"LOOPMESH_LOOP__{field.upper()}"] = json.dumps(value)
        proc = Proc("-m", "bench.instant_worker", "--log-level", "INFO", env=env)
        self.procs.append(proc)
        return await proc.start("loop worker ready")

    async def terminate(self) -> None:
        """Stop every service as an operator would (SIGTERM, then a drain); one that
        exits with an error raises, saying what it printed last."""
        codes = await asyncio.gather(*(p.terminate() for p in reversed(self.procs)))
        if any(codes):
            raise RuntimeError(f"a service exited with {codes} on SIGTERM:\n{exited(self.procs)}")

    @contextlib.contextmanager
    def explained(self) -> Iterator[None]:
        """Around work on the mesh: an error gets a note of what the services that
        ended printed last (a crash says why there)."""
        try:
            yield
        except (Exception, ExceptionGroup) as exc:
            exc.add_note(exited(self.procs) or "(every process was still running)")
            raise


#: AckWait and lease TTL of the benches' meshes: far above any wait they measure (the
#: defaults are 2 s), so a turn left to them stands out as one of about 30 s.
QUIET_S = 30.0


@contextlib.asynccontextmanager
async def production_mesh(servers: str, prefix: str) -> AsyncIterator[Mesh]:
    """A :class:`Mesh` of ``servers`` (``r1``: one nats-server, ``r3``: a cluster of
    three) in a temporary directory named from ``prefix``, AckWait and lease TTL at
    :data:`QUIET_S`; at the end its services are stopped as an operator
    would (:meth:`Mesh.terminate`), and an error is noted with what they printed."""
    with tempfile.TemporaryDirectory(prefix=prefix) as store:
        nodes = 3 if servers == "r3" else 1
        mesh = Mesh(Path(store), ack_wait_s=QUIET_S, lease_ttl_s=QUIET_S,
                    nodes=nodes)  # fmt: skip
        async with mesh:
            with mesh.explained():
                yield mesh
                await mesh.terminate()


class Ends:
    """The load generator's client side: publishes turns and hears every loop_end of the
    bench tenant (or ``tenant``; ``*``: every tenant's), through the loop worker's own
    lean plumbing (a msgspec-decoded ack on one inbox, loop_ends on one subscription), so
    that the load generator takes as little as it can of the cores the distributed path
    shares."""

    def __init__(self, nc: Any, tenant: str = TENANT) -> None:
        self.nc = nc
        self.tenant = tenant
        self.publisher = Publisher(nc)
        self.waiters: dict[str, asyncio.Future[LoopEnd]] = {}

    async def start(self) -> None:
        await self.publisher.start()
        subject = f"{S.prefix}.events.{self.tenant}.*.loop_end"
        self.sub = await self.nc.subscribe(subject, cb=self._on)

    async def _on(self, msg: Any) -> None:
        event = decode(msg.data, AnyEvent)
        future = self.waiters.pop(event.turn_id, None)
        if future is not None and not future.done():
            future.set_result(event)

    def expect(self, turn_id: str) -> asyncio.Future[LoopEnd]:
        future: asyncio.Future[LoopEnd] = asyncio.get_running_loop().create_future()
        self.waiters[turn_id] = future
        return future

    async def publish(self, t: Turn) -> asyncio.Future[LoopEnd]:
        """Publish ``t`` (its ack awaited); the future of its loop_end."""
        done = self.expect(t.id)
        subject = S.turn(t.tenant, t.session)
        await acked(self.publisher, subject, encode(t), {"Nats-Msg-Id": t.msg_id})
        return done

    async def run(self, t: Turn, timeout: float = 120) -> LoopEnd:
        """Publish ``t`` (its ack awaited) and wait for its loop_end."""
        return await settled(await self.publish(t), timeout)  # type: ignore[no-any-return]


async def publish(nc: Any, t: Turn) -> None:
    await nc.jetstream().publish(
        S.turn(t.tenant, t.session), encode(t), headers={"Nats-Msg-Id": t.msg_id}
    )


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def exited(procs: list[Proc]) -> str:
    """What the processes that ended printed last (a crash says why there)."""
    out = []
    for proc in procs:
        if proc.proc is not None and proc.proc.returncode is not None:
            out.append(f"{' '.join(proc.args)} exited ({proc.proc.returncode}):\n{proc.output(20)}")
    return "\n".join(out)


def pid_of(proc: Proc) -> int:
    assert proc.proc is not None
    return proc.proc.pid
