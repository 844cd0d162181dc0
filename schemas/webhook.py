"""A webhook: where a turn's events are POSTed, and which of them.

A turn names one (``Turn.webhook``), else its agent's definition does
(``AgentSpec.webhook``); the loop worker records the one that applies in the turn's
``loop_start`` event, and the webhooks service delivers the turn's events of the types
listed from there (docs/ARCHITECTURE.md, "Webhooks").

The URL is checked where the turn is accepted (the gateway, the loop worker): ``https``,
or ``http`` where ``[webhooks] allow_http`` says so, and a host whose addresses are all
public unless ``[webhooks] allowlist`` names it. Its secret is never on the wire: it is
the deployment's, per tenant (``[webhooks] secret`` / ``tenant_secrets``).

Each delivery carries the Standard Webhooks headers (:data:`ID_HEADER`,
:data:`TIMESTAMP_HEADER`, :data:`SIGNATURE_HEADER`); its body is the event as the events
stream stores it.
"""

from __future__ import annotations

import typing
from typing import Annotated, Literal

import msgspec

#: The event types a webhook may ask for: a turn's lifecycle, not its every token.
WebhookEvent = Literal[
    "loop_start",
    "loop_end",
    "approval_required",
    "question",
    "error",
    "paused",
    "resumed",
    "budget_reached",
    "rolled_back",
]
WEBHOOK_EVENTS: tuple[str, ...] = typing.get_args(WebhookEvent)

MAX_URL_CHARS = 2_000

#: The delivery's id: the event's stream sequence, the same across retries.
ID_HEADER = "webhook-id"
#: When this attempt was signed, in Unix seconds.
TIMESTAMP_HEADER = "webhook-timestamp"
#: ``v1,<base64 HMAC-SHA256 of "<id>.<timestamp>.<body>">`` under the tenant's secret.
SIGNATURE_HEADER = "webhook-signature"


class Webhook(msgspec.Struct, frozen=True, kw_only=True):
    """Where to POST a turn's events: ``url``, and the event ``events`` types to send.
    Unknown fields are ignored, as everywhere on the wire (a newer writer's)."""

    #: Where the events are POSTed: ``https://``, or ``http://`` where ``[webhooks]
    #: allow_http`` is set; a private host only where ``[webhooks] allowlist`` names it.
    url: Annotated[
        str,
        msgspec.Meta(
            min_length=1,
            max_length=MAX_URL_CHARS,
            pattern=r"^[Hh][Tt][Tt][Pp][Ss]?://",
            description="an https:// URL (http:// where [webhooks] allow_http is set)",
        ),
    ]
    #: The types of the turn's events to send.
    events: Annotated[tuple[WebhookEvent, ...], msgspec.Meta(min_length=1, max_length=16)] = (
        "loop_end",
    )
