"""The README's Python client snippet runs as shown, over NATS and (with the client made
as its comment says) through the gateway: a real nats-server, loop and tool workers, the
fake OpenAI server, the real gateway."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from loopmesh.testing.durable import Proc
from tests.gateway.conftest import ACME_KEY, KEYS
from tests.loop_worker.durable import Mesh, gateway_on
from tests.loopmesh.commands.test_commands import TRANSPORTS, mesh

__all__ = ["mesh"]  # the fixture, shared

README = Path(__file__).resolve().parent.parent / "README.md"
SHOWN = 'Client(nats_url="nats://127.0.0.1:4222")'


def readme_snippet() -> str:
    section = README.read_text().split("## The Python client", 1)[1]
    block = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert block is not None and SHOWN in block.group(1)
    return block.group(1)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_the_readme_client_snippet_runs_a_turn_to_its_end(
    transport: str, mesh: Mesh, tmp_path: Path
):
    async with gateway_on(mesh.url, api_keys=KEYS) as gw:
        made = (
            f'Client(gateway="{gw.url}", api_key="{ACME_KEY}")'
            if transport == "gateway"
            else f'Client(nats_url="{mesh.url}")'
        )
        script = tmp_path / "snippet.py"
        script.write_text(readme_snippet().replace(SHOWN, made))
        proc = await Proc(str(script)).start()
        assert proc.proc is not None
        assert await asyncio.wait_for(proc.proc.wait(), 90) == 0, proc.output()
        await proc.close()
    assert proc.lines[:2] == ["turn_accepted", "loop_start"], proc.lines
    assert proc.lines[-1] == "loop_end" and "tool_call" in proc.lines
