"""Traces: one turn's spans, from three service processes, share the caller's trace id,
link parent to child and carry the GenAI attributes; the trace goes on to the MCP
server in ``_meta``. Without ``OTEL_*`` nothing of the SDK is even imported."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest

from loopmesh.testing.durable import Proc, worker_env
from loopmesh.testing.fake_llm import FakeLLM
from loopmesh.testing.fake_replies import auto
from loopmesh.testing.otlp import OtlpReceiver, ReceivedSpan

from .test_dashboards import free_port, wait_ready

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
GATEWAY, LOOP, TOOL = "loopmesh-gateway", "loopmesh-loop-worker", "loopmesh-tool-worker"


def _otel_env(url: str) -> dict[str, str]:
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": url,
        "OTEL_BSP_SCHEDULE_DELAY": "100",  # the SDK's own batch delay: export within 0.1 s
    }


def _complete(spans: list[ReceivedSpan]) -> bool:
    names = {(s.service, s.name) for s in spans}
    return {
        (GATEWAY, "POST /v1/sessions/{session}/turns"),
        (LOOP, "invoke_agent"),
        (LOOP, "execute_tool traceparent"),
        (TOOL, "execute_tool traceparent"),
    } <= names and sum(s.name.startswith("chat ") for s in spans) >= 2


def one(spans: list[ReceivedSpan], service: str, name: str) -> ReceivedSpan:
    found = [s for s in spans if s.service == service and s.name == name]
    assert len(found) == 1, (service, name, found)
    return found[0]


@pytest.mark.slow
async def test_a_turns_spans_across_three_processes_share_the_callers_trace(nats_server):
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    ports = {name: free_port() for name in ("tool", "gateway")}
    mcp = [{"name": "trace", "command": sys.executable, "args": [str(HERE / "trace_mcp.py")]}]
    procs: list[Proc] = []
    with OtlpReceiver() as otlp:
        otel = _otel_env(otlp.url)
        nats_env = {"LOOPMESH_NATS__URL": nats_server.url, **otel}
        async with FakeLLM(default=auto()) as llm:
            try:
                services = [
                    (Proc("-m", "loopmesh", "tool-worker", env={
                        **nats_env, "LOOPMESH_TOOL_WORKER__METRICS_PORT": str(ports["tool"]),
                        "LOOPMESH_TOOL_WORKER__MCP_SERVERS": json.dumps(mcp)}),
                     f"http://127.0.0.1:{ports['tool']}/metrics"),
                    # a long AckWait: no redelivery (a second invoke_agent) on a slow machine
                    (Proc("-m", "loopmesh", "loop-worker", env={
                        **worker_env(nats_server.url, llm.base_url, ack_wait_s=30,
                                     lease_ttl_s=30), **otel}),
                     None),
                    (Proc("-m", "loopmesh", "gateway", env={
                        **nats_env, "LOOPMESH_GATEWAY__PORT": str(ports["gateway"]),
                        "LOOPMESH_GATEWAY__NO_AUTH": "true"}),
                     f"http://127.0.0.1:{ports['gateway']}/readyz"),
                ]  # fmt: skip
                for proc, ready in services:
                    procs.append(await proc.start())
                    if ready is not None:
                        await wait_ready(ready, proc)
                await procs[1].wait_line("loop worker ready", timeout=60)
                base = f"http://127.0.0.1:{ports['gateway']}"
                async with httpx.AsyncClient(base_url=base, timeout=30) as client:
                    await _wait_tool(client, "traceparent", procs)
                    posted = await client.post(
                        "/v1/sessions/s1/turns",
                        json={"input": "call traceparent {}"},
                        headers={"traceparent": f"00-{trace_id}-{parent_id}-01"},
                    )
                    assert posted.status_code == 202, posted.text
                    spans = await otlp.wait(_complete, timeout=90)
            finally:
                for proc in reversed(procs):
                    await proc.terminate()
                    await proc.close()
            tool_messages = [
                m for r in llm.requests for m in r["messages"] if m.get("role") == "tool"
            ]

    # Every span but the MCP session's own housekeeping (initialize, tools/list, ping:
    # the MCP SDK's spans, each its own trace) belongs to the caller's trace.
    turn = [s for s in spans if not s.name.startswith("MCP send") or "tools/call" in s.name]
    assert {s.service for s in turn} == {GATEWAY, LOOP, TOOL}
    assert all(s.trace_id == trace_id for s in turn), [(s.name, s.trace_id) for s in turn]

    gateway = one(spans, GATEWAY, "POST /v1/sessions/{session}/turns")
    assert (gateway.kind, gateway.parent_id) == ("server", parent_id)

    agent = one(spans, LOOP, "invoke_agent")
    assert agent.parent_id == gateway.span_id
    assert agent.attributes["gen_ai.operation.name"] == "invoke_agent"
    assert agent.attributes["gen_ai.request.model"] == "fake-model"
    assert agent.attributes["gen_ai.conversation.id"] == "local.s1"
    assert agent.attributes["loopmesh.turn.end_reason"] == "task_completion"

    chats = [s for s in spans if s.name == "chat fake-model"]
    assert len(chats) == 2 and {s.service for s in chats} == {LOOP}
    for chat in chats:
        assert (chat.kind, chat.parent_id) == ("client", agent.span_id)
        assert chat.attributes["gen_ai.operation.name"] == "chat"
        assert chat.attributes["gen_ai.request.model"] == "fake-model"
        assert chat.attributes["gen_ai.response.model"] == "fake-model"
        assert chat.attributes["gen_ai.usage.input_tokens"] > 0
        assert chat.attributes["gen_ai.usage.output_tokens"] > 0

    dispatch = one(spans, LOOP, "execute_tool traceparent")
    assert (dispatch.kind, dispatch.parent_id) == ("client", agent.span_id)
    execute = one(spans, TOOL, "execute_tool traceparent")
    assert (execute.kind, execute.parent_id) == ("server", dispatch.span_id)
    for span in (dispatch, execute):
        assert span.attributes["gen_ai.operation.name"] == "execute_tool"
        assert span.attributes["gen_ai.tool.name"] == "traceparent"
        assert span.attributes["gen_ai.tool.call.id"] == dispatch.attributes["gen_ai.tool.call.id"]
        assert span.status_code != 2  # not ERROR
    assert execute.attributes["loopmesh.tool.pool"] == "default"

    # The MCP SDK's client span is a child of the tool worker's, and the MCP server
    # received its traceparent in the request's `_meta`.
    mcp_send = one(spans, TOOL, "MCP send tools/call traceparent")
    assert mcp_send.parent_id == execute.span_id
    assert [m["content"] for m in tool_messages] == [f"00-{trace_id}-{mcp_send.span_id}-01"]


async def _wait_tool(client: httpx.AsyncClient, name: str, procs: list[Proc]) -> None:
    """Until the gateway's catalog lists ``name`` (the MCP server has listed its tools)."""
    import asyncio

    async with asyncio.timeout(60):
        while name not in (await client.get("/v1/tools")).text:
            for proc in procs:
                if proc.proc is not None and proc.proc.returncode is not None:
                    raise AssertionError(f"a service ended:\n{proc.output()}")
            await asyncio.sleep(0.1)


def test_without_otel_variables_no_sdk_is_imported_and_no_provider_installed():
    """In a fresh process with no OTEL_* variable: the CLI's set-up, a turn's, a chat's
    and a tool call's span helpers, and the gateway's forwarding run, and afterwards
    the SDK (and so any exporter) was never imported and the global provider is the
    API's placeholder."""
    script = textwrap.dedent(
        """
        import sys
        from opentelemetry import trace
        from loopmesh import tracing
        import gateway.app, loop_worker.service, tool_worker.service
        from loop_worker import traces
        from schemas import Turn, ToolCallRequest

        stop = tracing.setup("loopmesh-test")
        assert not tracing.enabled()
        turn = Turn(id="t1", tenant="a", session="s", input="hi")
        with traces.turn_span(turn, {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"},
                              "m", 1) as span:
            assert span is None
        request = ToolCallRequest(call_id="c", tenant="a", session="s", turn_id="t1",
                                  server="local", tool="echo")
        with traces.tool_span(request) as span:
            assert span is None
        llm = object()
        assert traces.traced_llm(llm, "m") is llm
        headers = {}
        tracing.inject(headers)
        assert headers == {}
        assert tracing.current() is None
        stop()
        assert not any(m.startswith("opentelemetry.sdk") for m in sys.modules), sorted(
            m for m in sys.modules if m.startswith("opentelemetry"))
        assert not any(m.startswith("opentelemetry.exporter") for m in sys.modules)
        assert type(trace.get_tracer_provider()).__name__ == "ProxyTracerProvider"
        print("ok")
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("header", [True, False], ids=["traceparent", "no-traceparent"])
async def test_a_turn_resumed_after_a_crash_continues_its_trace(nats_server, header):
    """A turn published by any NATS client, with a `traceparent` header or without one
    (as `loopmesh run` publishes); its worker is killed mid-turn; the worker that resumes
    it runs it in the same trace: the caller's, which the redelivered message carries,
    or else the one derived from the turn's id."""
    from loopmesh.testing.durable import SUBJECTS, connect_fast, provision_short
    from loopmesh.testing.fake_replies import hang
    from loopmesh.tracing import root_trace_id
    from schemas import Turn, encode

    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    if not header:
        trace_id, parent_id = f"{root_trace_id('loopmesh-turn:acme.s1:t1'):032x}", ""
    nc = await connect_fast(nats_server.url)
    await provision_short(nc)
    procs: list[Proc] = []
    with OtlpReceiver() as otlp:
        async with FakeLLM(hang(60), default=auto()) as llm:
            try:

                async def worker(name: str) -> Proc:
                    env = {**worker_env(nats_server.url, llm.base_url, name=name),
                           **_otel_env(otlp.url)}  # fmt: skip
                    procs.append(proc := Proc("-m", "loop_worker", env=env))
                    return await proc.start("loop worker ready", timeout=60)

                first = await worker("w1")
                turn = Turn(id="t1", tenant="acme", session="s1", input="hello")
                await nc.jetstream().publish(
                    SUBJECTS.turn("acme", "s1"),
                    encode(turn),
                    headers={"Nats-Msg-Id": turn.msg_id}
                    | ({"traceparent": f"00-{trace_id}-{parent_id}-01"} if header else {}),
                )
                await llm.wait_requests(1, timeout=60)  # the first worker's model call hangs
                first.kill()
                await worker("w2")

                def resumed(spans: list[ReceivedSpan]) -> bool:
                    return any(
                        s.name == "invoke_agent" and "loopmesh.turn.end_reason" in s.attributes
                        for s in spans
                    )

                spans = await otlp.wait(resumed, timeout=90)
            finally:
                for proc in reversed(procs):
                    await proc.close()
                await nc.close()
    agents = [s for s in spans if s.name == "invoke_agent"]
    assert all((a.trace_id, a.parent_id) == (trace_id, parent_id) for a in agents), agents
    ended = [a for a in agents if a.attributes.get("loopmesh.turn.end_reason")]
    assert len(ended) == 1, agents
    assert ended[0].attributes["loopmesh.turn.end_reason"] == "task_completion"
    assert ended[0].attributes["loopmesh.turn.delivery"] >= 2
