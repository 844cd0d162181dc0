"""The tool worker's settings: the same worker whether started alone or by ``loopmesh up``,
and ranges refused at load with the file or variable and the field named."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import httpx
import msgspec
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext

from loopmesh import up
from loopmesh.cli import build_parser
from loopmesh.errors import ConfigError
from loopmesh.ports import free_port
from loopmesh.server import NatsServer
from tool_worker import cli
from tool_worker.config import ToolWorkerSettings, load_config

from .harness import ROOT

EVERY_FIELD = """
[nats]
prefix = "lm"

[tool_worker]
pool = "slow"
concurrency = 7
ack_wait_s = 12.5
pull_expires_s = 3.5
drain_timeout_s = 4.5
modules = ["tests.tool_worker.sample_tools"]
entry_points = ["configtest"]
pinned = true
builtins = ["calculator", "http_fetch"]
fs_root = "{fs_root}"
fs_max_bytes = 4096
http_allowlist = ["127.0.0.1", "*.example.org"]
http_max_bytes = 2048
http_timeout_s = 2.5
assign = {{ "local.calculator" = "slow", "local" = "slow", "cfg" = "slow" }}
mcp_start_timeout_s = 6.5
event_max_chars = 1000
confirm_events = true
metrics_host = "0.0.0.0"
metrics_port = {metrics_port}

[[tool_worker.mcp_servers]]
name = "time"
command = "mcp-server-time"
pool = "slow"
"""


def parse(*argv: str) -> object:
    parser = build_parser({"up": up, "tool-worker": cli})
    return parser.parse_args(list(argv))


def write_every_field(tmp_path: Path, metrics_port: int = 9999) -> Path:
    path = tmp_path / "loopmesh.toml"
    path.write_text(EVERY_FIELD.format(fs_root=tmp_path, metrics_port=metrics_port))
    return path


async def test_up_and_the_standalone_command_give_the_worker_every_setting(
    tmp_path: Path, nc: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    # an installed package with the entry point the file names
    (tmp_path / "cfgtools.py").write_text(
        "from tool_worker import tool\n\n@tool(server='cfg')\ndef ping() -> str:\n"
        "    return 'pong'\n"
    )
    info = tmp_path / "cfgtools-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: cfgtools\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[loopmesh.tools]\nconfigtest = cfgtools\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = write_every_field(tmp_path)
    standalone = cli.config_of(parse("tool-worker", "--config", str(path)))
    under_up = cli.config_of(parse("up", "--config", str(path)))
    assert standalone == under_up == load_config(path)
    settings = standalone.tool_worker
    defaults = ToolWorkerSettings()
    unset = [f for f in msgspec.structs.fields(settings) if getattr(settings, f.name) == f.default]
    assert unset == [], "the file must set every field so that none can be dropped"
    assert settings != defaults

    registry, servers = cli.build(settings)
    worker = cli.worker_of(nc, standalone, registry, servers)
    for field in (
        "pool",
        "concurrency",
        "ack_wait_s",
        "pull_expires_s",
        "drain_timeout_s",
        "mcp_start_timeout_s",
        "event_max_chars",
        "confirm_events",
        "pinned",
    ):
        assert getattr(worker, field) == getattr(settings, field), field
    assert worker.subjects.prefix == "lm"
    assert list(worker.mcp) == ["time"]
    assert {t.name for t in registry} >= {"calculator", "ping"}


async def test_the_tool_worker_under_up_serves_its_metrics_port(
    tmp_path: Path, nats_server: NatsServer, js: JetStreamContext
) -> None:
    port = free_port()
    path = tmp_path / "loopmesh.toml"
    # metrics_host: another loopback address than the default, so the setting is seen used
    path.write_text(
        f"[tool_worker]\nbuiltins = ['calculator']\nmetrics_host = '127.0.0.2'\n"
        f"metrics_port = {port}\n"
    )
    stop = asyncio.Event()
    service = asyncio.create_task(
        cli.up_service(parse("up", "--config", str(path)))(stop, nats_server.url)
    )
    try:
        async with httpx.AsyncClient() as http, asyncio.timeout(30):
            while True:
                try:
                    response = await http.get(f"http://127.0.0.2:{port}/healthz")
                    break
                except httpx.ConnectError:
                    assert not service.done(), service.result()
                    await asyncio.sleep(0.05)
        assert response.status_code == 200
    finally:
        stop.set()
        await service


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("concurrency", "0"),
        ("ack_wait_s", "0"),
        ("pull_expires_s", "-1"),
        ("http_max_bytes", "0"),
        ("metrics_port", "70000"),
        ("event_max_chars", "10"),
        ("pool", '"a.b"'),
    ],
)
def test_an_out_of_range_setting_is_refused_at_load_with_the_file_and_field(
    tmp_path: Path, field: str, value: str
) -> None:
    path = tmp_path / "loopmesh.toml"
    path.write_text(f"[tool_worker]\n{field} = {value}\n")
    with pytest.raises(ConfigError) as refused:
        load_config(path)
    assert str(path) in str(refused.value)
    assert f"$.tool_worker.{field}" in str(refused.value)


def test_an_out_of_range_variable_or_option_names_its_source(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("LOOPMESH_CONFIG", raising=False)
    monkeypatch.setenv("LOOPMESH_TOOL_WORKER__CONCURRENCY", "0")
    with pytest.raises(ConfigError, match="LOOPMESH_TOOL_WORKER__CONCURRENCY") as refused:
        load_config()
    assert ">= 1" in str(refused.value)
    monkeypatch.delenv("LOOPMESH_TOOL_WORKER__CONCURRENCY")
    with pytest.raises(ConfigError, match="command line") as refused:
        cli.config_of(parse("tool-worker", "--concurrency", "0"))
    assert "$.concurrency" in str(refused.value)


def test_an_mcp_server_setting_out_of_range_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "loopmesh.toml"
    path.write_text(
        '[[tool_worker.mcp_servers]]\nname = "t"\ncommand = "x"\nfailure_threshold = 0\n'
    )
    with pytest.raises(ConfigError, match=r"\$\.tool_worker\.mcp_servers\[0\]\.failure_threshold"):
        load_config(path)


async def test_the_command_exits_at_start_on_concurrency_zero(tmp_path: Path) -> None:
    path = tmp_path / "loopmesh.toml"
    path.write_text("[tool_worker]\nconcurrency = 0\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOOPMESH_")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tool_worker", "--config", str(path),
        "--nats-url", "nats://127.0.0.1:9",
        cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)},
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    async with asyncio.timeout(60):
        _, err = await proc.communicate()
    assert proc.returncode == 1
    assert str(path) in err.decode() and "$.tool_worker.concurrency" in err.decode()
