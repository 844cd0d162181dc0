"""The turns stream as the loop workers' per-tenant dispatch leaves it: one durable pull
consumer per tenant, named ``turns-...``, filtered on ``<prefix>.turns.<tenant>.>``;
for tests of what reads those consumers (the exporter, KEDA's trigger, the dashboards)::

    await only_tenant_consumers(js, subjects)
    await tenant_consumer(js, subjects, "acme")                     # turns-acme
    await tenant_consumer(js, subjects, "globex", name="turns-9f3c1a")  # a hashed name
"""

from __future__ import annotations

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from loopmesh.exporter import TURNS_CONSUMER_PREFIX
from loopmesh.provision import ensure_consumer
from schemas import Subjects
from schemas.streams import ConsumerDef


async def only_tenant_consumers(js: JetStreamContext, subjects: Subjects) -> None:
    """Delete every consumer of the turns stream that is not a tenant's: a consumer of
    every turn overlaps each tenant's filter, which a work-queue stream refuses."""
    for info in await js.consumers_info(subjects.turns_stream):
        if not (info.name or "").startswith(TURNS_CONSUMER_PREFIX):
            await js.delete_consumer(subjects.turns_stream, info.name)


async def tenant_consumer(
    js: JetStreamContext, subjects: Subjects, tenant: str, *, name: str = ""
) -> str:
    """The tenant's durable consumer (``turns-<tenant>`` unless ``name``), made if absent."""
    name = name or f"{TURNS_CONSUMER_PREFIX}{tenant}"
    try:
        await js.consumer_info(subjects.turns_stream, name)
    except NotFoundError:
        await ensure_consumer(
            js,
            ConsumerDef(
                stream=subjects.turns_stream,
                durable=name,
                filter_subject=f"{subjects.prefix}.turns.{tenant}.>",
                description=f"turns of tenant {tenant}",
            ),
        )
    return name
