"""The webhooks service against a real nats-server and real HTTP receivers on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec
from nats.aio.client import Client

from loopmesh.testing.durable import SUBJECTS, connect_fast
from loopmesh.webhook import WebhookSettings, new_secret
from schemas import Webhook, encode
from schemas.events import Event, LoopEnd, LoopStart
from tests.gateway.conftest import nats_url, nc  # noqa: F401 (fixtures: provisioned)
from webhooks.service import WebhookService

SECRET = new_secret()
DOCS = Path(__file__).resolve().parents[2] / "docs" / "WEBHOOKS.md"


def settings(**changes: Any) -> WebhookSettings:
    """Loopback allowed over http, a secret, and tries seconds apart at most."""
    base = WebhookSettings(
        allow_http=True,
        allowlist=("127.0.0.1",),
        secret=SECRET,
        backoff_s=0.05,
        backoff_max_s=0.2,
        timeout_s=2.0,
        max_attempts=5,
    )
    return msgspec.structs.replace(base, **changes)


@contextlib.asynccontextmanager
async def delivering(url: str, config: WebhookSettings) -> AsyncIterator[WebhookService]:
    """The service in this process, on its own connection, until the block ends."""
    client = await connect_fast(url, name="webhooks")
    service = WebhookService(client, SUBJECTS, config)
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(service.run(stop, ready))
    waiting = asyncio.ensure_future(ready.wait())
    try:
        await asyncio.wait({task, waiting}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()
        yield service
    finally:
        waiting.cancel()
        stop.set()
        await task
        await client.close()


async def publish(client: Client, *events: Event) -> list[int]:
    """Store ``events`` as a worker does; their stream sequences."""
    js = client.jetstream()
    seqs = []
    for event in events:
        subject = SUBJECTS.event(event.tenant, event.session, event.type)
        ack = await js.publish(subject, encode(event))
        seqs.append(ack.seq)
    return seqs


def turn_events(
    turn: str, webhook: Webhook | None, *, tenant: str = "acme", session: str = "s1"
) -> tuple[LoopStart, LoopEnd]:
    ids = {"tenant": tenant, "session": session, "turn_id": turn, "ts": time.time()}
    return (
        LoopStart(**ids, model="m", webhook=webhook),
        LoopEnd(**ids, reason="task_completion", content=f"done {turn}", iterations=1),
    )


def documented_verify() -> Callable[..., bool]:
    """The ``verify`` function of docs/WEBHOOKS.md, as a receiver would paste it."""
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), re.DOTALL)
    source = next(b for b in blocks if "def verify(" in b)
    namespace: dict[str, Any] = {}
    exec(compile(source, str(DOCS), "exec"), namespace)
    return namespace["verify"]  # type: ignore[no-any-return]


async def consumer_settled(client: Client) -> bool:
    """Whether the webhooks consumer has nothing left to deliver or to settle."""
    js = client.jetstream()
    info = await js.consumer_info(SUBJECTS.events_stream, SUBJECTS.webhooks_consumer)
    return not info.num_pending and not info.num_ack_pending


async def assert_webhook_id(client: Client, webhook_id: str, seq: int) -> None:
    """``webhook-id`` names event ``seq``: ``<stored>-<seq>``, when the stream stored it
    (Unix µs; the client reads it to the µs, give or take one)."""
    stored = await client.jetstream().get_msg(SUBJECTS.events_stream, seq)
    assert stored.time is not None
    when, _, sequence = webhook_id.partition("-")
    assert sequence == str(seq), webhook_id
    assert abs(int(when) - stored.time.timestamp() * 1_000_000) <= 1, webhook_id
