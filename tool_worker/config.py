"""The tool worker's configuration: the ``[nats]`` and ``[tool_worker]`` tables.

::

    [tool_worker]
    pool = "default"
    concurrency = 64
    modules = ["myproject.tools"]          # user tool modules, by import path
    builtins = ["calculator", "current_time", "http_fetch"]
    fs_root = "/srv/agent-files"           # serve fs_list/fs_read/fs_write under it
    http_allowlist = ["*.wikipedia.org"]    # default: any public address, never a private one
    assign = { "local.http_fetch" = "slow" }   # "server.tool" or "server" → pool

    [[tool_worker.mcp_servers]]
    name = "time"
    command = "mcp-server-time"
    pool = "default"

Every field can be set with ``LOOPMESH_TOOL_WORKER__<FIELD>`` (lists as JSON or
comma-separated text).
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from loopmesh.settings import NatsSettings, load

from .builtins import BUILTINS
from .mcp import McpServerSettings


class ToolWorkerSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pool: str = "default"
    concurrency: int = 64
    ack_wait_s: float = 30.0
    pull_expires_s: float = 15.0
    drain_timeout_s: float = 20.0
    modules: tuple[str, ...] = ()
    builtins: tuple[str, ...] = BUILTINS
    fs_root: str | None = None
    fs_max_bytes: int = 1_000_000
    http_allowlist: tuple[str, ...] = ()
    http_max_bytes: int = 1_000_000
    http_timeout_s: float = 10.0
    assign: dict[str, str] = {}
    mcp_servers: tuple[McpServerSettings, ...] = ()
    mcp_start_timeout_s: float = 30.0
    event_max_chars: int = 32_768
    confirm_events: bool = False
    metrics_port: int | None = None

    def pool_of(self, server: str, tool: str) -> str:
        """The pool a local tool belongs to: ``assign`` by ``server.tool``, then by
        ``server``, else ``default``."""
        return self.assign.get(f"{server}.{tool}") or self.assign.get(server) or "default"


class ToolWorkerConfig(msgspec.Struct, frozen=True, kw_only=True):
    nats: NatsSettings = NatsSettings()
    tool_worker: ToolWorkerSettings = ToolWorkerSettings()


def load_config(path: str | Path | None = None) -> ToolWorkerConfig:
    return load(ToolWorkerConfig, path)
