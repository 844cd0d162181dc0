"""The client's types reach its users: mypy ``--strict`` on a user's script, run from
outside the repository, so ``loopmesh`` and ``schemas`` are found as installed packages
(typed only by their ``py.typed``). A clean script passes, and a wrong one fails where
it is wrong: the types are real, not ``Any``."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

GOOD = """
import contextlib

from loopmesh import Client
from loopmesh.client import ClientError, SessionEvent, Submitted, TurnRefused
from schemas import AgentSpec
from schemas.events import Event, LoopEnd, ToolCallEvent


async def main() -> int:
    async with Client(gateway="http://127.0.0.1:8080", api_key="key") as client:
        submitted: Submitted = await client.submit("hi", session="s1", on_busy="reject")
        try:
            async for event in client.run("What is 17 * 23?", session="s1", max_iterations=5):
                if isinstance(event, ToolCallEvent):
                    print(event.tool, event.arguments)
                elif isinstance(event, LoopEnd):
                    print(event.reason, event.content)
        except TurnRefused as refused:
            code: str = refused.code
            field: str | None = refused.field
            print(code, field, refused.event)
        async with contextlib.aclosing(client.events(submitted.session, since=0)) as items:
            async for item in items:
                seq: int = item.seq
                happened: Event = item.event
                print(seq, happened.type)
                break
        await client.approve("s1", "call1", reason="fine")
        await client.deny("s1", "call1")
        await client.cancel("s1", reason="enough")
        agents: list[AgentSpec] = await client.agents()
        print([a.name for a in agents])
    nats = Client(nats_url="nats://127.0.0.1:4222", tenant="acme", creds_file=None)
    try:
        last: SessionEvent | None = None
        async for item in nats.events("s1", since=last.seq if last else 0):
            last = item
    except ClientError as exc:
        print(exc.status, exc)
    finally:
        await nats.close()
    return 0
"""

BAD = """
from loopmesh import Client


async def main(client: Client) -> None:
    async for event in client.run(42):
        pass
    async for event in client.run("hi", on_busy="sometimes"):
        event.no_such_field
    async for item in client.events("s1"):
        item.seq.upper()
    await client.approve("s1")
"""


async def mypy(path: Path) -> tuple[int, str]:
    (path.parent / "mypy.ini").write_text("[mypy]\n")  # none of the project's settings
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "mypy", "--strict", "--config-file", "mypy.ini",
        "--cache-dir", str(path.parent / ".mypy_cache"), path.name,
        cwd=path.parent, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(proc.communicate(), 300)
    return proc.returncode or 0, out.decode()


async def test_a_users_script_passes_mypy_strict_and_a_wrong_one_fails_where_it_is_wrong(
    tmp_path: Path,
):
    good = tmp_path / "good" / "user.py"
    good.parent.mkdir()
    good.write_text(GOOD)
    code, out = await mypy(good)
    assert code == 0, out
    bad = tmp_path / "bad" / "user.py"
    bad.parent.mkdir()
    bad.write_text(BAD)
    code, out = await mypy(bad)
    assert code == 1, out
    wrong = {int(line.split(":")[1]) for line in out.splitlines() if ": error:" in line}
    assert wrong == {6, 8, 9, 11, 12}, out
