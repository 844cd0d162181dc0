"""A newcomer's session, typed from README.md: every command of its ```sh blocks, in the
README's order, as real processes with the venv's commands first on ``PATH`` (as after
``source .venv/bin/activate``), against one ``loopmesh up`` and the fake
OpenAI-compatible LLM (set up with the ``LOOPMESH_LLM__*`` variables, as the README says
for a real one). The project is a folder of its own holding the README's
``myproject/tools.py``.

Only what a test machine forces is changed: ``up`` gets ``--port -1 --monitor-port -1``
and ``LOOPMESH_GATEWAY__PORT=0`` (ports other tests may hold), the commands get
``LOOPMESH_NATS__URL`` as ``up`` tells them to, ``8080`` becomes the gateway's port, and
``examples/mcp_call.py`` gets ``--url`` for the same reason. A line of a block that this
test does not know fails it: a new command in the README needs its check here."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shlex
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from nats.aio.msg import Msg

from loopmesh.testing.durable import ROOT, START_S, connect_fast, stream_events, wait_for
from loopmesh.testing.fake_llm import FakeLLM
from loopmesh.testing.fake_replies import ToolCalls, auto, tool_calls
from schemas import Subjects, ToolSpec, catalog_key, decode
from tests.e2e.test_up_run import llm_env, stop_and_check_nothing_left

pytestmark = pytest.mark.slow

README = ROOT / "README.md"
#: How long one command of the tour may take, loaded machine included.
COMMAND_S = 120.0
#: A gateway address as the README writes it.
GATEWAY = re.compile(r"\b(?:localhost|127\.0\.0\.1):8080\b")
#: What the scripted model computes for each question the README asks it.
SUMS = {
    "What is 17 * 23? Use the calculator tool.": "17 * 23",
    "And divided by 3?": "391 / 3",
    "What is 17 * 23?": "17 * 23",
}


def readme_blocks() -> list[tuple[str, str]]:
    """The README's ```sh and ```python blocks, in order: (language, text)."""
    return re.findall(r"^```(sh|python)\n(.*?)^```", README.read_text(), re.DOTALL | re.MULTILINE)


def commands(block: str) -> list[str]:
    """The commands of a ```sh block: continuation lines joined, blank lines left out."""
    return [line for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def words(line: str) -> list[str]:
    """A README command as its words, without its comment or a trailing ``&``."""
    found = shlex.split(line, comments=True)
    return found[:-1] if found and found[-1] == "&" else found


def calculator(expression: str) -> ToolCalls:
    """The model's reply: call the calculator (``auto`` then completes with its result)."""
    return tool_calls(("local__calculator", {"expression": expression}))


class Typed:
    """A command as a person types it at a shell: ``bash -c`` in ``cwd``, in its own
    process group (stopped as a whole), its output collected line by line."""

    def __init__(self, argv: list[str], cwd: Path, env: dict[str, str]) -> None:
        self.command = shlex.join(argv)
        self.cwd, self.env = cwd, env
        self.lines: list[str] = []
        self.proc: asyncio.subprocess.Process | None = None
        self._changed = asyncio.Condition()
        self._reader: asyncio.Task[None] | None = None

    async def start(self) -> Typed:
        self.proc = await asyncio.create_subprocess_exec(
            "bash", "-c", self.command, cwd=self.cwd, env=self.env,
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        self._reader = asyncio.create_task(self._read())
        return self

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        async for raw in self.proc.stdout:
            async with self._changed:
                self.lines.append(raw.decode(errors="replace").rstrip("\r\n"))
                self._changed.notify_all()
        async with self._changed:
            self._changed.notify_all()

    @property
    def running(self) -> bool:
        """Its output is still open (a process that ended has closed it)."""
        return self._reader is not None and not self._reader.done()

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    async def until(self, done: Callable[[list[str]], bool], timeout: float = COMMAND_S) -> None:
        """Wait until ``done(lines)``; fail with the output if the command ends first."""

        def ended() -> bool:
            return self._reader is not None and self._reader.done()

        try:
            async with asyncio.timeout(timeout), self._changed:
                await self._changed.wait_for(lambda: done(self.lines) or ended())
        except TimeoutError:
            message = f"`{self.command}`: not there in {timeout}s:\n{self.output}"
            raise AssertionError(message) from None
        assert done(self.lines), f"`{self.command}` ended:\n{self.output}"

    async def finish(self, timeout: float = COMMAND_S) -> int:
        assert self.proc is not None and self._reader is not None
        async with asyncio.timeout(timeout):
            code = await self.proc.wait()
            await self._reader
        return code

    async def close(self) -> None:
        """Stop the command and whatever it started (SIGTERM, then SIGKILL)."""
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), 20)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
        if self.proc is not None:
            await self.proc.wait()
        if self._reader is not None:
            await self._reader


class Newcomer:
    """The person at the terminal: a project folder, the loopmesh checkout, a shell."""

    def __init__(self, project: Path, llm: FakeLLM) -> None:
        self.project, self.llm = project, llm
        venv_bin = str(Path(sys.executable).parent)
        clean = {k: v for k, v in os.environ.items() if not k.startswith("LOOPMESH_")}
        self.env = {
            **clean,
            "PATH": f"{venv_bin}{os.pathsep}{clean.get('PATH', '')}",
            "PYTHONPATH": str(ROOT),  # what the editable install gives, for this checkout
            "PYTHONUNBUFFERED": "1",
            **llm_env(llm),
        }
        self.gateway = ""  # host:port, once up says it
        self.posted = ""  # the turn POSTed over HTTP
        self.background: list[Typed] = []

    def words(self, line: str) -> list[str]:
        """A README command as typed here: its words, 8080 made the gateway's port."""
        return [GATEWAY.sub(self.gateway, w) for w in words(line)]

    def typed(self, argv: list[str]) -> Typed:
        # the examples are in the checkout; the rest is typed in the project folder
        where = ROOT if argv[1:2] and argv[1].startswith("examples/") else self.project
        return Typed(argv, where, self.env)

    async def run(self, argv: list[str]) -> tuple[int, str]:
        """Type a command and wait for it to end: its exit code and output."""
        typed = await self.typed(argv).start()
        try:
            return await typed.finish(), typed.output
        finally:
            await typed.close()

    async def close(self) -> None:
        for typed in self.background:
            await typed.close()


async def test_a_newcomer_types_the_readme_tour_and_every_command_does_what_it_says(
    tmp_path: Path,
):
    project = tmp_path / "project"
    blocks = readme_blocks()
    tools_py = next(text for lang, text in blocks if text.startswith("# myproject/tools.py"))
    (project / "myproject").mkdir(parents=True)
    (project / "myproject" / "tools.py").write_text(tools_py)
    up_line = next(
        words(line)
        for lang, text in blocks
        if lang == "sh"
        for line in commands(text)
        if words(line)[:2] == ["loopmesh", "up"]
    )
    async with FakeLLM(default=auto()) as llm:
        me = Newcomer(project, llm)
        # "With `make run` (or `loopmesh up`) running in one terminal": the README's
        # `up` with the project's tools, started once for the whole session
        up = me.typed([*up_line, "--port", "-1", "--monitor-port", "-1"])
        up.env = {**me.env, "LOOPMESH_GATEWAY__PORT": "0"}
        await up.start()
        try:
            await up.until(lambda lines: any("loop worker ready" in x for x in lines), START_S)
            nats_url = re.search(r"set LOOPMESH_NATS__URL=(\S+)", up.output).group(1)  # type: ignore[union-attr]
            web = re.search(r"web view  http://(\S+)/", up.output)
            assert web is not None, up.output
            me.gateway = web.group(1)
            me.env["LOOPMESH_NATS__URL"] = nats_url
            for lang, text in blocks:
                if lang == "python":
                    if "from loopmesh import Client" in text:
                        await the_python_client(me, text, nats_url)
                    continue
                for line in commands(text):
                    await tour_step(me, me.words(line), line, nats_url)
            await pause_and_resume(me, nats_url)
            await every_command_of_the_table_exists(me)
        finally:
            await me.close()
            if up.running:
                await stop_and_check_nothing_left(up)  # type: ignore[arg-type]
            else:
                await up.close()


async def tour_step(me: Newcomer, argv: list[str], line: str, nats_url: str) -> None:
    """One README command, typed, and what the README says it does."""
    match argv:
        case ["make", *_]:
            return  # `make run` is this `up` with the demo model (tests/e2e/test_up_run.py)
        case ["loopmesh", "up", *_]:
            return  # running since the start
        case ["loopmesh", "run", "--session", session, question]:
            me.llm.script(calculator(SUMS[question]))
            code, out = await me.run(argv)
            assert code == 0, out
            assert f"session {session}" in out and "→ local.calculator" in out, out
            assert "✔ task_completion" in out, out
            if question == "And divided by 3?":  # the same conversation: the model saw both
                asked = [str(r["messages"]) for r in me.llm.requests if question in str(r)]
                assert asked and "What is 17 * 23?" in asked[0], asked
                assert "130.333" in out, out
            else:
                assert "391" in out, out
        case ["loopmesh", "events", "--session", session, "--follow"]:
            follow = await me.typed(argv).start()
            try:  # every event of the session: both turns, to their ends; then it waits
                await follow.until(lambda lines: sum("✔ task_completion" in x for x in lines) >= 2)
                assert "391" in follow.output and "130.333" in follow.output, follow.output
                assert follow.proc is not None and follow.proc.returncode is None
            finally:
                await follow.close()
        case ["curl", "-s", "-X", "POST", url, *_]:
            code, out = await me.run(argv)
            assert code == 0, out
            posted = json.loads(out)  # 202 with the events URL
            assert posted["session"] == url.split("/")[-2] and posted["turn_id"], posted
            assert posted["events_url"].startswith(f"/v1/sessions/{posted['session']}/events")
            me.posted = posted["turn_id"]
        case ["curl", "-sN", url]:
            sse = await me.typed(argv).start()
            turn = me.posted
            try:  # the turn just posted, from its first event to its loop_end
                await sse.until(lambda lines: ended_in_sse(lines, turn))
                kinds = [k for k, data in sse_events(sse.lines) if turn in data]
                assert kinds[0] == "turn_accepted" and kinds[-1] == "loop_end", kinds
            finally:
                await sse.close()
        case ["loopmesh", "tools"]:
            code, out = await me.run(argv)
            assert code == 0, out
            row = next((x for x in out.splitlines() if x.startswith("local.word_count ")), "")
            assert "default" in row and "Count the words of a text." in row, out
        case ["loopmesh", "tool-worker", "--pool", pool, "--module", module]:
            await a_pool_of_its_own(me, argv, pool, module, nats_url)
        case ["loopmesh", "loop-worker"]:
            worker = await me.typed(argv).start()
            me.background.append(worker)
            await worker.until(lambda lines: any("loop worker ready" in x for x in lines))
        case ["loopmesh", "agents"]:
            code, out = await me.run(argv)
            assert code == 0, out
            assert re.search(r"^default\s", out, re.MULTILINE), out
        case ["python", "examples/nats_agent.py" | "examples/mcp_call.py" as example, *rest]:
            _agent, question = rest
            if example.endswith("mcp_call.py"):
                argv = [*argv, "--url", f"http://{me.gateway}/mcp"]
            me.llm.script(calculator(SUMS[question]))
            code, out = await me.run(argv)
            assert code == 0, out
            assert "done: 391" in out, out  # the agent's answer, with the tool's result
        case ["python", "examples/a2a_client.py", "--url", url, _]:
            assert url.startswith(f"http://{me.gateway}/a2a/"), url
            code, out = await me.run(argv)
            assert code == 0, out
            assert out.splitlines()[-1] == "[TASK_STATE_COMPLETED]", out
        case ["loopmesh", "schedules", "add", _, "--cron", cron, "--timezone", zone]:
            code, out = await me.run(argv)
            assert code == 0, out
            assert cron in out and zone in out, out
        case ["loopmesh", "schedules"]:
            code, out = await me.run(argv)
            assert code == 0, out
            rows = out.splitlines()[1:]
            assert len(rows) == 1 and "0 9 * * 1-5" in rows[0] and "Europe/Paris" in rows[0], out
        case _:
            pytest.fail(f"a README command this test does not check: {line!r}")


def sse_events(lines: list[str]) -> list[tuple[str, str]]:
    """The (event, data) pairs of an SSE stream's complete frames."""
    found, kind, data = [], "", ""
    for line in lines:
        if line.startswith("event: "):
            kind = line.removeprefix("event: ")
        elif line.startswith("data: "):
            data = line.removeprefix("data: ")
        elif not line and kind:
            found.append((kind, data))
            kind, data = "", ""
    return found


def ended_in_sse(lines: list[str], turn: str) -> bool:
    return any(k == "loop_end" and turn in data for k, data in sse_events(lines))


async def a_pool_of_its_own(
    me: Newcomer, argv: list[str], pool: str, module: str, nats_url: str
) -> None:
    """``loopmesh tool-worker --pool P --module M &``: the worker serves M's tools in
    pool P; its first put of each to the catalog says so. (``up`` serves the same module
    in pool default, so the catalog's entry is whichever pool put it last: the first put
    is what shows the worker serving it.)"""
    nc = await connect_fast(nats_url)
    puts: list[ToolSpec] = []
    subject = f"$KV.{Subjects().catalog_bucket}.{catalog_key('local', 'word_count')}"

    async def put(msg: Msg) -> None:
        puts.append(decode(msg.data, ToolSpec))

    try:
        sub = await nc.subscribe(subject, cb=put)
        await nc.flush()
        worker = await me.typed(argv).start()
        me.background.append(worker)
        await worker.until(lambda lines: any(f"serving pool={pool}" in x for x in lines))
        served = next(x for x in worker.lines if f"serving pool={pool}" in x)
        assert "tools=0" not in served, f"{module} served no tools in pool {pool}:\n{served}"
        await wait_for(lambda: any(s.pool == pool for s in puts), what=f"{pool} in the catalog")
        await sub.unsubscribe()
    finally:
        await nc.close()


async def the_python_client(me: Newcomer, snippet: str, nats_url: str) -> None:
    """The README's client snippet, saved as a file and run by the venv's python."""
    shown = 'nats_url="nats://127.0.0.1:4222"'
    assert shown in snippet
    script = me.project / "client_snippet.py"
    script.write_text(snippet.replace(shown, f'nats_url="{nats_url}"'))
    code, out = await me.run(["python", script.name])
    assert code == 0, out
    printed = out.splitlines()
    assert printed[:2] == ["turn_accepted", "loop_start"] and printed[-1] == "loop_end", out


async def pause_and_resume(me: Newcomer, nats_url: str) -> None:
    """The Commands table's ``loopmesh pause`` / ``resume``: a running turn is held at
    its next step (a ``paused`` event), then goes on to its end (``resumed``)."""
    session = "s3"
    # a slow reply: the turn runs while the pause is typed
    me.llm.script(
        tool_calls(
            ("local__calculator", {"expression": "2 + 2"}),
            content="thinking " * 40,
            chunk_size=9,
            delay_s=0.5,
        )
    )
    turn = await me.typed(["loopmesh", "run", "--session", session, "Take your time"]).start()
    me.background.append(turn)
    before = len(me.llm.requests)
    await wait_for(lambda: len(me.llm.requests) > before, timeout=COMMAND_S, what="the LLM call")
    code, out = await me.run(["loopmesh", "pause", "--session", session])
    assert code == 0, out
    nc = await connect_fast(nats_url)
    try:

        async def stored(kind: str) -> bool:
            return kind in [e.type for e, _ in await stream_events(nc, "local", session)]

        await wait_for(lambda: stored("paused"), timeout=COMMAND_S, what="the paused event")
        assert turn.proc is not None and turn.proc.returncode is None, turn.output
        code, out = await me.run(["loopmesh", "resume", "--session", session])
        assert code == 0, out
        assert await turn.finish() == 0, turn.output
        kinds = [e.type for e, _ in await stream_events(nc, "local", session)]
        assert kinds.index("paused") < kinds.index("resumed") < kinds.index("loop_end"), kinds
    finally:
        await nc.close()
    assert "✔ task_completion" in turn.output, turn.output


async def every_command_of_the_table_exists(me: Newcomer) -> None:
    """Each command the README's Commands table names is one ``loopmesh --help`` lists."""
    table = README.read_text().split("## Commands", 1)[1].split("\n\n", 2)[1]
    named = set()
    for row in table.splitlines()[2:]:
        first = row.split("|")[1]
        spans = re.findall(r"`([^`]+)`", first)
        named |= {s.split()[1] if s.startswith("loopmesh ") else s.split()[0] for s in spans}
    named -= {"--help"}
    code, out = await me.run(["loopmesh", "--help"])
    assert code == 0, out
    listed = set(re.findall(r"^    (\S+)", out, re.MULTILINE))
    assert named <= listed, sorted(named - listed)
    assert {"pause", "resume", "run", "events", "schedules"} <= named, named
