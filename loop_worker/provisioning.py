"""What a loop worker makes in NATS at start (``[loop_worker] provision``), beside the
streams and buckets every service provisions: the dead-letter and advisories streams,
the leases, agents, schedules and memory buckets, and the limits and embeddings
buckets when their features are on. Each tenant's turns consumers are made at its
first turn (:mod:`.share`); the one shared consumer they replace is deleted here, since
it would overlap them all."""

from __future__ import annotations

from nats.js import JetStreamContext

from loopmesh.provision import ensure_bucket, ensure_consumer, ensure_stream, retire_consumer
from schemas import KVDef, StreamDef, Subjects
from schemas.streams import (
    advisories_consumer,
    advisories_stream,
    agents_bucket,
    embeddings_bucket,
    limits_bucket,
    memory_bucket,
    retired_consumers,
    schedules_bucket,
)

from .config import ServiceSettings

_DEADLETTER_AGE_S = 30 * 24 * 3600.0


async def provision(
    js: JetStreamContext,
    subjects: Subjects,
    settings: ServiceSettings,
    replicas: int,
    msg_ttl: bool,
    *,
    limits: bool,
    embeddings: bool,
) -> list[str]:
    """Make or update what the loop worker needs; what was done, a line each (nothing
    for what was already as it should be)."""
    done = [await retire_consumer(js, *retired) for retired in retired_consumers(subjects)]
    deadletter = StreamDef(
        name=subjects.deadletter_stream,
        subjects=(subjects.all_deadletter,),
        max_age_s=_DEADLETTER_AGE_S,
        replicas=replicas,
        description="messages given up on, with the reason in their headers",
    )
    done.append(await ensure_stream(js, deadletter))
    done.append(await ensure_stream(js, advisories_stream(subjects, replicas=replicas)))
    done.append(await ensure_consumer(js, advisories_consumer(subjects)))
    leases = KVDef(
        bucket=subjects.leases_bucket,
        ttl_s=settings.lease_ttl_s,
        replicas=replicas,
        description="one loop worker per session",
    )
    buckets = [
        leases,
        agents_bucket(subjects, replicas=replicas),
        schedules_bucket(subjects, replicas=replicas),
        memory_bucket(subjects, replicas=replicas),
    ]
    if limits:
        buckets.append(limits_bucket(subjects, replicas=replicas))
    if embeddings:
        buckets.append(embeddings_bucket(subjects, replicas=replicas))
    for bucket in buckets:
        done.append(await ensure_bucket(js, bucket, msg_ttl=msg_ttl))
    return [line for action in done for line in action.split("\n") if line]
