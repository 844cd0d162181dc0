"""What one configuration of ``python -m bench.load`` measured, and how it is printed: a
block per configuration, then one table of them all (and a chart, with matplotlib)."""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from bench.harness import CpuMeter, S

STALL_S = 1.0  # a turn this much over the model's time is a stall
BIN_S = 0.1  # the latency histogram's bins
#: The processes that are loopmesh (by the start of their names in the CPU meter).
LOOPMESH = ("loop worker", "nats-server", "tool worker", "gateway")


def pct(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, nearest rank; NaN when there are none."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Stored(NamedTuple):
    """A stream's state: its last sequence (messages ever written), messages and bytes
    kept."""

    last_seq: int
    messages: int
    bytes: int


async def stored(js: Any) -> dict[str, Stored]:
    """Every stream's state (KV buckets are streams ``KV_<bucket>``), each read from
    its leader."""
    out: dict[str, Stored] = {}
    for listed in await js.streams_info():
        name = listed.config.name
        state = (await js.stream_info(name)).state
        out[name] = Stored(state.last_seq, state.messages, state.bytes)
    return out


@dataclass
class Result:
    """One configuration's figures: ``servers`` (R1 or R3) x ``workers`` x ``load``."""

    servers: str
    workers: int
    load: str  # "back-to-back" or "think 2 s"
    sessions: int
    per_session: int
    turns: int = 0
    wall_s: float = 0.0
    latency_s: list[float] = field(default_factory=list)  # per turn: publish -> loop_end
    model_s: list[float] = field(default_factory=list)  # the model's time, as streamed
    nominal_s: float = 0.0  # the model's time per turn, as paced
    reasons: Counter[str] = field(default_factory=Counter)  # loop_end reasons
    token_ms: Sequence[float] = ()  # per token received by an SSE client: emit -> receipt
    watched: int = 0  # sessions watched by SSE clients
    watching: int = 0  # the clients whose sessions were watched
    sent: tuple[int, int] = (0, 0)  # tokens and characters streamed to watched turns
    received: tuple[int, int] = (0, 0)  # and received by their SSE clients
    retracts: int = 0
    tokens: int = 0  # every token streamed while the CPU was metered
    cpu: CpuMeter | None = None
    before: dict[str, Stored] = field(default_factory=dict)
    after: dict[str, Stored] = field(default_factory=dict)

    @property
    def label(self) -> str:
        workers = f"{self.workers} loop worker{'s' if self.workers > 1 else ''}"
        return f"{self.servers}, {workers}, {self.load}"

    @property
    def over_s(self) -> list[float]:
        """Each turn's latency over the model's own time."""
        return [lat - m for lat, m in zip(self.latency_s, self.model_s, strict=True)]

    @property
    def stalls(self) -> int:
        return sum(1 for o in self.over_s if o > STALL_S)

    @property
    def turns_per_s(self) -> float:
        return self.turns / self.wall_s if self.wall_s else 0.0

    @property
    def busy(self) -> float:
        """The share of the machine's cores busy while the CPU was metered."""
        if self.cpu is None or not self.cpu.wall:
            return math.nan
        return sum(self.cpu.spent.values()) / self.cpu.wall / (os.cpu_count() or 1)

    def cpu_s(self, *names: str) -> float:
        """CPU seconds of the processes whose names start with one of ``names``."""
        assert self.cpu is not None
        return sum(s for n, s in self.cpu.spent.items() if n.startswith(names))

    def stored_per_turn(self) -> dict[str, tuple[float, float, float]]:
        """Per stream that changed: messages written, messages kept, bytes kept, per turn."""
        out = {}
        for name, after in sorted(self.after.items()):
            b = self.before.get(name, Stored(0, 0, 0))
            delta = [after[i] - b[i] for i in range(3)]
            if any(delta):
                out[name] = (delta[0] / self.turns, delta[1] / self.turns, delta[2] / self.turns)
        return out

    def summary(self) -> dict[str, Any]:
        """The figures of the table (and of ``--json``)."""
        over, stored = self.over_s, self.stored_per_turn()
        events = sum(stored.get(name, (0.0, 0.0, 0.0))[0] for name in S.events_streams)
        streaming = sum(self.model_s) / self.turns if self.turns else 0.0
        return {
            "servers": self.servers, "workers": self.workers, "load": self.load,
            "sessions": self.sessions, "turns": self.turns, "turns_per_s": self.turns_per_s,
            "over_ms": [pct(over, q) * 1000 for q in (0.5, 0.99, 1.0)],
            "stalls": self.stalls,
            "token_ms": [pct(self.token_ms, q) for q in (0.5, 0.99)],
            "tokens_sent_received": [self.sent[0], self.received[0]],
            "text_equal": self.sent == self.received,
            "watched": self.watched, "retracts": self.retracts,
            "reasons": dict(self.reasons),
            "cpu_ms_per_turn_by_process": {
                n: s / self.turns * 1000 for n, s in self.cpu.spent.items()
            } if self.cpu and self.turns else {},
            "machine_busy": self.busy,
            "cpu_us_per_token_workers_nats": (
                self.cpu_s("loop worker", "nats-server") / self.tokens * 1e6 if self.tokens else 0
            ),
            "cpu_ms_per_turn": self.cpu_s(*LOOPMESH) / self.turns * 1000 if self.turns else 0,
            "events_per_turn": events,
            "events_per_streaming_s": events / streaming if streaming else 0,
            "messages_per_turn": sum(w for w, _, _ in stored.values()),
            "kb_per_turn": sum(b for _, _, b in stored.values()) / 1000,
        }  # fmt: skip


def histogram(values: Sequence[float], width: int = 50) -> list[str]:
    """One line per bin of ``BIN_S`` seconds that has values: its range, its count, a
    bar (a bin of one value gets a bar too)."""
    if not values:
        return []
    bins = Counter(max(0, math.floor(v / BIN_S)) for v in values)
    top = max(bins.values())
    return [
        f"  {b * BIN_S:5.1f}-{(b + 1) * BIN_S:4.1f} s {n:7d} {'#' * -(-width * n // top)}"
        for b, n in sorted(bins.items())
    ]


def slowest(over: Sequence[float], n: int = 5) -> str:
    """The ``n`` largest of ``over``, in seconds: an AckWait stall shows as about 30."""
    return ", ".join(f"{o:.1f}" for o in sorted(over, reverse=True)[:n]) + " s"


def report(r: Result, pace: str) -> str:
    """The block printed for one configuration."""
    over = r.over_s
    lines = [
        f"\n== {r.label}: {r.sessions} sessions of {r.per_session} turns, {r.turns} turns ==",
        f"turns/s {r.turns_per_s:29.1f}   ({r.turns} turns in {r.wall_s:.1f} s)",
        f"the model's time per turn {r.nominal_s:11.3f} s nominal ({pace}); as streamed "
        f"p50 {pct(r.model_s, 0.5):.3f} s, max {pct(r.model_s, 1.0):.3f} s",
        "turn latency over the model's time (the latency minus the time the fake LLM took "
        "to stream that turn's replies):",
        f"  p50 {pct(over, 0.5) * 1000:8.1f} ms   p99 {pct(over, 0.99) * 1000:8.1f} ms   "
        f"max {pct(over, 1.0) * 1000:8.1f} ms",
        f"stalls (over {STALL_S:g} s more than the model's time): {r.stalls}"
        + (f" (the slowest over it by {slowest(over)})" if r.stalls else ""),
        f"turns by latency over the model's time ({BIN_S * 1000:g} ms bins; a wait on a "
        "timer shows as a cluster of its own at the timer's period):",
        *histogram(over),
    ]
    if set(r.reasons) != {"task_completion"}:
        lines.append(f"loop_end reasons: {dict(r.reasons)} (every turn should end by completion)")
    text = "identical text" if r.sent == r.received else "TEXT DIFFERS"
    lines += [
        f"added latency per token (model emits -> an SSE client of the gateway receives), "
        f"{r.watched} sessions watched (each session of the first {r.watching} clients):",
        f"  p50 {pct(r.token_ms, 0.5):8.1f} ms   p99 {pct(r.token_ms, 0.99):8.1f} ms   "
        f"max {pct(r.token_ms, 1.0):8.1f} ms   ({r.received[0]} tokens received of "
        f"{r.sent[0]} sent, {text}; {r.retracts} retracts)",
    ]
    lines += cpu_lines(r)
    lines.append("stored per turn (messages written, messages kept, bytes kept):")
    for name, (written, kept, size) in r.stored_per_turn().items():
        lines.append(f"  {name:28s} {written:8.2f} {kept:8.2f} {size:10.0f}")
    s = r.summary()
    lines.append(
        f"  events stored per streaming second per session: {s['events_per_streaming_s']:.1f}"
    )
    return "\n".join(lines)


def cpu_lines(r: Result) -> list[str]:
    assert r.cpu is not None
    meter = r.cpu
    lines = [
        f"CPU over {meter.wall:.1f} s ({r.tokens} tokens streamed): ms per turn, µs per "
        f"streamed token, share of one core; the machine's {os.cpu_count()} cores were "
        f"{r.busy:.0%} busy" + (" (CPU-bound: latencies are the cores')" if r.busy > 0.9 else "")
    ]
    for name, spent in meter.spent.items():
        per_token = spent / r.tokens * 1e6 if r.tokens else math.nan
        lines.append(
            f"  {name:30s} {spent / max(1, r.turns) * 1000:8.3f} {per_token:8.1f} "
            f"{spent / meter.wall:6.0%}"
        )
    both, mesh = r.cpu_s("loop worker", "nats-server"), r.cpu_s(*LOOPMESH)
    if r.tokens and r.turns:
        lines.append(
            f"  loop workers + nats-server: {both / r.tokens * 1e6:.1f} µs per streamed token; "
            f"loopmesh (those, the tool worker and the gateway): "
            f"{mesh / r.turns * 1000:.2f} ms per turn"
        )
    return lines


def table(results: Sequence[Result]) -> str:
    """One markdown row per configuration."""
    head = (
        "| servers | loop workers | load | turns/s | over the model's time p50 / p99 / max ms "
        "| stalls | added latency per token p50 / p99 ms | loop workers + nats-server CPU "
        "µs per token | loopmesh CPU ms per turn | events per turn | messages written per turn | "
        "KB kept per turn |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- "
        "| --- |"
    )
    rows = [head]
    for r in results:
        s = r.summary()
        over = " / ".join(f"{v:.0f}" for v in s["over_ms"])
        tok = " / ".join(f"{v:.1f}" for v in s["token_ms"])
        rows.append(
            f"| {r.servers} | {r.workers} | {r.load} | {s['turns_per_s']:.1f} | {over} | "
            f"{s['stalls']} | {tok} | {s['cpu_us_per_token_workers_nats']:.0f} | "
            f"{s['cpu_ms_per_turn']:.1f} | {s['events_per_turn']:.1f} | "
            f"{s['messages_per_turn']:.1f} | {s['kb_per_turn']:.1f} |"
        )
    return "\n".join(rows)


def chart(summaries: Sequence[dict[str, Any]], path: Path) -> bool:
    """Turns/s and latencies per configuration (from :meth:`Result.summary`, as ``--json``
    writes them); False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    labels = [f"{s['servers']} x{s['workers']}\n{s['load']}" for s in summaries]
    x = range(len(summaries))
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5))
    a.bar(list(x), [s["turns_per_s"] for s in summaries], color="tab:blue")
    a.set_xticks(list(x), labels)
    a.set_ylabel("turns/s")
    a.set_title("throughput")
    width = 0.27
    b.bar([i - width for i in x], [s["over_ms"][0] for s in summaries], width, label="turn p50")
    b.bar(list(x), [s["over_ms"][1] for s in summaries], width, label="turn p99")
    b.bar([i + width for i in x], [s["token_ms"][1] for s in summaries], width, label="token p99")
    b.set_xticks(list(x), labels)
    b.set_yscale("log")
    b.set_ylabel("ms: a turn over the model's time, a token added")
    b.set_title("latency")
    b.legend(fontsize=8)
    for axis in (a, b):
        axis.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return True
