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
    """``[tool_worker]``: the tools a deployment serves, and one worker's pool of them."""

    #: The pool this worker serves: it runs the calls of the tools assigned to it.
    pool: Annotated[str, msgspec.Meta(pattern=TOKEN_PATTERN)] = "default"
    #: Tool calls one worker runs at once; the rest wait in the pool's stream.
    concurrency: Annotated[int, msgspec.Meta(ge=1, le=100_000)] = 64
    #: The catalog's entries of this pool never lapse, so loop workers keep offering its
    #: tools while no worker runs (KEDA scales the pool to zero; a call wakes one).
    pinned: bool = False
    #: The pool consumer's AckWait: a call unacked this long goes to another worker; a
    #: running call is kept with in-progress acks every third of it.
    ack_wait_s: Annotated[float, msgspec.Meta(ge=1)] = 30.0
    #: How long one pull request for calls waits on the server before it is renewed.
    pull_expires_s: Annotated[float, msgspec.Meta(ge=0.1)] = 15.0
    #: At a stop, calls in flight get this long to finish.
    drain_timeout_s: Positive = 20.0
    #: Python modules whose tools to serve, by import path (``myproject.tools``).
    modules: tuple[str, ...] = ()
    #: Installed packages' ``loopmesh.tools`` entry points to serve, by name (``["*"]``: all).
    entry_points: tuple[str, ...] = ()
    #: The built-in tools to serve, by name (each is ``local.<name>``).
    builtins: tuple[str, ...] = BUILTINS
    #: Serve ``local.fs_list``, ``local.fs_read`` and ``local.fs_write`` confined to this
    #: directory (unset: no file tools).
    fs_root: str | None = None
    #: The most bytes ``local.fs_read`` returns of a file.
    fs_max_bytes: AtLeastOne = 1_000_000
    #: Hosts, addresses or networks ``local.http_fetch`` may reach even when private
    #: (``*.example.com`` allows public subdomains only); it reaches public ones anyway.
    http_allowlist: tuple[str, ...] = ()
    #: The most bytes ``local.http_fetch`` reads of a response.
    http_max_bytes: AtLeastOne = 1_000_000
    #: ``local.http_fetch``'s limit on one request.
    http_timeout_s: Positive = 10.0
    #: The pool of local tools, by ``server.tool`` or ``server`` (unnamed: ``default``).
    assign: dict[str, str] = {}
    #: The MCP servers whose tools this deployment serves (each run by its pool's workers).
    mcp_servers: tuple[McpServerSettings, ...] = ()
    #: At start, the worker waits this long for its MCP servers, then serves without
    #: those not ready.
    mcp_start_timeout_s: Positive = 30.0
    #: A ``tool_result`` event this worker publishes holds at most this many characters
    #: of the result (the result the loop gets is not cut by it).
    event_max_chars: Annotated[int, msgspec.Meta(ge=100)] = 32_768
    #: Wait for JetStream's acknowledgement of each call event this worker publishes
    #: (the loop worker publishes the same event, so by default it is not awaited).
    confirm_events: bool = False
    #: Where ``/metrics`` and ``/healthz`` listen (``0.0.0.0`` in a pod, for probes and
    #: Prometheus).
    metrics_host: str = "127.0.0.1"
    #: The port of ``/metrics`` and ``/healthz`` (unset: none).
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
