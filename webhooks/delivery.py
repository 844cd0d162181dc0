"""One try of one delivery: check the URL against the egress policy, sign, POST.

:meth:`Deliverer.send` never raises for the receiver's sake: it returns a :class:`Try`
that says whether the event was delivered (a 2xx answer), and if not, why and whether
trying again can help. The egress policy (:mod:`loopmesh.egress`) is applied on every
try, to the addresses the host resolves to then, and the connection goes to a checked
address: a webhook whose name later resolves to a private address is refused, not
followed. Refused URLs and hosts are final; everything the receiver or the network
does (an error status, a timeout, a refused connection, a name that does not resolve)
is tried again.

No redirect is followed (each hop would need the check), no proxy is taken from the
environment (it would connect by name, past the pinned address), and no connection is
kept for a later try: a kept connection is found by address, and another host on the
same address would reuse a TLS session checked for the first.
"""

from __future__ import annotations

import asyncio
import time
from typing import Literal

import httpx
import msgspec

from loopmesh.egress import Egress, Resolver, resolve, send_pinned
from loopmesh.errors import EgressRefused, InvalidWebhook, UnresolvableHost
from loopmesh.webhook import WebhookSettings, egress, target
from schemas import Webhook

from .signing import signed_headers

USER_AGENT = "loopmesh-webhooks/1"

#: Why a try failed, as the failures metric labels it.
Failure = Literal["status", "timeout", "connect", "unresolvable", "refused"]


class Try(msgspec.Struct, frozen=True, kw_only=True):
    """How one try went: ``delivered``, else ``failure`` (its kind), ``reason`` (for a
    person), ``final`` (trying again cannot help)."""

    delivered: bool
    status: int | None = None
    failure: Failure | None = None
    reason: str = ""
    final: bool = False
    seconds: float = 0.0


class Deliverer:
    """POSTs signed events under ``settings`` (an async context manager: its client)."""

    def __init__(
        self,
        settings: WebhookSettings,
        *,
        resolver: Resolver = resolve,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.settings = settings
        self.policy: Egress = egress(settings, resolver)
        limits = httpx.Limits(max_connections=settings.concurrency, max_keepalive_connections=0)
        self.client = httpx.AsyncClient(
            timeout=settings.timeout_s,
            follow_redirects=False,
            trust_env=False,
            limits=limits,
            transport=transport,
        )

    async def __aenter__(self) -> Deliverer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client.aclose()

    async def send(self, webhook: Webhook, msg_id: str, body: bytes, secret: str) -> Try:
        """One try of POSTing ``body`` (an event as stored) to ``webhook``."""
        start = time.monotonic()
        limit = self.settings.timeout_s
        try:
            url = target(webhook, self.settings)
            port = url.port or (443 if url.scheme == "https" else 80)
            async with asyncio.timeout(limit):
                addresses = await self.policy.check(url.raw_host.decode("ascii"), port)
        except (InvalidWebhook, EgressRefused) as exc:
            return Try(delivered=False, failure="refused", reason=exc.message, final=True)
        except UnresolvableHost as exc:
            return _failed("unresolvable", exc.message, start)
        except TimeoutError:
            return _failed("unresolvable", f"{url.host} did not resolve within {limit:g} s", start)
        headers = {
            "Content-Type": "application/json",
            "User-Agent": USER_AGENT,
            **signed_headers(secret, msg_id, body, time.time()),
        }
        try:
            async with asyncio.timeout(limit):
                response = await send_pinned(
                    self.client, "POST", url, addresses, headers=headers, content=body
                )
                await response.aclose()
        except TimeoutError:
            return _failed("timeout", f"no answer within {limit:g} s", start)
        except httpx.TimeoutException as exc:
            return _failed("timeout", f"no answer within {limit:g} s ({type(exc).__name__})", start)
        except httpx.HTTPError as exc:
            return _failed("connect", f"{type(exc).__name__}: {exc}", start)
        seconds = time.monotonic() - start
        status = response.status_code
        if 200 <= status < 300:
            return Try(delivered=True, status=status, seconds=seconds)
        return Try(
            delivered=False,
            status=status,
            failure="status",
            reason=f"the receiver answered {status} {response.reason_phrase}".rstrip(),
            seconds=seconds,
        )


def _failed(failure: Failure, reason: str, start: float) -> Try:
    return Try(delivered=False, failure=failure, reason=reason, seconds=time.monotonic() - start)
