import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import nats
import pytest

from loopmesh import cli
from loopmesh.testing.durable import wait_for
from schemas import Subjects, definitions

ROOT = Path(__file__).resolve().parents[2]
LOOPMESH = [sys.executable, "-m", "loopmesh"]


def clean_env() -> dict[str, str]:
    """The environment without LOOPMESH_ settings, with an LLM endpoint configured so
    that ``up`` does not start the embedded model (these tests are about NATS), and the
    gateway on a free port (two ``up`` at once would both want 8080)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOOPMESH_")}
    env["LOOPMESH_LLM__BASE_URL"] = "http://127.0.0.1:9/v1"
    env["LOOPMESH_GATEWAY__PORT"] = "0"
    return env


def test_help_lists_the_commands_and_how_settings_are_read():
    result = subprocess.run(
        [*LOOPMESH, "--help"], cwd=ROOT, env=clean_env(), capture_output=True, text=True,
        timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert re.search(r"^\s+up\s+Run loopmesh on this machine", result.stdout, re.M)
    assert "LOOPMESH_<TABLE>__<FIELD>" in result.stdout
    for option in ("--config", "--nats-url", "--log-level"):
        assert option in result.stdout
    for name in cli.COMMANDS:
        assert re.search(rf"^\s+{name}\s", result.stdout, re.M), name


def test_the_commands_people_type_live_beside_the_client_and_are_quiet():
    typed = {n for n, m in cli.COMMANDS.items() if m.startswith("loopmesh.commands.")}
    assert typed == {
        "run", "events", "approve", "deny", "cancel", "pause", "resume", "agents",
        "schedules", "tools", "memory", "fork", "rewind", "erase", "sessions",
        "nats-mappings",
    }  # fmt: skip
    for name in typed:
        assert getattr(cli.load_command(name), "LOG_LEVEL", "INFO") == "WARNING", name


def test_a_command_whose_module_is_missing_says_it_is_not_installed(monkeypatch, capsys):
    monkeypatch.setitem(cli.COMMANDS, "ghost", "no_such_package.cli")
    assert cli.main(["ghost"]) == 2
    assert "command 'ghost' is not installed (no_such_package.cli" in capsys.readouterr().err


def test_commands_that_cannot_import_are_not_listed(monkeypatch, capsys):
    monkeypatch.setitem(cli.COMMANDS, "ghost", "no_such_package.cli")
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert "ghost" not in out
    assert " up " in out


def up_with(config: Path) -> subprocess.CompletedProcess[str]:
    """``loopmesh up --config CONFIG``, run to its end (a bad file ends it at once)."""
    return subprocess.run(
        [*LOOPMESH, "up", "--config", str(config)], cwd=ROOT, env=clean_env(),
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def test_a_bad_config_file_exits_with_the_field_and_expected_type(tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text('[nats]\nreplicas = "three"\n')
    result = up_with(config)
    assert result.returncode == 1
    assert str(config) in result.stderr
    assert "Expected `int`, got `str` - at `$.nats.replicas`" in result.stderr


def test_up_with_tls_files_but_no_nats_url_says_its_own_server_has_no_tls(tmp_path, certs):
    config = tmp_path / "tls.toml"
    config.write_text(f'[nats]\ntls_ca_file = "{certs.ca}"\n')
    result = up_with(config)
    assert result.returncode == 1
    assert "[nats] tls_ca_file" in result.stderr and "--nats-url tls://" in result.stderr


def test_the_runtime_table_is_read_before_the_command_starts(tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text('[runtime]\nevent_loop = "trio"\n')
    result = up_with(config)
    assert result.returncode == 1
    assert str(config) in result.stderr
    assert "at `$.runtime.event_loop`" in result.stderr
    assert "nats " not in result.stdout  # refused before anything started


async def start_up(
    *args: str, env: dict[str, str] | None = None
) -> tuple[asyncio.subprocess.Process, dict[str, str]]:
    """Start `loopmesh up` (with ``env`` added to :func:`clean_env`); return it and the
    lines it printed before "ready", by key."""
    proc = await asyncio.create_subprocess_exec(
        *LOOPMESH, "up", *args, cwd=ROOT, env={**clean_env(), **(env or {})},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    printed: dict[str, str] = {}
    async with asyncio.timeout(30):
        while True:
            line = (await proc.stdout.readline()).decode()
            if not line:
                err = await proc.stderr.read() if proc.stderr else b""
                raise AssertionError(f"loopmesh up exited early: {err.decode()}")
            key, _, value = line.strip().partition(" ")
            printed[key] = value.strip()
            if key.startswith("ready"):
                return proc, printed


def nats_server_pids(store: Path) -> list[int]:
    """Processes whose command line names ``store``: the embedded nats-server."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if str(store).encode() in cmdline and any(b"nats-server" in a for a in cmdline):
                pids.append(int(entry.name))
    return pids


async def test_up_serves_provisioned_nats_until_sigint_and_leaves_no_process(tmp_path):
    store = tmp_path / "store"
    free_ports = ("--port", "-1", "--monitor-port", "-1")
    proc, printed = await start_up("--store-dir", str(store), *free_ports)
    try:
        url = printed["nats"].split()[0]
        assert url.startswith("nats://127.0.0.1:")
        assert printed["monitor"].startswith("http://127.0.0.1:")
        assert nats_server_pids(store)
        nc = await nats.connect(url)
        try:
            js = nc.jetstream()
            for stream in definitions(Subjects()).streams:
                assert (await js.stream_info(stream.name)).config.name == stream.name
        finally:
            await nc.close()
        proc.send_signal(signal.SIGINT)
        async with asyncio.timeout(30):
            rest, _ = await proc.communicate()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0
    assert b"stopping" in rest
    assert nats_server_pids(store) == []


async def test_up_with_turn_partitions_starts_its_server_with_their_mappings(tmp_path):
    """``[nats] turn_partitions = 2``: the embedded server routes each tenant's turns to
    its partition's stream, and every service up starts passed its check of that."""
    from loopmesh.turns import publish_turn
    from schemas import Turn

    store = tmp_path / "store"
    free_ports = ("--port", "-1", "--monitor-port", "-1")
    env = {"LOOPMESH_NATS__TURN_PARTITIONS": "2"}
    proc, printed = await start_up("--store-dir", str(store), *free_ports, env=env)
    try:
        nc = await nats.connect(printed["nats"].split()[0])
        try:
            s = Subjects(turn_partitions=2)
            streams = set()
            for tenant in ("acme", "globex", "initech", "umbrella"):
                turn = Turn(id="t1", tenant=tenant, session="s1", input="hi")
                ack = await publish_turn(nc.jetstream(), s, turn)
                assert ack.stream == s.turns_stream_of(tenant)
                streams.add(ack.stream)
            assert streams == set(s.turns_streams)
        finally:
            await nc.close()
        proc.send_signal(signal.SIGINT)
        async with asyncio.timeout(30):
            await proc.communicate()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0


async def test_up_with_a_nats_url_provisions_that_server_and_stops_on_sigterm(nats_server, nc):
    proc, printed = await start_up("--nats-url", nats_server.url)
    try:
        assert printed["nats"] == f"{nats_server.url} (external)"
        assert "monitor" not in printed
        info = await nc.jetstream().stream_info(Subjects().events_stream)
        assert info.config.name == Subjects().events_stream
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):
            await proc.wait()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, (await proc.stderr.read()).decode() if proc.stderr else ""
    assert nats_server.running


async def test_up_whose_gateway_port_is_taken_says_so_and_exits_1(nats_server):
    with socket.create_server(("127.0.0.1", 0)) as taken:  # listening: the port is in use
        port = taken.getsockname()[1]
        proc, _ = await start_up(
            "--nats-url", nats_server.url, env={"LOOPMESH_GATEWAY__PORT": str(port)}
        )
        try:
            async with asyncio.timeout(60):  # it stops on its own: no signal
                out, err = await proc.communicate()
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    assert proc.returncode == 1, err.decode()  # not 3, uvicorn's exit when it cannot listen
    said = out.decode()
    assert "error     gateway: invalid configuration in [gateway] host and port" in said, said
    assert f"cannot listen on 127.0.0.1:{port} (" in said and "address already in use" in said


async def test_the_embedded_nats_server_dies_with_up_even_when_up_is_killed(tmp_path):
    store = tmp_path / "store"
    proc, _ = await start_up("--store-dir", str(store), "--port", "-1", "--monitor-port", "-1")
    try:
        assert nats_server_pids(store)
    finally:
        proc.kill()  # SIGKILL: up cannot stop its children itself
        await proc.wait()
    await wait_for(lambda: nats_server_pids(store) == [], what="nats-server to exit")


def test_commands_people_type_are_quiet_unless_asked_and_services_log_at_info():
    import argparse

    up, worker = cli.load_command("up"), cli.load_command("loop-worker")

    def level(module, log_level=None, verbose=0):
        return cli.log_level(argparse.Namespace(log_level=log_level, verbose=verbose), module)

    assert level(up) == "WARNING"
    assert level(cli.load_command("run")) == "WARNING"
    assert level(up, verbose=1) == "INFO" and level(up, verbose=2) == "DEBUG"
    assert level(up, log_level="ERROR", verbose=2) == "ERROR"
    assert level(worker) == "INFO"
