"""The per-tenant NATS permissions of ``k8s/nats/tenants.conf``, on a real nats-server
started with that file: a tenant publishes only its own turns and controls, reads only
its own events, and can replay them through an ordered consumer."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client
from nats.js import api as js_api

from loopmesh.provision import provision
from loopmesh.server import NatsServer
from schemas import Subjects, Turn, definitions, encode, new_id
from schemas.events import LoopStart

CONF = Path(__file__).resolve().parents[2] / "k8s" / "nats" / "tenants.conf"
SUBJECTS = Subjects()
PASSWORDS = {"loopmesh": "svc-pw", "acme": "acme-pw", "globex": "globex-pw"}


@pytest.fixture
async def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[NatsServer]:
    monkeypatch.setenv("LOOPMESH_SERVICE_PASSWORD", PASSWORDS["loopmesh"])
    monkeypatch.setenv("ACME_PASSWORD", PASSWORDS["acme"])
    monkeypatch.setenv("GLOBEX_PASSWORD", PASSWORDS["globex"])
    async with NatsServer(tmp_path / "nats", extra_args=("-c", str(CONF))) as s:
        yield s


class Tenant:
    """A tenant's client, collecting the permission errors the server sends it."""

    def __init__(self, nc: Client, name: str) -> None:
        self.nc, self.name = nc, name
        self.errors: list[str] = []
        self.changed = asyncio.Event()

    async def violation(self, text: str, timeout: float = 10.0) -> str:
        """The first error that contains ``text`` (any case), waiting for it."""
        async with asyncio.timeout(timeout):
            while True:
                found = next((e for e in self.errors if text.lower() in e.lower()), None)
                if found:
                    return found
                self.changed.clear()
                await self.changed.wait()


async def connect(server: NatsServer, user: str) -> Tenant:
    tenant: Tenant

    async def on_error(exc: Exception) -> None:
        tenant.errors.append(str(exc))
        tenant.changed.set()

    nc = await nats.connect(
        server.url.replace("nats://", f"nats://{user}:{PASSWORDS[user]}@"),
        inbox_prefix=f"_INBOX_{user}".encode() if user != "loopmesh" else "_INBOX",
        error_cb=on_error,
        allow_reconnect=False,
    )
    tenant = Tenant(nc, user)
    return tenant


@pytest.fixture
async def service(server: NatsServer) -> AsyncIterator[Client]:
    svc = await connect(server, "loopmesh")
    await provision(svc.nc.jetstream(), definitions(SUBJECTS))
    yield svc.nc
    await svc.nc.close()


@pytest.fixture
async def acme(server: NatsServer, service: Client) -> AsyncIterator[Tenant]:
    t = await connect(server, "acme")
    yield t
    await t.nc.close()


def turn(tenant: str) -> Turn:
    return Turn(id=new_id(), tenant=tenant, session="s1", input="hi", created_at=time.time())


async def publish_events(service: Client, tenant: str, n: int) -> list[int]:
    js = service.jetstream()
    seqs = []
    for i in range(n):
        event = LoopStart(tenant=tenant, session="s1", turn_id=f"t{i}", ts=time.time())
        ack = await js.publish(SUBJECTS.event(tenant, "s1", "loop_start"), encode(event))
        seqs.append(ack.seq)
    return seqs


async def turns_of(service: Client, tenant: str) -> int:
    info = await service.jetstream().stream_info(
        SUBJECTS.turns_stream, subjects_filter=f"loopmesh.turns.{tenant}.>"
    )
    return sum((info.state.subjects or {}).values())


async def test_a_tenant_publishes_its_own_turns_and_controls(acme: Tenant, service: Client):
    ack = await acme.nc.jetstream().publish(
        SUBJECTS.turn("acme", "s1"), encode(turn("acme")), timeout=5
    )
    assert ack.stream == SUBJECTS.turns_stream
    await acme.nc.publish(SUBJECTS.control("acme", "s1"), b"{}")
    await acme.nc.flush()
    assert await turns_of(service, "acme") == 1
    assert acme.errors == []


async def test_a_tenant_cannot_publish_another_tenants_turns(acme: Tenant, service: Client):
    with pytest.raises(nats.errors.TimeoutError):  # no ack: the server dropped it
        await acme.nc.jetstream().publish(
            SUBJECTS.turn("globex", "s1"), encode(turn("globex")), timeout=1
        )
    assert "loopmesh.turns.globex.s1" in await acme.violation("Permissions Violation for Publish")
    await acme.nc.publish(SUBJECTS.control("globex", "s1"), b"{}")
    await acme.violation('Publish to "loopmesh.control.globex.s1"')
    assert await turns_of(service, "globex") == 0


async def test_a_tenant_cannot_read_another_tenants_events(acme: Tenant, service: Client):
    await acme.nc.subscribe("loopmesh.events.globex.>")
    await acme.violation('Permissions Violation for Subscription to "loopmesh.events.globex.>"')
    await acme.nc.subscribe("loopmesh.events.>")
    await acme.violation('Subscription to "loopmesh.events.>"')
    await publish_events(service, "globex", 2)
    for filter_ in ("loopmesh.events.globex.*", "loopmesh.events.>"):
        with pytest.raises(Exception):  # noqa: B017  (timeout or permission error)
            await acme.nc.jetstream(timeout=1).subscribe(
                filter_, stream=SUBJECTS.events_stream, ordered_consumer=True,
                deliver_policy=js_api.DeliverPolicy.ALL,
                config=js_api.ConsumerConfig(name=new_id()),
            )  # fmt: skip
        await acme.violation("CONSUMER.CREATE.LOOPMESH_EVENTS.")
    created = [e for e in acme.errors if "consumer.create" in e.lower()]
    assert any(e.endswith('.loopmesh.events.globex.*"') for e in created), created
    assert any(e.endswith('.loopmesh.events.>"') for e in created), created
    # nor read the stream by other API calls
    with pytest.raises(nats.errors.TimeoutError):
        await acme.nc.jetstream(timeout=1).get_msg(SUBJECTS.events_stream, 1)
    await acme.violation("$JS.API.STREAM.MSG.GET.LOOPMESH_EVENTS")
    # nor snoop on the service's inboxes
    await acme.nc.subscribe("_INBOX.>")
    await acme.violation('Subscription to "_INBOX.>"')


async def test_a_tenant_replays_its_own_events_through_an_ordered_consumer(
    acme: Tenant, service: Client
):
    await publish_events(service, "globex", 1)
    mine = await publish_events(service, "acme", 3)
    await publish_events(service, "globex", 1)
    got: asyncio.Queue = asyncio.Queue()

    async def on(msg) -> None:
        await got.put(msg.metadata.sequence.stream)

    # a consumer name makes nats-py use the filtered create subject the permissions allow
    sub = await acme.nc.jetstream().subscribe(
        "loopmesh.events.acme.>", stream=SUBJECTS.events_stream, ordered_consumer=True,
        deliver_policy=js_api.DeliverPolicy.ALL, config=js_api.ConsumerConfig(name=new_id()),
        cb=on,
    )  # fmt: skip
    seen = [await asyncio.wait_for(got.get(), 10) for _ in mine]
    assert seen == mine
    live = await publish_events(service, "acme", 1)
    assert await asyncio.wait_for(got.get(), 10) == live[0]
    await sub.unsubscribe()
    assert acme.errors == []
