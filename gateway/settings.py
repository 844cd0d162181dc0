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

from loopmesh.settings import NatsSettings, SchedulerSettings
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
    sha256: Sha256Hex  # lowercase hex of the key's SHA-256; the key itself is never stored
    tenant: TenantId
    name: str = ""  # for logs and metrics


class GatewaySettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    host: str = "127.0.0.1"
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 8080
    api_keys: tuple[ApiKey, ...] = ()
    no_auth: bool = False
    no_auth_any_host: bool = False
    max_body_bytes: AtLeastOne = 256 * 1024
    max_input_chars: AtLeastOne = 100_000
    max_instructions_chars: AtLeastOne = 20_000
    max_reason_chars: AtLeastOne = 1_000
    max_tools: AtLeastOne = 256
    max_iterations: AtLeastOne = 200  # the most a turn may ask for
    rate_per_s: Positive = 20.0  # requests per second per key, sustained
    rate_burst: AtLeastOne = 40  # and in a burst
    max_streams_per_key: AtLeastOne = 16  # open SSE streams per key
    stream_buffer: AtLeastOne = 1_000  # events held for one SSE client before it is cut
    keepalive_s: Positive = 15.0  # a comment on an idle SSE stream this often
    send_timeout_s: Positive = 30.0  # a client that takes longer to read one event is cut
    latest_max: AtLeastOne = 500  # /v1/events/latest?limit= at most
    nats_timeout_s: Positive = 5.0  # for publish acks and KV reads
    mcp_timeout_s: Positive = 900.0  # an MCP tool call waits this long for its turn's end
    # A2A (docs/AGENTS.md): the base URL the agent cards advertise (default: the URL the
    # card was asked at), webhook hosts that may be private (the format of
    # [tool_worker] http_allowlist), how long a push may take, how long a cancel waits
    # for the turn to end, and after how long a task whose gateway went away is
    # written back from its turn's events (a read folds them in before that).
    public_url: PublicUrl | None = None
    push_allowlist: tuple[str, ...] = ()
    push_timeout_s: Positive = 10.0
    a2a_cancel_wait_s: Positive = 10.0
    a2a_repair_after_s: Annotated[float, msgspec.Meta(ge=0)] = 60.0


OnBusy = Literal["enqueue", "reject", "interrupt", "rollback"]


class LoopDefaults(msgspec.Struct, frozen=True, kw_only=True):
    """What the gateway reads of a shared configuration's ``[loop]`` table (the loop
    workers read the rest): the default of a turn's ``on_busy``, so that a turn the
    workers would refuse for a busy session is answered 409 at once."""

    on_busy: OnBusy = "enqueue"


class GatewayConfig(msgspec.Struct, frozen=True, kw_only=True):
    nats: NatsSettings = NatsSettings()
    gateway: GatewaySettings = GatewaySettings()
    loop: LoopDefaults = LoopDefaults()
    #: ``[webhooks]``: a turn's webhook URL is checked against its egress policy.
    webhooks: WebhookSettings = WebhookSettings()
    scheduler: SchedulerSettings = SchedulerSettings()  # fires the schedules' ticks
