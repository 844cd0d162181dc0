"""The tool worker's configuration: the ``[nats]`` and ``[tool_worker]`` tables.

::

    [tool_worker]
    pool = "default"
    concurrency = 64
    pinned = false                         # true: may scale to zero (tool_worker/catalog.py)
    modules = ["myproject.tools"]          # user tool modules, by import path
    entry_points = ["text"]                # installed packages' "loopmesh.tools" entry points
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
from typing import Annotated

import msgspec

from loopmesh.settings import AtLeastOne, NatsSettings, Port, Positive, load
from schemas.ids import TOKEN_PATTERN

from .builtins import BUILTINS
from .mcp import McpServerSettings


class ToolWorkerSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pool: Annotated[str, msgspec.Meta(pattern=TOKEN_PATTERN)] = "default"
    concurrency: Annotated[int, msgspec.Meta(ge=1, le=100_000)] = 64
    pinned: bool = False  # catalog entries outlive the workers: the pool may scale to zero
    ack_wait_s: Annotated[float, msgspec.Meta(ge=1)] = 30.0  # in-progress acks every third
    pull_expires_s: Annotated[float, msgspec.Meta(ge=0.1)] = 15.0
    drain_timeout_s: Positive = 20.0
    modules: tuple[str, ...] = ()
    entry_points: tuple[str, ...] = ()  # "loopmesh.tools" entry points by name, or ["*"]
    builtins: tuple[str, ...] = BUILTINS
    fs_root: str | None = None
    fs_max_bytes: AtLeastOne = 1_000_000
    http_allowlist: tuple[str, ...] = ()
    http_max_bytes: AtLeastOne = 1_000_000
    http_timeout_s: Positive = 10.0
    assign: dict[str, str] = {}
    mcp_servers: tuple[McpServerSettings, ...] = ()
    mcp_start_timeout_s: Positive = 30.0
    event_max_chars: Annotated[int, msgspec.Meta(ge=100)] = 32_768
    confirm_events: bool = False
    metrics_host: str = "127.0.0.1"  # "0.0.0.0" in a pod, for probes and Prometheus
    metrics_port: Port | None = None

    def pool_of(self, server: str, tool: str) -> str:
        """The pool a local tool belongs to: ``assign`` by ``server.tool``, then by
        ``server``, else ``default``."""
        return self.assign.get(f"{server}.{tool}") or self.assign.get(server) or "default"


class ToolWorkerConfig(msgspec.Struct, frozen=True, kw_only=True):
    nats: NatsSettings = NatsSettings()
    tool_worker: ToolWorkerSettings = ToolWorkerSettings()


def load_config(path: str | Path | None = None) -> ToolWorkerConfig:
    return load(ToolWorkerConfig, path)
