"""``loopmesh run``, ``events``, ``approve``, ``deny``, ``cancel``, ``pause``, ``resume``,
``fork`` and ``rewind`` as a person types them: real processes against a real
nats-server, a real loop worker and tool worker (the fake OpenAI server as the model),
and the real gateway for ``--gateway``."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from gateway.server import GatewayServer
from gateway.settings import GatewayConfig, GatewaySettings
from loopmesh.ports import free_port
from loopmesh.process import terminate
from loopmesh.server import NatsServer, find_binary
from loopmesh.settings import NatsSettings
from loopmesh.testing.durable import Proc
from tests.loop_worker.durable import Mesh, Watch, gateway_on, mesh_on

pytestmark = pytest.mark.slow

TRANSPORTS = ["nats", "gateway"]


@pytest.fixture
async def mesh(nats_server) -> AsyncIterator[Mesh]:
    async with mesh_on(nats_server.url, workers=True) as mesh:
        yield mesh


@pytest.fixture
async def gateway(mesh: Mesh) -> AsyncIterator[GatewayServer]:
    async with gateway_on(mesh.url, no_auth=True) as gw:
        yield gw


def via(transport: str, mesh: Mesh, gateway: GatewayServer) -> list[str]:
    if transport == "gateway":
        return ["--gateway", gateway.url]
    return ["--nats-url", mesh.url]


async def loopmesh(*args: str, timeout: float = 60) -> tuple[int, list[str]]:
    """Run ``loopmesh ARGS`` to its end; its exit code and output lines (stdout+stderr)."""
    proc = await Proc("-m", "loopmesh", *args).start()
    assert proc.proc is not None
    code = await asyncio.wait_for(proc.proc.wait(), timeout)
    await proc.close()
    return code, proc.lines


def count_task(path: Path) -> str:
    return f"call local__count {json.dumps({'path': str(path), 'label': 'a'})}"


def guarded_task(path: Path) -> str:
    return f"call local__guarded {json.dumps({'path': str(path), 'label': 'ok'})}"


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_run_prints_the_turn_and_its_answer_once_with_no_log_lines(
    transport: str, mesh: Mesh, gateway: GatewayServer, tmp_path: Path
):
    target = tmp_path / "n"
    code, lines = await loopmesh(
        "run", *via(transport, mesh, gateway), "--session", "s1", count_task(target)
    )
    assert code == 0, lines
    assert target.read_text() == "a\n"  # the tool ran, once
    out = "\n".join(lines)
    assert "── iteration 1 of 6" in out
    assert "→ local.count(" in out and "← local.count" in out
    assert "✔ task_completion after 2 iteration(s)" in out
    answers = [line for line in lines if "done: " in line]
    assert len(answers) == 1 and answers[0].startswith("  💬 done: "), lines  # printed once
    assert not [line for line in lines if "level=" in line], lines  # quiet by default
    where = "gateway http://" if transport == "gateway" else "NATS, tenant local"
    assert where in lines[0]
    assert not [line for line in lines if "continue this session" in line]  # it was given


async def test_run_without_a_session_says_how_to_continue_the_new_one(mesh: Mesh, tmp_path: Path):
    code, lines = await loopmesh("run", "--nats-url", mesh.url, count_task(tmp_path / "n"))
    assert code == 0, lines
    session = lines[0].split(" · ")[1].removeprefix("session ")
    assert lines[-1] == f"continue this session with --session {session}"
    code, lines = await loopmesh("events", "--nats-url", mesh.url, "--session", session)
    assert code == 0 and lines[-1] == "✔ task_completion after 2 iteration(s)", lines


async def test_run_shows_logs_on_request(mesh: Mesh, tmp_path: Path):
    code, lines = await loopmesh("run", "-v", "--nats-url", mesh.url, count_task(tmp_path / "n"))
    assert code == 0, lines
    assert any("level=info" in line and "nats connected" in line for line in lines), lines


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_events_prints_a_sessions_history_readably_and_as_json_lines_from_a_sequence(
    transport: str, mesh: Mesh, gateway: GatewayServer, tmp_path: Path
):
    code, _ = await loopmesh(
        "run", "--nats-url", mesh.url, "--session", "s1", count_task(tmp_path / "n")
    )
    assert code == 0
    remote = via(transport, mesh, gateway)

    code, lines = await loopmesh("events", *remote, "--session", "s1")
    assert code == 0, lines
    assert lines[0].startswith("▶ turn started on w1")
    assert lines[-1] == "✔ task_completion after 2 iteration(s)"

    code, lines = await loopmesh("events", *remote, "--session", "s1", "--json")
    assert code == 0, lines
    events = [json.loads(line) for line in lines]
    seqs = [e["seq"] for e in events]
    assert seqs == sorted(set(seqs))
    assert events[-1]["type"] == "loop_end" and events[0]["session"] == "s1"
    stored = [e for e, _ in await _stored(mesh)]
    assert [e["type"] for e in events] == [e.type for e in stored]

    middle = seqs[len(seqs) // 2]
    code, lines = await loopmesh(
        "events", *remote, "--session", "s1", "--json", "--since", str(middle)
    )
    assert code == 0, lines
    assert [json.loads(line)["seq"] for line in lines] == [s for s in seqs if s > middle]


async def _stored(mesh: Mesh) -> list:
    from loopmesh.testing.durable import stream_events

    return await stream_events(mesh.nc, "local", "s1")


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_events_of_an_unknown_session(transport: str, mesh: Mesh, gateway: GatewayServer):
    code, lines = await loopmesh("events", *via(transport, mesh, gateway), "--session", "nobody")
    if transport == "nats":
        assert (code, lines) == (0, [])  # nothing stored
    else:
        assert code == 1
        assert "loopmesh events: error: the gateway answered 404 not_found" in lines[-1]


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_events_follow_prints_new_turns_as_they_run(
    transport: str, mesh: Mesh, gateway: GatewayServer, tmp_path: Path
):
    await gateway_session(gateway, "s1")
    follower = await Proc(
        "-m", "loopmesh", "events", *via(transport, mesh, gateway), "--session", "s1", "--follow"
    ).start()
    try:
        # (no wait for the follower to subscribe: it starts from the session's first event)
        code, _ = await loopmesh(
            "run", "--nats-url", mesh.url, "--session", "s1", count_task(tmp_path / "n")
        )
        assert code == 0
        await follower.wait_line("✔ task_completion")
        code, _ = await loopmesh(
            "run", "--nats-url", mesh.url, "--session", "s1", count_task(tmp_path / "n")
        )
        assert code == 0
        await wait_count(follower, "✔ task_completion", 2)
        assert follower.proc is not None and follower.proc.returncode is None  # still following
    finally:
        await follower.close()


async def gateway_session(gateway: GatewayServer, session: str) -> None:
    import httpx

    async with httpx.AsyncClient(base_url=gateway.url) as c:
        r = await c.post("/v1/sessions", json={"session": session})
        assert r.status_code == 201, r.text


async def wait_count(proc: Proc, text: str, count: int, timeout: float = 30) -> None:
    async with asyncio.timeout(timeout), proc._changed:
        await proc._changed.wait_for(lambda: sum(text in line for line in proc.lines) >= count)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("command", ["approve", "deny"])
async def test_approve_and_deny_decide_a_waiting_tool_call(
    transport: str, command: str, mesh: Mesh, gateway: GatewayServer, tmp_path: Path
):
    target = tmp_path / "g"
    async with Watch(mesh.nc, tenant="local", session="s1") as watch:
        run = await Proc(
            "-m", "loopmesh", "run", "--nats-url", mesh.url, "--session", "s1", guarded_task(target)
        ).start()
        try:
            required = await watch.wait("approval_required", timeout=30)
            hint = await run.wait_line("needs approval")
            call_id = required.call_id  # type: ignore[attr-defined]
            assert f"loopmesh approve --session s1 {call_id}" in hint
            code, lines = await loopmesh(
                command, *via(transport, mesh, gateway), "--session", "s1", call_id,
                "--reason", "looked at it",
            )  # fmt: skip
            assert code == 0, lines
            assert lines == [
                f"{'approved' if command == 'approve' else 'denied'} call {call_id} in session s1"
            ]
            decided = await watch.wait("approval_decision", timeout=30)
            assert decided.approved is (command == "approve")  # type: ignore[attr-defined]
            assert decided.reason == "looked at it"  # type: ignore[attr-defined]
            await watch.wait("loop_end", timeout=30)
            assert await asyncio.wait_for(run.proc.wait(), 30) == 0  # type: ignore[union-attr]
        finally:
            await run.close()
    out = "\n".join(run.lines)
    if command == "approve":
        assert target.read_text() == "ok\n" and f"✓ call {call_id} approved" in out
    else:
        assert not target.exists() and f"✗ call {call_id} denied: looked at it" in out


async def while_a_turn_waits(mesh: Mesh, tmp_path: Path, *command: str) -> tuple[list[str], Proc]:
    """Run ``loopmesh COMMAND`` while a turn of session ``s1`` waits for a person, and
    wait for that turn to end cancelled; the command's output and the ``run``."""
    async with Watch(mesh.nc, tenant="local", session="s1") as watch:
        run = await Proc(
            "-m", "loopmesh", "run", "--nats-url", mesh.url, "--session", "s1",
            guarded_task(tmp_path / "g"),
        ).start()  # fmt: skip
        try:
            await watch.wait("approval_required", timeout=30)  # it waits for a person
            code, lines = await loopmesh(*command)
            assert code == 0, lines
            end = await watch.wait("loop_end", timeout=30)
            assert end.reason == "cancelled"  # type: ignore[attr-defined]
            assert await asyncio.wait_for(run.proc.wait(), 30) == 1  # type: ignore[union-attr]
        finally:
            await run.close()
    return lines, run


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_cancel_stops_a_running_turn(
    transport: str, mesh: Mesh, gateway: GatewayServer, tmp_path: Path
):
    remote = via(transport, mesh, gateway)
    lines, run = await while_a_turn_waits(
        mesh, tmp_path, "cancel", *remote, "--session", "s1", "--reason", "enough"
    )
    assert lines == ["cancel sent to session s1"]
    assert "✘ cancelled after 1 iteration(s) (enough)" in run.lines


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_pause_holds_a_running_turn_and_resume_lets_it_go_on(
    transport: str, mesh: Mesh, gateway: GatewayServer, tmp_path: Path
):
    target = tmp_path / "g"
    remote = via(transport, mesh, gateway)
    async with Watch(mesh.nc, tenant="local", session="s1") as watch:
        run = await Proc(
            "-m", "loopmesh", "run", "--nats-url", mesh.url, "--session", "s1",
            guarded_task(target),
        ).start()  # fmt: skip
        try:
            required = await watch.wait("approval_required", timeout=30)  # iteration 1 waits
            code, lines = await loopmesh("pause", *remote, "--session", "s1")
            assert (code, lines) == (0, ["pause sent to session s1"])
            call_id = required.call_id  # type: ignore[attr-defined]
            code, lines = await loopmesh("approve", *remote, "--session", "s1", call_id)
            assert code == 0, lines
            await watch.wait("paused", timeout=30)  # held before iteration 2
            assert target.read_text() == "ok\n" and not watch.of("loop_end")
            code, lines = await loopmesh("resume", *remote, "--session", "s1")
            assert (code, lines) == (0, ["resume sent to session s1"])
            await watch.wait("resumed", timeout=30)
            end = await watch.wait("loop_end", timeout=30)
            assert end.reason == "task_completion"  # type: ignore[attr-defined]
            assert await asyncio.wait_for(run.proc.wait(), 30) == 0  # type: ignore[union-attr]
        finally:
            await run.close()
    assert "  ⏸ paused" in run.lines and "  ▶ resumed" in run.lines


async def test_fork_and_rewind_take_a_session_to_a_turn_and_events_show_it(
    mesh: Mesh, gateway: GatewayServer
):
    remote = via("gateway", mesh, gateway)
    turns = []
    for text in ("remember heron", "what was it?"):
        code, lines = await loopmesh("run", *remote, "--session", "s1", text)
        assert code == 0, lines
        code, lines = await loopmesh("events", *remote, "--session", "s1", "--json")
        turns.append(json.loads(lines[-1])["turn_id"])
    t1, t2 = turns

    fork = ("fork", *remote, "--session", "s1")
    code, lines = await loopmesh(*fork, "--at-turn", t1, "--into", "f1")
    assert (code, lines) == (0, ["forked session s1 into f1 (1 turn)"])
    code, lines = await loopmesh("events", *remote, "--session", "f1")
    assert lines == [f"⑂ forked from session s1 at the end of turn {t1}"]

    rewind = ("rewind", *remote, "--session", "s1", "--before-turn", t2)
    code, lines = await loopmesh(*rewind)
    assert (code, lines) == (0, [f"rewound session s1 to the end of turn {t1}", f"undone: {t2}"])
    code, lines = await loopmesh("events", *remote, "--session", "s1")
    said = f"↩ rewound to the end of turn {t1}; undone: {t2} (calls that ran, not undone: none)"
    assert lines[-1] == said

    code, lines = await loopmesh(*rewind)
    assert code == 1 and "undone" in lines[-1], lines
    over_nats = ("fork", "--nats-url", mesh.url, "--session", "s1", "--at-turn", t1)
    code, lines = await loopmesh(*over_nats, "--into", "f2")
    assert (code, lines) == (0, ["forked session s1 into f2 (1 turn)"])
    code, lines = await loopmesh(*fork)
    assert code == 2 and "one of the arguments --at-turn --before-turn is required" in lines[-1]


async def test_bad_ids_and_a_refusing_gateway_are_clear_errors(mesh: Mesh, gateway: GatewayServer):
    code, lines = await loopmesh("approve", "--nats-url", mesh.url, "--session", "s.1", "c1")
    assert code == 2
    assert "argument --session: invalid session id 's.1'" in "\n".join(lines)
    code, lines = await loopmesh("cancel", "--gateway", gateway.url, "--session", "nobody")
    assert code == 1
    assert lines == [
        "loopmesh cancel: error: the gateway answered 404 not_found: no session 'nobody'"
    ]
    code, lines = await loopmesh("cancel", "--gateway", "http://127.0.0.1:9", "--session", "s1")
    assert code == 1
    assert "cannot reach the gateway at http://127.0.0.1:9" in lines[-1]
    for command in ("pause", "resume"):  # every command says a client error the same way
        code, lines = await loopmesh(command, "--gateway", gateway.url, "--session", "nobody")
        said = f"loopmesh {command}: error: the gateway answered 404 not_found: no session 'nobody'"
        assert (code, lines) == (1, [said])


async def test_run_through_a_gateway_with_keys_takes_the_key_from_the_environment(
    mesh: Mesh, tmp_path: Path
):
    from gateway.auth import key_hash
    from gateway.settings import ApiKey

    config = GatewayConfig(
        nats=NatsSettings(url=mesh.url, reconnect_wait_s=0.05),
        gateway=GatewaySettings(port=0, api_keys=(ApiKey(sha256=key_hash("k1"), tenant="acme"),)),
    )
    async with GatewayServer(config) as gw:
        task = count_task(tmp_path / "n")
        code, lines = await loopmesh("run", "--gateway", gw.url, "--session", "s1", task)
        assert code == 1
        assert "the gateway answered 401 unauthorized" in lines[-1]
        proc = await Proc(
            "-m", "loopmesh", "run", "--gateway", gw.url, "--session", "s1", task,
            env={"LOOPMESH_CLIENT__API_KEY": "k1"},
        ).start()  # fmt: skip
        assert await asyncio.wait_for(proc.proc.wait(), 60) == 0, proc.output()  # type: ignore[union-attr]
        await proc.close()
    assert "✔ task_completion" in proc.output()
    assert (tmp_path / "n").read_text() == "a\n"
    stored = await _stored_of(mesh, "acme", "s1")
    assert stored and stored[-1].type == "loop_end"  # the key's tenant, not local


async def _stored_of(mesh: Mesh, tenant: str, session: str) -> list:
    from loopmesh.testing.durable import stream_events

    return [e for e, _ in await stream_events(mesh.nc, tenant, session)]


async def test_run_started_before_loopmesh_is_set_up_waits_for_its_streams(
    nats_server: NatsServer, tmp_path: Path
):
    """`make run` starts `loopmesh run --connect-timeout` beside `loopmesh up`, whose
    nats-server takes clients before its streams exist: the run waits for them."""
    target = tmp_path / "n"
    run = Proc(
        "-m", "loopmesh", "run", "--nats-url", nats_server.url, "--connect-timeout", "120",
        "--session", "s1", count_task(target),
    )  # fmt: skip
    await run.start()
    try:
        await _stream_lookups_failed(nats_server)  # it has looked, and found none
        async with mesh_on(nats_server.url, workers=True):
            assert run.proc is not None
            assert await asyncio.wait_for(run.proc.wait(), 120) == 0, run.lines
    finally:
        await run.close()
    assert target.read_text() == "a\n"
    assert "✔ task_completion after 2 iteration(s)" in "\n".join(run.lines)


async def test_run_where_loopmesh_is_not_set_up_says_what_is_missing(
    nats_server: NatsServer, tmp_path: Path
):
    code, lines = await loopmesh("run", "--nats-url", nats_server.url, "hello")
    assert code == 1
    assert lines[-1] == (
        f"loopmesh run: error: NATS at {nats_server.url} has no stream LOOPMESH_TURNS: "
        "loopmesh is not set up there (`loopmesh up`, a loop worker or a tool worker creates "
        "its streams); --connect-timeout S waits for one starting"
    ), lines
    port = free_port()
    bare = await asyncio.create_subprocess_exec(
        find_binary(), "-a", "127.0.0.1", "-p", str(port), stderr=asyncio.subprocess.PIPE
    )  # no -js
    try:
        url = f"nats://127.0.0.1:{port}"
        code, lines = await loopmesh("run", "--nats-url", url, "--connect-timeout", "1", "hi")
    finally:
        await terminate(bare, 10)
    assert code == 1
    assert lines[-1] == (
        f"loopmesh run: error: NATS at {url} has no JetStream (nats-server -js); "
        "--connect-timeout S waits for one starting"
    ), lines


async def _stream_lookups_failed(server: NatsServer) -> None:
    """Until the server's JetStream API has answered a request with an error."""
    async with httpx.AsyncClient() as http:
        for _ in range(600):
            jsz = (await http.get(f"{server.monitor_url}/jsz")).json()
            if jsz.get("api", {}).get("errors", 0) > 0:
                return
            await asyncio.sleep(0.1)
    raise AssertionError(f"no failed JetStream API request: {jsz.get('api')}")


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_memory_adds_lists_forgets_and_erases_a_users_memories(
    transport: str, mesh: Mesh, gateway: GatewayServer
):
    where = via(transport, mesh, gateway)
    code, lines = await loopmesh("memory", "add", "Ada keeps bees.", "--user", "ada", *where)
    assert code == 0 and len(lines) == 1 and lines[0].startswith("remembered ")
    kept = lines[0].removeprefix("remembered ")
    await loopmesh("memory", "add", "Ada plays the cello.", "--user", "ada", *where)
    code, lines = await loopmesh("memory", "--user", "ada", *where)
    assert code == 0 and [line.split("  ")[2] for line in lines] == [
        "Ada keeps bees.", "Ada plays the cello.",
    ]  # fmt: skip
    assert lines[0].startswith(kept + "  ")
    assert await loopmesh("memory", "forget", kept, "--user", "ada", *where) == (
        0,
        [f"forgot {kept}"],
    )
    code, lines = await loopmesh("memory", "forget", kept, "--user", "ada", *where)
    assert (code, lines) == (1, [f"no memory {kept}"])
    assert await loopmesh("memory", "erase", "--user", "ada", *where) == (0, ["erased 1 memories"])
    assert await loopmesh("memory", "--user", "ada", *where) == (0, ["no memories"])
    code, lines = await loopmesh("memory", *where)
    assert code == 2 and "exactly one of --user and --agent" in lines[-1]
