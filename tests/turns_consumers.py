"""A tenant's turns consumer under a name of the test's choosing, for tests of what
reads those consumers (the exporter, KEDA's trigger, the dashboards): they must find the
tenant in the consumer's filter, never in its name::

    await tenant_consumer(js, subjects, "globex", name="turns-9f3c1a")  # a hashed name

(a consumer named as the loop workers name it: ``loopmesh.testing.durable.tenant_consumer_of``)
"""

from __future__ import annotations

from nats.js import JetStreamContext

from loopmesh.provision import ensure_consumer
from schemas import Subjects
from schemas.streams import ConsumerDef


async def tenant_consumer(
    js: JetStreamContext, subjects: Subjects, tenant: str, *, name: str = ""
) -> str:
    """The tenant's durable consumer (its usual name unless ``name``), made if absent."""
    name = name or subjects.tenant_consumer(tenant)
    await ensure_consumer(
        js,
        ConsumerDef(
            stream=subjects.turns_stream,
            durable=name,
            filter_subject=subjects.tenant_turns(tenant),
            description=f"the turns of tenant {tenant}",
        ),
    )
    return name
