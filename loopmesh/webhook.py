"""Webhooks' settings (the ``[webhooks]`` table) and the check of a webhook's URL.

One table serves every service that reads it: the gateway and the loop worker check a
turn's webhook where they accept the turn (:func:`check_webhook`), the webhooks service
delivers with the rest. The URL must be ``https`` (``http`` only with ``allow_http``),
without credentials, and its host must resolve to public addresses only, unless
``allowlist`` names it (:mod:`loopmesh.egress`, the rule ``http_fetch`` follows).

Secrets are the deployment's, never a turn's: ``secret`` signs every tenant's deliveries
unless ``tenant_secrets`` has the tenant's own. Each is a Standard Webhooks secret,
``whsec_`` and the base64 of 24 to 64 random bytes (``loopmesh webhooks --new-secret``
prints one). A tenant with neither gets no delivery at all: its events are
dead-lettered, with an ``error`` event that names the setting (fail closed).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from collections.abc import Sequence
from typing import Annotated

import httpx
import msgspec

from schemas.agents import AgentSpec
from schemas.ids import is_token
from schemas.webhook import Webhook

from .egress import Address, Allowlist, Egress, Resolver, resolve
from .errors import HostError, InvalidWebhook

#: The allowlist's setting, as refusals name it.
ALLOWLIST_SETTING = "[webhooks] allowlist (LOOPMESH_WEBHOOKS__ALLOWLIST)"
SECRET_PREFIX = "whsec_"
SECRET_BYTES = (24, 64)  # Standard Webhooks' bounds on a secret's key

Positive = Annotated[float, msgspec.Meta(gt=0)]
AtLeastOne = Annotated[int, msgspec.Meta(ge=1)]


class WebhookSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[webhooks]``: the egress policy of webhook URLs, their secrets, and how the
    webhooks service delivers (docs/ARCHITECTURE.md, "Webhooks")."""

    #: Hosts, addresses or networks a webhook may reach even when not public.
    allowlist: tuple[str, ...] = ()
    #: Accept ``http://`` webhook URLs (deliveries in clear: a private network, tests).
    allow_http: bool = False
    #: The secret that signs every tenant's deliveries, unless ``tenant_secrets`` has
    #: the tenant's own (``whsec_...``; set it from the environment, not a file in git).
    secret: str | None = None
    #: A tenant's own secret (``whsec_...``), by tenant, in place of ``secret``.
    tenant_secrets: dict[str, str] = {}
    #: Tries of one event's delivery before it is dead-lettered.
    max_attempts: Annotated[int, msgspec.Meta(ge=1, le=100)] = 10
    #: Wait before the second try; it doubles each try, up to ``backoff_max_s``.
    backoff_s: Positive = 5.0
    #: The longest wait between two tries.
    backoff_max_s: Positive = 3600.0
    #: One try's limit, from connecting to the receiver's status line.
    timeout_s: Annotated[float, msgspec.Meta(gt=0, le=60)] = 10.0
    #: Deliveries in flight at once.
    concurrency: Annotated[int, msgspec.Meta(ge=1, le=10_000)] = 64
    #: Deliveries in flight at once to one receiver (scheme, host and port).
    per_receiver: Annotated[int, msgspec.Meta(ge=1, le=10_000)] = 4
    #: Events held at once, waiting for their receiver or in flight (the consumer lets
    #: 20,000 be unacked); past it the service reads no more until some are settled.
    max_held: Annotated[int, msgspec.Meta(ge=1, le=20_000)] = 10_000
    #: At a stop, how long deliveries in flight get to finish.
    drain_timeout_s: Positive = 15.0
    #: Where the webhooks service's ``/metrics`` and ``/healthz`` listen.
    metrics_host: str = "127.0.0.1"
    #: The port of the webhooks service's ``/metrics`` and ``/healthz`` (unset: none).
    metrics_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] | None = None

    def __post_init__(self) -> None:
        Allowlist(self.allowlist, setting="`webhooks.allowlist`")  # a bad entry is named
        if self.secret is not None:
            _check_secret("webhooks.secret", self.secret)
        for tenant, secret in self.tenant_secrets.items():
            if not is_token(tenant):
                raise ValueError(
                    f"`webhooks.tenant_secrets`: {tenant[:80]!r} is not a tenant id "
                    "(1-64 characters from A-Z a-z 0-9 _ -)"
                )
            _check_secret(f"webhooks.tenant_secrets.{tenant}", secret)

    def secret_for(self, tenant: str) -> str | None:
        """The secret that signs ``tenant``'s deliveries, or ``None``: none is set."""
        return self.tenant_secrets.get(tenant, self.secret)


class WebhookRequest(Webhook, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A webhook as a person writes one (a posted turn, an ``[[agents]]`` table's
    ``webhook``): where the turn's events are POSTed, and which of them; a misspelt field
    is refused rather than ignored."""

    def plain(self) -> Webhook:
        """The webhook as the wire carries it."""
        return Webhook(url=self.url, events=self.events)


def _check_secret(field: str, secret: str) -> None:
    """A ValueError naming ``field`` (never the secret) unless it is ``whsec_`` and
    the base64 of 24 to 64 bytes."""
    low, high = SECRET_BYTES
    wanted = f"`{field}` is not a webhook secret: `whsec_` and the base64 of {low} to {high} bytes"
    if not secret.startswith(SECRET_PREFIX):
        raise ValueError(f"{wanted} (`loopmesh webhooks --new-secret` prints one)")
    try:
        key = base64.b64decode(secret[len(SECRET_PREFIX) :], validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{wanted}: the rest is not base64") from None
    if not low <= len(key) <= high:
        raise ValueError(f"{wanted}: it holds {len(key)} bytes")


def new_secret() -> str:
    """A fresh Standard Webhooks secret (32 random bytes)."""
    import secrets

    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(32)).decode("ascii")


def egress(settings: WebhookSettings, resolver: Resolver = resolve) -> Egress:
    """The egress policy of webhook deliveries."""
    allowlist = Allowlist(settings.allowlist, setting="`webhooks.allowlist`")
    return Egress(allowlist, resolver, setting=ALLOWLIST_SETTING)


def target(webhook: Webhook, settings: WebhookSettings, *, field: str = "webhook") -> httpx.URL:
    """The webhook's URL, parsed; raises :class:`InvalidWebhook` naming ``field.url``
    when its scheme is not allowed, it has no host, or it carries credentials."""
    where = f"{field}.url"
    try:
        url = httpx.URL(webhook.url)
    except (httpx.InvalidURL, TypeError) as exc:
        raise InvalidWebhook(where, f"`{where}` is not a valid URL: {exc}") from None
    schemes = ("https", "http") if settings.allow_http else ("https",)
    if url.scheme not in schemes:
        allowed = "https or http" if settings.allow_http else "https"
        hint = "" if settings.allow_http else " ([webhooks] allow_http allows http)"
        raise InvalidWebhook(where, f"`{where}` must be {allowed}, not {url.scheme!r}{hint}")
    if not url.host:
        raise InvalidWebhook(where, f"`{where}` has no host")
    if url.userinfo:
        raise InvalidWebhook(
            where,
            f"`{where}` must not carry a user or password: deliveries are signed, "
            "and a URL is shown in the turn's events",
        )
    return url


def check_agent_webhooks(agents: Sequence[AgentSpec], settings: WebhookSettings) -> None:
    """A ValueError naming the field (``agents[1].webhook.url``) when an agent's webhook
    URL is refused by :func:`target` (its host is checked at each delivery)."""
    for i, agent in enumerate(agents):
        if agent.webhook is not None:
            try:
                target(agent.webhook, settings, field=f"agents[{i}].webhook")
            except InvalidWebhook as exc:
                raise ValueError(exc.message) from None


async def check_webhook(
    webhook: Webhook,
    settings: WebhookSettings,
    *,
    field: str = "webhook",
    policy: Egress | None = None,
) -> tuple[httpx.URL, list[Address]]:
    """The webhook's URL and the addresses a delivery may connect to; raises
    :class:`InvalidWebhook` naming ``field.url`` when the URL (:func:`target`), its
    host or an address it resolves to is refused, or it does not resolve."""
    url = target(webhook, settings, field=field)
    port = url.port or (443 if url.scheme == "https" else 80)
    host = url.raw_host.decode("ascii")
    try:
        async with asyncio.timeout(settings.timeout_s):  # a resolver that does not answer
            addresses = await (policy or egress(settings)).check(host, port)
    except HostError as exc:
        raise InvalidWebhook(f"{field}.url", f"`{field}.url`: {exc.message}") from None
    except TimeoutError:
        raise InvalidWebhook(
            f"{field}.url", f"`{field}.url`: {host} did not resolve within {settings.timeout_s:g} s"
        ) from None
    return url, addresses
