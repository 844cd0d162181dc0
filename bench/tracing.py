"""What tracing costs: per-iteration time of the durable path with tracing off and on.

    python bench/tracing.py [--iterations 200] [--repeats 3]

The set-up of ``bench/distributed.py``'s first section (a zero-latency model in a real
loop-worker process, an echo tool in a tool-worker process, an embedded nats-server;
the time between consecutive ``loop_iteration`` events over three turns of
``--iterations`` echo calls each), run ``--repeats`` times with tracing off (no
``OTEL_*`` variable: the workers as they ship) and on (``OTEL_EXPORTER_OTLP_ENDPOINT``
pointing at an OTLP/HTTP receiver in this process, which decodes every export), the two
alternating, fresh workers each run. Each iteration then makes a ``chat`` span and two
``execute_tool`` spans (loop and tool worker). Prints the medians, the difference, the
spans received, and what the span helpers cost per call while off, measured in this
process.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import timeit
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.distributed import distributed_iteration, pct  # noqa: E402
from bench.harness import Ends, Mesh  # noqa: E402
from loopmesh.aio import run  # noqa: E402
from loopmesh.testing.otlp import OtlpReceiver  # noqa: E402


async def one_run(store: Path, iterations: int, env: dict[str, str]) -> list[float]:
    async with Mesh(store, ack_wait_s=30, lease_ttl_s=30, env=env) as mesh:
        tools = await mesh.tool_worker()
        worker = await mesh.instant_worker("i1", iterations)
        ends = Ends(mesh.nc)
        await ends.start()
        gaps = await distributed_iteration(mesh, ends, iterations)
        for proc in (worker, tools):  # a stop flushes the spans still buffered
            await proc.terminate()
        return gaps


def off_cost_ns() -> float:
    """ns per iteration of the span helpers while off: a turn's, a chat's (the LLM is
    not wrapped: nothing), a tool call's span and its header injection."""
    from loop_worker import traces
    from loopmesh import tracing
    from schemas import ToolCallRequest

    assert not tracing.enabled()
    request = ToolCallRequest(
        call_id="c", tenant="a", session="s", turn_id="t", server="local", tool="echo"
    )

    def iteration() -> None:
        with traces.tool_span(request):
            pass
        headers = {"Nats-Msg-Id": "c"}
        tracing.inject(headers)
        tracing.enabled()

    n = 200_000
    return min(timeit.repeat(iteration, number=n, repeat=5)) / n * 1e9


def call_ns() -> float:
    """ns of a call of an empty function, to read the figure above by."""

    def nothing() -> None:
        pass

    n = 1_000_000
    return min(timeit.repeat(nothing, number=n, repeat=5)) / n * 1e9


async def main(args: argparse.Namespace) -> None:
    off: list[float] = []
    on: list[float] = []
    with OtlpReceiver() as otlp, tempfile.TemporaryDirectory() as tmp:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": otlp.url}
        for k in range(args.repeats):
            off += await one_run(Path(tmp) / f"off{k}", args.iterations, {})
            on += await one_run(Path(tmp) / f"on{k}", args.iterations, env)
        spans = len(otlp.received())
    p50_off, p50_on = statistics.median(off), statistics.median(on)
    print(f"per-iteration time ({len(off)} iterations each; zero-latency LLM, echo tool)")
    print(f"  tracing off  p50 {p50_off:7.3f} ms   p95 {pct(off, 0.95):7.3f} ms")
    print(f"  tracing on   p50 {p50_on:7.3f} ms   p95 {pct(on, 0.95):7.3f} ms")
    print(f"  difference   p50 {p50_on - p50_off:+7.3f} ms   ({spans} spans received)")
    print(
        f"span helpers while off: {off_cost_ns():.0f} ns per iteration in this process "
        f"(an empty function call: {call_ns():.0f} ns)"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    run(main(parser.parse_args()))
