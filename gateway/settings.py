"""The gateway's settings: the ``[nats]`` and ``[gateway]`` tables.

::

    [gateway]
    host = "127.0.0.1"
    port = 8080
    api_keys = [{ sha256 = "<hex of sha256(key)>", tenant = "acme", name = "ci" }]
    no_auth = false            # true: every request is tenant "local" (announced in the log)
    no_auth_any_host = false   # and allow that on a non-loopback host (second, explicit switch)

Keys are stored only as their SHA-256 (``python -m gateway.keys`` makes one). Every
field can be set with ``LOOPMESH_GATEWAY__<FIELD>``.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from loopmesh.settings import NatsSettings, SchedulerSettings, Tenants
from loopmesh.webhook import WebhookSettings
from schemas.ids import TOKEN_PATTERN

Positive = Annotated[float, msgspec.Meta(gt=0)]
AtLeastOne = Annotated[int, msgspec.Meta(ge=1)]
Sha256Hex = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{64}$")]
TenantId = Annotated[str, msgspec.Meta(pattern=TOKEN_PATTERN)]
PublicUrl = Annotated[str, msgspec.Meta(pattern=r"^https?://[^/?#\s]+(/[^?#\s]*[^/?#\s])?$")]

#: The tenant of every request in no-auth mode.
LOCAL_TENANT = "local"


class ApiKey(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One API key the gateway accepts (``python -m gateway.keys`` makes one)."""

    #: Lowercase hex of the key's SHA-256; the key itself is never stored.
    sha256: Sha256Hex
    #: The tenant whose requests the key makes.
    tenant: TenantId
    #: The key's name, for logs and metrics.
    name: str = ""


class GatewaySettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[gateway]``: the HTTP API (docs/GATEWAY.md), its keys and its limits."""

    #: The address the gateway listens on.
    host: str = "127.0.0.1"
    #: The port the gateway listens on (0: any free one).
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 8080
    #: The keys accepted, as ``{ sha256 = "...", tenant = "...", name = "..." }``.
    api_keys: tuple[ApiKey, ...] = ()
    #: No keys: every request is tenant ``local`` (announced in the log); on a loopback
    #: host only, unless ``no_auth_any_host``.
    no_auth: bool = False
    #: Allow ``no_auth`` on a host that is not loopback (a second, explicit switch).
    no_auth_any_host: bool = False
    #: A longer request body is refused (413).
    max_body_bytes: AtLeastOne = 256 * 1024
    #: A turn's ``input`` (and an A2A message's text) of more characters is refused.
    max_input_chars: AtLeastOne = 100_000
    #: A turn's ``instructions`` of more characters are refused.
    max_instructions_chars: AtLeastOne = 20_000
    #: A cancel's, pause's or approval's ``reason`` of more characters is refused.
    max_reason_chars: AtLeastOne = 1_000
    #: A turn's ``tools`` list of more names is refused.
    max_tools: AtLeastOne = 256
    #: The most ``max_iterations`` a turn may ask for.
    max_iterations: AtLeastOne = 200
    #: Requests per second per key, sustained; past it, 429.
    rate_per_s: Positive = 20.0
    #: Requests per key in a burst.
    rate_burst: AtLeastOne = 40
    #: Long-lived calls open per key: SSE event streams, A2A streams, subscriptions and
    #: sends, MCP tool calls (each until it is answered); past it, 429 (MCP: a JSON-RPC
    #: error).
    max_streams_per_key: AtLeastOne = 16
    #: Events held for one SSE client; a client that falls further behind is cut.
    stream_buffer: AtLeastOne = 1_000
    #: An idle SSE stream gets a comment this often.
    keepalive_s: Positive = 15.0
    #: A client that takes longer to read one event is cut.
    send_timeout_s: Positive = 30.0
    #: The most events ``GET /v1/events/latest?limit=`` returns.
    latest_max: AtLeastOne = 500
    #: The limit on a publish's acknowledgement and on a KV read.
    nats_timeout_s: Positive = 5.0
    #: An MCP tool call (``/mcp``) waits this long for its turn's end.
    mcp_timeout_s: Positive = 900.0
    #: The base URL A2A agent cards advertise (unset: ``http://`` and the address the
    #: gateway took the request on, never its ``Host`` header); set it behind a proxy.
    public_url: PublicUrl | None = None
    #: A2A push-notification hosts that may be private (the format of
    #: ``[tool_worker] http_allowlist``).
    push_allowlist: tuple[str, ...] = ()
    #: One A2A push notification's limit.
    push_timeout_s: Positive = 10.0
    #: A2A push notifications waiting per task while its webhooks are slow; past it, the
    #: oldest that is not a task's final state is dropped.
    push_queue: AtLeastOne = 64
    #: An A2A cancel waits this long for the turn to end.
    a2a_cancel_wait_s: Positive = 10.0
    #: An A2A task whose gateway went away is written back from its turn's events
    #: after this long (a read folds them in before that).
    a2a_repair_after_s: Annotated[float, msgspec.Meta(ge=0)] = 60.0
    #: ``DELETE /v1/sessions/{session}`` waits this long for the session's running turn
    #: to end once cancelled, then erases it anyway.
    erase_cancel_wait_s: Positive = 10.0
    #: How often the gateway looks for sessions idle past their retention
    #: (``[tenants] session_retention_s``, an agent's ``session_retention_s``; 0: never).
    retention_sweep_s: Annotated[float, msgspec.Meta(ge=0)] = 60.0


OnBusy = Literal["enqueue", "reject", "interrupt", "rollback"]


class LoopDefaults(msgspec.Struct, frozen=True, kw_only=True):
    """What the gateway reads of a shared configuration's ``[loop]`` table (the loop
    workers read the rest): the default of a turn's ``on_busy``, so that a turn the
    workers would refuse for a busy session is answered 409 at once."""

    #: As ``[loop] on_busy``: ``reject`` answers a turn for a busy session 409 at once.
    on_busy: OnBusy = "enqueue"


class GatewayConfig(msgspec.Struct, frozen=True, kw_only=True):
    nats: NatsSettings = NatsSettings()
    gateway: GatewaySettings = GatewaySettings()
    loop: LoopDefaults = LoopDefaults()
    #: ``[webhooks]``: a turn's webhook URL is checked against its egress policy.
    webhooks: WebhookSettings = WebhookSettings()
    scheduler: SchedulerSettings = SchedulerSettings()  # fires the schedules' ticks
    #: ``[tenants."<name>"]`` (``"*"``: every other tenant): the gateway refuses a turn
    #: of a tenant whose turns waiting are ``max_backlog`` or more.
    tenants: Tenants = {}
