"""Streams, consumers and KV buckets as data. The runtime provisions them."""

from __future__ import annotations

from typing import Literal

import msgspec

from .subjects import Subjects
from .types import Priority
from .webhook import WEBHOOK_EVENTS

#: The turns consumers' AckWait and the session leases' TTL by default: a loop worker that
#: dies (SIGKILL, a lost node) leaves its turns to another worker this long after its last
#: in-progress ack and lease renewal, each sent every third of it. A live worker keeps its
#: turns however long they run; one frozen longer than this may lose them, and writes
#: nothing for them after (docs/ARCHITECTURE.md, "Recovery").
TURN_ACK_WAIT_S = 2.0
LEASE_TTL_S = 2.0


class StreamDef(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    subjects: tuple[str, ...]
    retention: Literal["limits", "workqueue", "interest"] = "limits"
    storage: Literal["file", "memory"] = "file"
    max_age_s: float = 0.0  # 0 means forever
    max_bytes: int = -1  # -1 means no limit; past it the oldest messages go
    duplicate_window_s: float = 120.0
    max_msg_size: int = -1
    replicas: int = 1
    description: str = ""
    #: ``(source, destination)``: the subject a message is stored under, rewritten from
    #: the one it was published on (nats-server 2.10+).
    subject_transform: tuple[str, str] | None = None


class ConsumerDef(msgspec.Struct, frozen=True, kw_only=True):
    stream: str
    durable: str
    filter_subject: str | None = None
    #: Several filters at once (nats-server 2.10+), instead of ``filter_subject``.
    filter_subjects: tuple[str, ...] = ()
    ack_wait_s: float = 30.0
    max_deliver: int = -1
    max_ack_pending: int = 10_000
    #: Where a new consumer starts: the stream's first message, or its next one.
    deliver_policy: Literal["all", "new"] = "all"
    #: The server removes the consumer after this long unused (0: never).
    inactive_s: float = 0.0
    description: str = ""


class KVDef(msgspec.Struct, frozen=True, kw_only=True):
    bucket: str
    ttl_s: float = 0.0  # 0 means keys never expire
    history: int = 1
    max_value_size: int = -1
    replicas: int = 1
    description: str = ""


class Definitions(msgspec.Struct, frozen=True, kw_only=True):
    streams: tuple[StreamDef, ...]
    consumers: tuple[ConsumerDef, ...]
    buckets: tuple[KVDef, ...]
    #: ``(stream, consumer)`` pairs provisioning deletes where they exist.
    retired: tuple[tuple[str, str], ...] = ()


def definitions(
    subjects: Subjects | None = None,
    *,
    events_max_age_s: float = 7 * 24 * 3600.0,
    events_max_bytes: int = -1,
    sessions_ttl_s: float = 0.0,
    deadletter_max_age_s: float = 30 * 24 * 3600.0,
    duplicate_window_s: float = 120.0,
    lease_ttl_s: float = LEASE_TTL_S,
    effects_ttl_s: float = 24 * 3600.0,
    catalog_ttl_s: float = 30.0,
    embeddings_ttl_s: float = 30 * 24 * 3600.0,
    audit_max_age_s: float = 365 * 24 * 3600.0,
    replicas: int = 1,
) -> Definitions:
    """Everything loopmesh needs on a NATS server, for one prefix.

    Pool consumers are not listed: each tool worker provisions its own pool's
    consumer with :func:`pool_consumer`.
    """
    s = subjects or Subjects()
    return Definitions(
        streams=(
            *turns_streams(s, duplicate_window_s, replicas),
            StreamDef(
                name=s.tools_stream,
                subjects=(s.all_tools,),
                retention="workqueue",
                duplicate_window_s=duplicate_window_s,
                replicas=replicas,
                description="tool-call requests; Nats-Msg-Id is the call id",
            ),
            *events_streams(s, events_max_age_s, events_max_bytes, duplicate_window_s, replicas),
            StreamDef(
                name=s.deadletter_stream,
                subjects=(s.all_deadletter,),
                retention="limits",
                max_age_s=deadletter_max_age_s,
                replicas=replicas,
                description="messages given up on, with the reason in their headers",
            ),
            advisories_stream(s, max_age_s=deadletter_max_age_s, replicas=replicas),
            audit_stream(s, max_age_s=audit_max_age_s, replicas=replicas),
        ),
        retired=retired_consumers(s),
        consumers=(
            advisories_consumer(s),
            *webhooks_consumers(s),
        ),
        buckets=(
            KVDef(
                bucket=s.sessions_bucket,
                ttl_s=sessions_ttl_s,
                history=1,
                replicas=replicas,
                description="session snapshots",
            ),
            KVDef(
                bucket=s.leases_bucket,
                ttl_s=lease_ttl_s,
                replicas=replicas,
                description="one loop worker per session",
            ),
            KVDef(
                bucket=s.effects_bucket,
                ttl_s=effects_ttl_s,
                replicas=replicas,
                description="finished tool calls by call id",
            ),
            KVDef(
                bucket=s.catalog_bucket,
                ttl_s=catalog_ttl_s,
                replicas=replicas,
                description="tool specs by <server>.<tool>; live workers refresh them",
            ),
            KVDef(
                bucket=s.control_bucket,
                ttl_s=effects_ttl_s,
                replicas=replicas,
                description="cancel/pause/approval state by session",
            ),
            embeddings_bucket(s, ttl_s=embeddings_ttl_s, replicas=replicas),
            KVDef(
                bucket=s.usage_bucket,
                ttl_s=USAGE_TTL_S,
                replicas=replicas,
                description="LLM usage by <tenant>.<UTC day>, counted from the events",
            ),
            agents_bucket(s, replicas=replicas),
            KVDef(
                bucket=s.webhooks_bucket,
                ttl_s=events_max_age_s,
                replicas=replicas,
                description="the webhook of each turn (null: none), by <tenant>.<session>.<turn>",
            ),
            schedules_bucket(s, replicas=replicas),
            limits_bucket(s, replicas=replicas),
            *a2a_buckets(s, ttl_s=events_max_age_s, replicas=replicas),
            memory_bucket(s, replicas=replicas),
        ),
    )


def memory_bucket(subjects: Subjects, *, replicas: int = 1) -> KVDef:
    """Agents' memories across sessions ([loop.memory]); they never expire by age."""
    return KVDef(
        bucket=subjects.memory_bucket,
        replicas=replicas,
        description="agents' memories by <tenant>.<user|agent>.<name>.<id>",
    )


def a2a_buckets(subjects: Subjects, *, ttl_s: float, replicas: int = 1) -> tuple[KVDef, ...]:
    """The gateway's A2A tasks (key ``<tenant>.<task id>``) and their push-notification
    configurations (key ``<task id>``). A task lives as long as its turn's events
    (``ttl_s``: the events stream's max age), so it can be folded forward from them."""
    return (
        KVDef(
            bucket=subjects.a2a_tasks_bucket,
            ttl_s=ttl_s,
            replicas=replicas,
            description="A2A tasks by <tenant>.<task id>: the state of a turn as A2A shows it",
        ),
        KVDef(
            bucket=subjects.a2a_push_bucket,
            ttl_s=ttl_s,
            replicas=replicas,
            description="A2A push-notification configurations by task id",
        ),
    )


#: How long a day of usage is kept (``GET /v1/usage`` reaches back this far).
USAGE_TTL_S = 40 * 24 * 3600.0


def agents_bucket(subjects: Subjects, *, replicas: int = 1) -> KVDef:
    """The named agents' definitions (:class:`schemas.agents.AgentSpec`) by name: written
    by provisioning, watched by loop workers, read by gateways. Keys never expire; the
    last few revisions of each are kept, so what an earlier turn ran can be read back."""
    return KVDef(
        bucket=subjects.agents_bucket,
        history=AGENTS_HISTORY,
        replicas=replicas,
        description="named agents' definitions by name",
    )


#: Revisions of each agent's definition that the agents bucket keeps.
AGENTS_HISTORY = 5


def schedules_bucket(subjects: Subjects, *, replicas: int = 1) -> KVDef:
    """The schedules (:mod:`schemas.schedules`): each one under ``<tenant>.<id>``, and
    what the schedulers keep of it under ``<tenant>.<id>.state``. Keys never expire."""
    return KVDef(
        bucket=subjects.schedules_bucket,
        replicas=replicas,
        description="schedules by <tenant>.<id>, their runs by <tenant>.<id>.state",
    )


def limits_bucket(subjects: Subjects, *, replicas: int = 1) -> KVDef:
    """The fleet's LLM rate limits: the limiter leader's key, its hand-over state, and
    each model's pause (a provider's ``Retry-After``). Keys never expire: the leader's
    is renewed with a revision check and taken over when it stops changing."""
    return KVDef(
        bucket=subjects.limits_bucket,
        history=1,
        replicas=replicas,
        description="LLM rate limits: leader, hand-over state, pauses",
    )


def embeddings_bucket(
    subjects: Subjects, *, ttl_s: float = 30 * 24 * 3600.0, replicas: int = 1
) -> KVDef:
    """The tool pre-filter's embedding cache, shared by the loop workers."""
    return KVDef(
        bucket=subjects.embeddings_bucket,
        ttl_s=ttl_s,
        replicas=replicas,
        description="tool-text embeddings by <model hash>.<text hash> (the tool pre-filter)",
    )


def pool_consumer(subjects: Subjects, pool: str, *, ack_wait_s: float = 30.0) -> ConsumerDef:
    """The durable pull consumer that the workers of one tool pool share."""
    return ConsumerDef(
        stream=subjects.tools_stream,
        durable=subjects.pool_consumer(pool),
        filter_subject=subjects.pool_tools(pool),
        ack_wait_s=ack_wait_s,
        description=f"tool pool {pool}",
    )


def retired_consumers(s: Subjects) -> tuple[tuple[str, str], ...]:
    """``(stream, consumer)`` pairs provisioning deletes: the one consumer every loop
    worker once shared, on the turns stream of one partition (only it had one)."""
    return ((s.turns_stream, s.legacy_turns_consumer),) if s.turn_partitions == 1 else ()


def turns_streams(
    s: Subjects, duplicate_window_s: float = 120.0, replicas: int = 1
) -> tuple[StreamDef, ...]:
    """The turns stream, or one per turns partition (``[nats] turn_partitions``). A
    partition's stream takes the subjects the server's mapping gives its tenants' turns
    (:attr:`Subjects.turn_mappings`) and stores each under the subject it was published
    on, so that consumers, order lookups and purges read ``<prefix>.turns.…`` in each."""
    if s.turn_partitions == 1:
        return (
            StreamDef(
                name=s.turns_stream,
                subjects=(s.stored_turns,),
                retention="workqueue",
                duplicate_window_s=duplicate_window_s,
                replicas=replicas,
                description="user turns; Nats-Msg-Id is the turn id",
            ),
        )
    return tuple(
        StreamDef(
            name=s.turns_partition_stream(k),
            subjects=(s.turns_partition_subjects(k),),
            subject_transform=(s.turns_partition_subjects(k), s.all_turns),
            retention="workqueue",
            duplicate_window_s=duplicate_window_s,
            replicas=replicas,
            description=f"user turns of turns partition {k}; Nats-Msg-Id is the turn id",
        )
        for k in range(s.turn_partitions)
    )


def tenant_consumer(
    subjects: Subjects,
    tenant: str,
    *,
    ack_wait_s: float,
    max_deliver: int,
    max_active: int = 0,
    inactive_s: float = 3600.0,
    priority: Priority = "interactive",
) -> ConsumerDef:
    """The durable consumer of ``tenant``'s turns of one lane, which the loop workers
    make when they first see one of its turns (:mod:`loop_worker.share`). ``max_active``
    (0: no limit) caps the turns of the lane the whole fleet holds at once; an idle
    lane's consumer is removed after ``inactive_s`` and made again at its next turn."""
    return ConsumerDef(
        stream=subjects.turns_stream_of(tenant),
        durable=subjects.tenant_consumer(tenant, priority),
        filter_subject=subjects.lane_turns(tenant, priority),
        ack_wait_s=ack_wait_s,
        max_deliver=max_deliver,
        max_ack_pending=max_active or -1,
        inactive_s=inactive_s,
        description=f"the {priority} turns of tenant {tenant}",
    )


def advisories_stream(
    subjects: Subjects, *, max_age_s: float = 30 * 24 * 3600.0, replicas: int = 1
) -> StreamDef:
    """The stream that keeps the turns consumer's give-up advisories until a loop worker
    has dead-lettered their turns (:attr:`Subjects.turn_advisories`)."""
    return StreamDef(
        name=subjects.advisories_stream,
        subjects=subjects.turn_advisories,
        retention="workqueue",
        max_age_s=max_age_s,
        replicas=replicas,
        description="max-deliveries and terminated advisories of turns, until dead-lettered",
    )


def audit_stream(
    subjects: Subjects, *, max_age_s: float = 365 * 24 * 3600.0, replicas: int = 1
) -> StreamDef:
    """Each tenant's audit records (:mod:`schemas.audit`) on ``<prefix>.audit.<tenant>``:
    what was erased or expired, and by whom. They name sessions, never their content."""
    return StreamDef(
        name=subjects.audit_stream,
        subjects=(subjects.all_audit,),
        retention="limits",
        max_age_s=max_age_s,
        replicas=replicas,
        description="audit records by tenant: sessions erased or expired",
    )


def advisories_consumer(subjects: Subjects) -> ConsumerDef:
    """The durable consumer through which loop workers take those advisories."""
    return ConsumerDef(
        stream=subjects.advisories_stream,
        durable=subjects.advisories_consumer,
        ack_wait_s=30.0,
        description="loop workers dead-letter the turns these advisories name",
    )


#: How long a webhook delivery may take before JetStream hands its event to another try:
#: above the longest request ``[webhooks] timeout_s`` allows, with room for the outcome.
WEBHOOKS_ACK_WAIT_S = 120.0


def events_streams(
    s: Subjects, max_age_s: float, max_bytes: int, duplicate_window_s: float, replicas: int
) -> tuple[StreamDef, ...]:
    """The events streams, one per partition (:attr:`Subjects.partitions`). ``max_bytes``
    (``-1``: no limit) is for all of them together, shared out evenly."""
    n = s.partitions
    each = max_bytes if max_bytes < 0 else max(1, max_bytes // n)
    return tuple(
        StreamDef(
            name=s.partition_stream(k),
            subjects=(s.partition_events(k),),
            retention="limits",
            max_age_s=max_age_s,
            max_bytes=each,
            duplicate_window_s=duplicate_window_s,
            replicas=replicas,
            description="every event of every turn" + ("" if n == 1 else f", partition {k} of {n}"),
        )
        for k in range(n)
    )


def webhooks_consumers(subjects: Subjects) -> tuple[ConsumerDef, ...]:
    """The webhooks service's durable consumers, one per events stream
    (:func:`webhooks_consumer`)."""
    return tuple(webhooks_consumer(subjects, k) for k in range(subjects.partitions))


def webhooks_consumer(subjects: Subjects, partition: int = 0) -> ConsumerDef:
    """The webhooks service's durable consumer on one events stream: the event types a
    webhook may ask for (:data:`schemas.webhook.WEBHOOK_EVENTS`), from the events
    published after it was made (an existing deployment does not replay its history to
    receivers)."""
    return ConsumerDef(
        stream=subjects.partition_stream(partition),
        durable=subjects.webhooks_consumer,
        filter_subjects=tuple(subjects.events_of_type(t, partition) for t in WEBHOOK_EVENTS),
        ack_wait_s=WEBHOOKS_ACK_WAIT_S,
        max_ack_pending=20_000,
        deliver_policy="new",
        description="the webhooks service delivers turns' events to their webhooks",
    )
