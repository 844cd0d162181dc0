"""loopmesh's performance goals, each with this run's figure and a verdict
(``met``, ``missed``, or ``not measured`` when its figures are missing)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from bench.common import Figures
from bench.durable_path import DurablePath
from bench.recovery import Recovery
from schemas.streams import TURN_ACK_WAIT_S

INPROCESS = "loopmesh in-process"
DEFAULT = "loopmesh (default sync)"
ALWAYS = "loopmesh (sync always)"
TEMPORALS = ("Temporal (local LLM act.)", "Temporal (activities)")  # each goal: the better
LANGGRAPH = "LangGraph + Postgres"
ACK_WAIT_S = TURN_ACK_WAIT_S  # the recovery runs' AckWait: the default


def _verdict(ok: bool) -> str:
    return "met" if ok else "missed"


def table(
    figs: list[Figures],
    top: int,
    dispatch: Any | None,
    durable: DurablePath | None,
    recoveries: list[Recovery],
) -> str:
    by = {f.name: f for f in figs if not f.error}
    rows: list[tuple[str, str, str, str]] = []

    def row(measure: str, goal: str, figure: Callable[[], tuple[str, bool]]) -> None:
        try:
            text, ok = figure()
        except (KeyError, ValueError, ZeroDivisionError, TypeError, IndexError, AttributeError):
            rows.append((measure, goal, "-", "not measured"))
            return
        rows.append((measure, goal, text, _verdict(ok)))

    def over(name: str) -> float:
        return by[name].p50 - by[INPROCESS].p50

    def temporal(key: Callable[[Figures], float], high: bool) -> str:
        """The Temporal set-up that does best on ``key`` (the conservative reference)."""
        ran = [by[n] for n in TEMPORALS if n in by]
        return (max if high else min)(ran, key=key).name

    def overhead_ratio(peer: str, limit: float) -> tuple[str, bool]:
        mine, theirs = over(ALWAYS), over(peer)
        if theirs <= 0:
            raise ZeroDivisionError
        text = f"{mine:+.1f} vs {theirs:+.1f} ms ({peer}): {mine / theirs:.2f}x (sync always)"
        return text, mine / theirs <= limit

    row(
        "overhead p50 per iteration",
        "<= 1/30 of Temporal's",
        lambda: overhead_ratio(temporal(lambda f: f.p50, False), 1 / 30),
    )
    row(
        "overhead p50 per iteration",
        "<= 1/2 of LangGraph+Postgres's",
        lambda: overhead_ratio(LANGGRAPH, 0.5),
    )

    def absolute() -> tuple[str, bool]:
        parts = [f"{over(DEFAULT):+.1f} (default) / {over(ALWAYS):+.1f} (always) ms over HTTP"]
        worst = max(over(DEFAULT), over(ALWAYS))
        if durable is not None and durable.overhead_p50 is not None:
            parts.append(f"{durable.overhead_p50:+.2f} ms (default) with the model in the worker")
        return "; ".join(parts), worst <= 1.5

    row("overhead p50 per iteration", "<= +1.5 ms", absolute)

    def throughput(peer: str, limit: float) -> tuple[str, bool]:
        mine, theirs = by[ALWAYS].throughput[top], by[peer].throughput[top]
        text = f"{mine:.0f} vs {theirs:.0f} sessions/s ({peer}): {mine / theirs:.1f}x (sync always)"
        return text, mine / theirs >= limit

    row(
        f"throughput at {top}",
        ">= 10x Temporal's",
        lambda: throughput(temporal(lambda f: f.throughput[top], True), 10),
    )
    row(f"throughput at {top}", ">= 3x LangGraph+Postgres's", lambda: throughput(LANGGRAPH, 3))

    def cpu() -> tuple[str, bool]:
        peer = temporal(lambda f: f.cpu_ms_per_turn, False)
        mine, theirs = by[ALWAYS].cpu_ms_per_turn, by[peer].cpu_ms_per_turn
        text = f"{mine:.1f} vs {theirs:.1f} ms per session ({peer}): {mine / theirs:.2f}x"
        text += " (sync always)"
        return text, mine / theirs <= 0.2

    row("CPU per iteration, all processes", "<= 1/5 of Temporal's", cpu)

    def memory() -> tuple[str, bool]:
        assert durable is not None and durable.memory_kb is not None
        return f"{durable.memory_kb:.1f} KB", durable.memory_kb <= 100

    row("memory per active session", "<= 100 KB", _safe(memory))

    def bound() -> tuple[str, bool]:
        assert durable is not None and durable.floor is not None
        real, limit = durable.real_ratio, durable.floor.bound
        assert real is not None
        return f"{real:.0%} of in-process vs a bound of {limit:.0%}: {real / limit:.0%}", (
            real / limit >= 0.75
        )

    row("bench/floor.py bound vs the real loop worker", "real >= 75% of the bound", _safe(bound))

    def tools(kind: str) -> tuple[str, bool]:
        assert dispatch is not None
        r = dispatch.results
        mine = r["loopmesh ToolWorker"]
        if kind == "floor":
            f = r["durable floor (hand-written)"]
            a, b = mine[1]["p50"] / f[1]["p50"], mine[64]["p50"] / f[64]["p50"]
            return f"{a:.2f}x / {b:.2f}x (1 / 64 in flight)", max(a, b) <= 1.25
        if kind == "faststream":
            f = r["FastStream NATS RPC (not durable)"]
            text = (
                f"{mine[1]['p50']:.2f} vs {f[1]['p50']:.2f} ms at 1; "
                f"{mine[64]['p50']:.1f} vs {f[64]['p50']:.1f} ms at 64"
            )
            return text, mine[1]["p50"] <= f[1]["p50"] and mine[64]["p50"] <= f[64]["p50"]
        c = r["Celery + Redis"]
        a, b = c[1]["p50"] / mine[1]["p50"], c[64]["p50"] / mine[64]["p50"]
        return f"{a:.1f}x / {b:.1f}x faster (1 / 64 in flight)", min(a, b) >= 10

    row("tool round trip p50", "<= 1.25x the durable floor", _safe(lambda: tools("floor")))
    row("tool round trip p50", "no slower than FastStream", _safe(lambda: tools("faststream")))
    row("tool round trip p50", ">= 10x faster than Celery", _safe(lambda: tools("celery")))

    def scaling(kind: str) -> tuple[str, bool]:
        assert dispatch is not None
        runs = next(v for k, v in dispatch.scaling.items() if k.startswith(kind))
        if kind == "I/O":
            effs = [r.efficiency for r in runs[1:]]
            text = f"efficiency {effs[0]:.0%} at 2, {effs[1]:.0%} at 4 workers"
            return text, min(effs) >= 0.9
        cores = os.cpu_count() or 1
        ups = [r.rate / runs[0].rate for r in runs]
        text = (
            f"speed-up {ups[1]:.2f}x at 2, {ups[2]:.2f}x at 4 workers ({cores} cores; "
            "nats-server and the caller share them)"
        )
        return text, ups[2] <= cores * 1.1 and ups[2] >= 0.85 * ups[1]

    row(
        "tool-pool scaling, 1/2/4 workers",
        ">= 90% efficiency, I/O-bound",
        _safe(lambda: scaling("I/O")),
    )
    row(
        "tool-pool scaling, 1/2/4 workers",
        "CPU-bound plateaus at the cores",
        _safe(lambda: scaling("CPU")),
    )

    def recovery() -> tuple[str, bool]:
        mine = next(r for r in recoveries if r.name.startswith("loopmesh") and not r.error)
        others = "; ".join(
            f"{r.short or r.name} {r.median('recovery_s'):.1f} s"
            for r in recoveries
            if not r.name.startswith("loopmesh") and not r.error
        )
        worst = max(k.recovery_s for k in mine.kills)
        text = f"loopmesh {mine.median('recovery_s'):.2f} s (worst {worst:.2f}); {others}"
        return text, worst <= ACK_WAIT_S + 1

    row("recovery: kill -9 mid-turn -> turn finished", "loopmesh <= AckWait + 1 s", _safe(recovery))

    lines = ["| measure | goal | figure (this run) | verdict |", "| --- | --- | --- | --- |"]
    lines += [f"| {m} | {g} | {f} | {v} |" for m, g, f, v in rows]
    return "\n".join(lines)


def _safe(figure: Callable[[], tuple[str, bool]]) -> Callable[[], tuple[str, bool]]:
    """An assertion that the figures are there counts as 'not measured'."""

    def inner() -> tuple[str, bool]:
        try:
            return figure()
        except (AssertionError, StopIteration) as e:
            raise KeyError from e

    return inner
