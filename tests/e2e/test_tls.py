"""Every service on a nats-server that requires mutual TLS, as real processes:
`loopmesh up --nats-url tls://...` (the gateway, a loop worker and a tool worker), the
metrics exporter, and `loopmesh run` over NATS and through the gateway, with the
`LOOPMESH_NATS__TLS_*` variables a deployment sets."""

from __future__ import annotations

import asyncio
import re
import signal

import httpx
import pytest

from loopmesh.testing.durable import Proc, wait_for
from loopmesh.testing.fake_llm import FakeLLM
from loopmesh.testing.fake_replies import auto

from .test_up_run import llm_env, run

pytestmark = pytest.mark.slow

CALC = 'call calculator {"expression": "17 * 23"}'


async def test_a_turn_runs_end_to_end_over_mutual_tls(tmp_path, mtls_server, certs):
    tls = certs.env()
    async with FakeLLM(default=auto()) as llm:
        up = Proc(
            "-m", "loopmesh", "up", "--nats-url", mtls_server.url,
            env={"LOOPMESH_GATEWAY__PORT": "0", **llm_env(llm), **tls},
        )  # fmt: skip
        exporter = Proc(
            "-m", "loopmesh", "exporter", "--nats-url", mtls_server.url, "--metrics-port", "0",
            env={**tls, "LOOPMESH_EXPORTER__DURABLE": "tls-test"},  # up runs one of its own
        )  # fmt: skip
        try:
            await up.start("loop worker ready")
            gateway = re.search(r"gateway +(http://\S+)", await up.wait_line("gateway   ")).group(1)
            await exporter.start()
            metrics = (await exporter.wait_line("exporter  metrics at ")).split()[-1]

            code, out = await run(mtls_server.url, CALC, env=tls)  # straight to NATS
            assert code == 0, out
            assert "local.calculator" in out and "391" in out and "✔ task_completion" in out
            code, out = await run(mtls_server.url, CALC, "--gateway", gateway)
            assert code == 0, out  # through the gateway, which holds the TLS connection
            assert "391" in out

            async def counted() -> bool:
                async with httpx.AsyncClient() as http:
                    text = (await http.get(metrics)).text
                return 'loopmesh_turns_total{outcome="task_completion",tenant="local"} 2.0' in text

            await wait_for(counted, timeout=30, what="the exporter counting both turns")

            code, out = await run(mtls_server.url, CALC, env=certs.env(client_cert=False))
            assert code == 1, out  # the CLI without a client certificate: told what to set
            assert "requires a client certificate" in out and "LOOPMESH_NATS__TLS_CERT_FILE" in out
            assert "Traceback" not in out
        finally:
            for proc in (exporter, up):
                if proc.proc is not None and proc.proc.returncode is None:
                    proc.proc.send_signal(signal.SIGINT)
                    assert await asyncio.wait_for(proc.proc.wait(), 60) == 0, proc.output()
                await proc.close()
