"""Subject builders. Every id is checked before it becomes part of a subject."""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Literal

from .ids import InvalidIdError, check_token, safe_token
from .keys import session_key
from .types import Priority

#: What each tenant's consumer on the turns stream is named with; the rest of the name
#: is no guide to the tenant (one that is no valid id gets a hash).
TENANT_CONSUMER_PREFIX = "turns-"
#: The same for each tenant's consumer of its batch turns (:data:`BATCH`).
BATCH_CONSUMER_PREFIX = "batch-"

#: The last token of a batch turn's subject: ``<prefix>.turns.<tenant>.<session>.batch``.
BATCH: Literal["batch"] = "batch"

DEFAULT_PREFIX = "loopmesh"


#: The most events streams one deployment may split its events over (``[nats] partitions``),
#: and the most turns streams (``[nats] turn_partitions``).
MAX_PARTITIONS = 64

#: The header of a probe of the server's turn mappings (:mod:`loopmesh.mappings`): a
#: publish on a turn subject that no stream stores, which loop workers do not count.
PROBE_HEADER = "Loopmesh-Probe"


@dataclass(frozen=True, slots=True)
class Subjects:
    """Subjects, stream names and bucket names under one prefix (default ``loopmesh``).

    ``partitions`` (``[nats] partitions``) splits the events over that many streams, so
    that no one stream leader carries every event of the fleet (docs/ARCHITECTURE.md,
    "Partitions"). A session's events all go to one partition, chosen by a hash of its
    tenant and session (:meth:`partition`); with more than one, an event's subject ends
    in its partition's number (``<prefix>.events.<tenant>.<session>.<type>.<partition>``)
    and partition ``k``'s stream is ``<PREFIX>_EVENTS_<k>``. With one (the default) the
    subjects and the stream are those of an unpartitioned deployment.
    """

    prefix: str = DEFAULT_PREFIX
    partitions: int = 1
    #: ``[nats] turn_partitions``: the turns streams the tenants' turns are split over.
    turn_partitions: int = 1

    def __post_init__(self) -> None:
        check_token(self.prefix, "prefix")
        for field in ("partitions", "turn_partitions"):
            count = getattr(self, field)
            if not 1 <= count <= MAX_PARTITIONS:
                raise ValueError(f"{field} must be 1 to {MAX_PARTITIONS}, not {count!r}")

    def partition(self, tenant: str, session: str) -> int:
        """The partition that holds the session's events: CRC-32 of ``tenant.session``,
        modulo :attr:`partitions` (stable across processes, versions and machines)."""
        if self.partitions == 1:
            return 0
        return zlib.crc32(f"{tenant}.{session}".encode()) % self.partitions

    def turn_partition(self, tenant: str) -> int:
        """The turns partition that holds every turn of ``tenant``: FNV-1a (32 bits) of
        the tenant token, modulo :attr:`turn_partitions`, which is what nats-server's
        ``{{partition(n,1)}}`` subject mapping computes (:attr:`turn_mappings`)."""
        if self.turn_partitions == 1:
            return 0
        return _fnv1a(tenant.encode()) % self.turn_partitions

    @property
    def turn_mappings(self) -> dict[str, str]:
        """The server's subject mappings that route each published turn to its tenant's
        partition (nats-server configuration, ``mappings``): ``<prefix>.turns.<tenant>.
        <session>[.batch]`` becomes ``<prefix>.turnp.<k>.<tenant>.<session>[.batch]``,
        which only partition ``k``'s stream takes, and which it stores under the
        subject it was published on. None for one partition."""
        if self.turn_partitions == 1:
            return {}
        head = f"{self.prefix}.turns"
        to = f"{self.prefix}.turnp.{{{{partition({self.turn_partitions},1)}}}}"
        w1, w2, w3 = (f".{{{{wildcard({n})}}}}" for n in (1, 2, 3))
        return {f"{head}.*.*": f"{to}{w1}{w2}", f"{head}.*.*.*": f"{to}{w1}{w2}{w3}"}

    def _part(self, tenant: str, session: str) -> str:
        """The subject suffix of the session's partition ("" when unpartitioned)."""
        return "" if self.partitions == 1 else f".{self.partition(tenant, session)}"

    # -- subjects -------------------------------------------------------------------

    def turn(self, tenant: str, session: str, priority: Priority = "interactive") -> str:
        """Where a turn is published: ``<prefix>.turns.<tenant>.<session>``, with
        ``.batch`` after it for a batch turn (its tenant's batch lane)."""
        lane = f".{BATCH}" if priority == BATCH else ""
        return f"{self.prefix}.turns.{session_key(tenant, session)}{lane}"

    def session_turns(self, tenant: str, session: str) -> tuple[str, str]:
        """Both lanes' subjects of a session's turns, interactive first: its turns in
        stream order are those of both, merged by sequence."""
        return self.turn(tenant, session), self.turn(tenant, session, BATCH)

    def tool(self, pool: str, server: str, tool: str) -> str:
        return (
            f"{self.prefix}.tools.{check_token(pool, 'pool')}."
            f"{check_token(server, 'server')}.{check_token(tool, 'tool')}"
        )

    def event(self, tenant: str, session: str, type: str) -> str:
        return (
            f"{self.prefix}.events.{check_token(tenant, 'tenant')}."
            f"{check_token(session, 'session')}.{check_token(type, 'event type')}"
            f"{self._part(tenant, session)}"
        )

    def control(self, tenant: str, session: str) -> str:
        return f"{self.prefix}.control.{session_key(tenant, session)}"

    # -- parsers: the tenant and session a subject names ------------------------------

    def turn_session(self, subject: str) -> tuple[str, str]:
        """``(tenant, session)`` of a turn subject; :class:`InvalidIdError` if it names none."""
        tenant, session, _ = self.turn_lane(subject)
        return tenant, session

    def lane_of(self, subject: str) -> Priority:
        """The lane whose consumer takes a subject under ``<prefix>.turns.<tenant>``
        (:meth:`lane_turns`): interactive for a tenant and a session, else batch."""
        return "interactive" if subject.count(".") == 3 else BATCH

    def turn_lane(self, subject: str) -> tuple[str, str, Priority]:
        """``(tenant, session, priority)`` of a turn subject (either lane)."""
        if subject.endswith(f".{BATCH}") and subject.count(".") == 4:
            return (*self._session_of(subject[: -len(BATCH) - 1], "turns"), BATCH)
        return (*self._session_of(subject, "turns"), "interactive")

    def control_session(self, subject: str) -> tuple[str, str]:
        """``(tenant, session)`` of a control subject; :class:`InvalidIdError` if none."""
        return self._session_of(subject, "control")

    def _session_of(self, subject: str, kind: str) -> tuple[str, str]:
        parts = subject.split(".")
        if len(parts) != 4 or parts[0] != self.prefix or parts[1] != kind:
            raise InvalidIdError(
                f"{kind} subject", subject, f"{self.prefix}.{kind}.<tenant>.<session>"
            )
        return check_token(parts[2], "tenant"), check_token(parts[3], "session")

    @property
    def limits_ask(self) -> str:
        """Requests for the fleet's LLM rate limits (``[llm.limits]``): only the limiter
        leader listens."""
        return f"{self.prefix}.limits.ask"

    @property
    def limits_settle(self) -> str:
        return f"{self.prefix}.limits.settle"

    @property
    def limits_pause(self) -> str:
        """A provider's 429 with ``Retry-After``: every loop worker listens."""
        return f"{self.prefix}.limits.pause"

    # -- wildcards for subscriptions and stream definitions ----------------------------

    def handback(self, tenant: str, priority: Priority = "interactive") -> str:
        """Where a loop worker says it handed back a turn of ``tenant`` (nak): it will
        be delivered again, and no publish announces it. A batch turn's ends in
        ``.batch``."""
        lane = f".{BATCH}" if priority == BATCH else ""
        return f"{self.prefix}.handback.{tenant}{lane}"

    @property
    def all_handbacks(self) -> str:
        return f"{self.prefix}.handback.>"

    @property
    def all_turns(self) -> str:
        """Every turn subject, as stored in a turns stream and as published."""
        return f"{self.prefix}.turns.>"

    @property
    def published_turns(self) -> str:
        """What a plain subscription hears every published turn on: :attr:`all_turns`,
        or with more than one turns partition the mapped subjects
        (``<prefix>.turnp.<k>.…``, :attr:`turn_mappings`); :meth:`stored_turn` reads
        either back."""
        if self.turn_partitions == 1:
            return self.all_turns
        return f"{self.prefix}.turnp.*.>"

    def published_turns_of(self, tenant: str) -> str:
        """Every turn subject of ``tenant`` as the server sees it after the mappings,
        which is what it checks a client's publish permission against."""
        if self.turn_partitions == 1:
            return self.tenant_turns(tenant)
        return f"{self.prefix}.turnp.{self.turn_partition(tenant)}.{tenant}.>"

    def stored_turn(self, subject: str) -> str:
        """The turn subject a published one is stored under: the subject itself, or
        without the mapping's ``turnp.<k>``."""
        if self.turn_partitions == 1:
            return subject
        parts = subject.split(".", 3)
        if len(parts) < 4 or parts[1] != "turnp":
            return subject
        return f"{parts[0]}.turns.{parts[3]}"

    @property
    def stored_turns(self) -> str:
        """What the turns stream keeps: a subject with a tenant and more after it (one
        with the tenant alone would match no tenant's consumer, and is not taken)."""
        return f"{self.prefix}.turns.*.>"

    def tenant_turns(self, tenant: str) -> str:
        """All of ``tenant``'s turns on the turns stream, both lanes (what its backlog
        counts; the filter its one consumer had before the lanes)."""
        return f"{self.prefix}.turns.{tenant}.>"

    def lane_turns(self, tenant: str, priority: Priority = "interactive") -> str:
        """The filter of ``tenant``'s consumer of one lane: ``<prefix>.turns.<tenant>.*``
        (interactive: a tenant and a session) or ``<prefix>.turns.<tenant>.*.>`` (batch:
        ``.batch`` after them, and the malformed subjects, deeper ones, which the
        worker refuses). Together they are the tenant's every subject, and they never
        overlap, as a work-queue stream requires. ``tenant`` is a subject token, not
        necessarily a valid tenant id: one that is not is refused turn by turn."""
        if priority == BATCH:
            return f"{self.prefix}.turns.{tenant}.*.>"
        return f"{self.prefix}.turns.{tenant}.*"

    @property
    def all_tools(self) -> str:
        return f"{self.prefix}.tools.>"

    def pool_tools(self, pool: str) -> str:
        return f"{self.prefix}.tools.{check_token(pool, 'pool')}.>"

    @property
    def all_events(self) -> str:
        """Every event of every partition (a core subscription's subject)."""
        return f"{self.prefix}.events.>"

    def partition_events(self, partition: int) -> str:
        """Every event of one partition: the subjects of its stream."""
        if self.partitions == 1:
            return self.all_events
        return f"{self.prefix}.events.*.*.*.{self._check_partition(partition)}"

    def session_events(self, tenant: str, session: str) -> str:
        return (
            f"{self.prefix}.events.{check_token(tenant, 'tenant')}."
            f"{check_token(session, 'session')}.*{self._part(tenant, session)}"
        )

    def tenant_events(self, tenant: str, partition: int = 0) -> str:
        """Every event of one tenant in one partition."""
        head = f"{self.prefix}.events.{check_token(tenant, 'tenant')}"
        if self.partitions == 1:
            return f"{head}.>"
        return f"{head}.*.*.{self._check_partition(partition)}"

    def events_of_type(self, type: str, partition: int = 0) -> str:
        """Every session's events of one ``type`` in one partition (a consumer's filter)."""
        tail = "" if self.partitions == 1 else f".{self._check_partition(partition)}"
        return f"{self.prefix}.events.*.*.{check_token(type, 'event type')}{tail}"

    def _check_partition(self, partition: int) -> int:
        if not 0 <= partition < self.partitions:
            raise ValueError(f"partition {partition!r} is not one of 0..{self.partitions - 1}")
        return partition

    @property
    def all_control(self) -> str:
        return f"{self.prefix}.control.>"

    def audit(self, tenant: str) -> str:
        """Where the tenant's audit records go (:mod:`schemas.audit`: a session erased or
        expired), kept in :attr:`audit_stream`."""
        return f"{self.prefix}.audit.{check_token(tenant, 'tenant')}"

    @property
    def all_audit(self) -> str:
        return f"{self.prefix}.audit.*"

    def deadletter(self, stream: str) -> str:
        """Where the dead-letter record of a message of ``stream`` is kept."""
        return f"{self.prefix}.deadletter.{check_token(stream, 'stream')}"

    @property
    def all_deadletter(self) -> str:
        return f"{self.prefix}.deadletter.>"

    @property
    def turn_advisories(self) -> tuple[str, ...]:
        """The advisories nats-server publishes when the turns consumer gives up on a
        turn (``max_deliver`` reached) or a turn is terminated; kept in
        :attr:`advisories_stream` so none is lost while no loop worker listens."""
        return tuple(
            f"$JS.EVENT.ADVISORY.CONSUMER.{kind}.{stream}.*"  # every tenant's consumer
            for stream in self.turns_streams
            for kind in ("MAX_DELIVERIES", "MSG_TERMINATED")
        )

    # -- names of streams, consumers and buckets ------------------------------------

    def _name(self, suffix: str) -> str:
        return f"{self.prefix.upper().replace('-', '_')}_{suffix}"

    @property
    def turns_stream(self) -> str:
        """The turns stream of a deployment with one turns partition; partition ``k``'s
        is :meth:`turns_partition_stream`, a tenant's :meth:`turns_stream_of`."""
        return self._name("TURNS")

    def turns_partition_stream(self, partition: int) -> str:
        if self.turn_partitions == 1:
            return self.turns_stream
        if not 0 <= partition < self.turn_partitions:
            raise ValueError(
                f"turn partition {partition!r} is not one of 0..{self.turn_partitions - 1}"
            )
        return f"{self.turns_stream}_{partition}"

    def turns_stream_of(self, tenant: str) -> str:
        """The stream that holds the tenant's turns, both lanes, and its consumers."""
        return self.turns_partition_stream(self.turn_partition(tenant))

    @property
    def turns_streams(self) -> tuple[str, ...]:
        """Every turns stream, partition 0 first."""
        return tuple(self.turns_partition_stream(k) for k in range(self.turn_partitions))

    def turns_partition_subjects(self, partition: int) -> str:
        """What partition ``partition``'s turns stream takes: :attr:`stored_turns`, or
        with several partitions the mapped subjects of its tenants (``<prefix>.turnp.
        <partition>.>``), which it stores as ``<prefix>.turns.>``."""
        if self.turn_partitions == 1:
            return self.stored_turns
        return f"{self.prefix}.turnp.{partition}.>"

    @property
    def tools_stream(self) -> str:
        return self._name("TOOLS")

    @property
    def events_stream(self) -> str:
        """The events stream of an unpartitioned deployment; partition ``k``'s is
        :meth:`partition_stream`."""
        return self._name("EVENTS")

    def partition_stream(self, partition: int) -> str:
        if self.partitions == 1:
            return self.events_stream
        return f"{self.events_stream}_{self._check_partition(partition)}"

    def events_stream_of(self, tenant: str, session: str) -> str:
        """The stream that holds the session's events."""
        return self.partition_stream(self.partition(tenant, session))

    @property
    def events_streams(self) -> tuple[str, ...]:
        """Every events stream, partition 0 first."""
        return tuple(self.partition_stream(k) for k in range(self.partitions))

    @property
    def deadletter_stream(self) -> str:
        return self._name("DEADLETTER")

    @staticmethod
    def tenant_consumer(tenant: str, priority: Priority = "interactive") -> str:
        """The durable consumer of ``tenant``'s turns of one lane (:mod:`loop_worker.share`):
        ``turns-<tenant>`` (interactive) or ``batch-<tenant>``, or for a subject token that
        is no valid id, a name made safe with a hash of it. Read a consumer's tenant from
        its filter, never its name."""
        prefix = BATCH_CONSUMER_PREFIX if priority == BATCH else TENANT_CONSUMER_PREFIX
        return f"{prefix}{safe_token(tenant)}"

    def tenant_of_filter(self, filter_subject: str) -> str | None:
        """The tenant a consumer's filter (:meth:`lane_turns`, or the one-lane
        :meth:`tenant_turns` of before) reads, or None."""
        found = self.lane_of_filter(filter_subject)
        return found[0] if found is not None else None

    def lane_of_filter(self, filter_subject: str) -> tuple[str, Priority | None] | None:
        """``(tenant, priority)`` of a consumer's filter (:meth:`lane_turns`): priority
        ``None`` for the filter of both lanes (:meth:`tenant_turns`), which a tenant's
        interactive consumer had before the lanes and is narrowed from. None for a filter
        of no tenant's consumer."""
        head = f"{self.prefix}.turns."
        if not filter_subject.startswith(head):
            return None
        rest = filter_subject[len(head) :]
        lanes: tuple[tuple[str, Priority | None], ...] = (
            (".*", "interactive"), (".*.>", BATCH), (".>", None)
        )  # fmt: skip
        for tail, priority in lanes:
            tenant = rest.removesuffix(tail)
            if tenant != rest and tenant and "." not in tenant and tenant not in ("*", ">"):
                return tenant, priority
        return None

    @property
    def legacy_turns_consumer(self) -> str:
        """The one consumer all loop workers once shared: it overlaps every tenant's, so
        provisioning removes it (a work-queue stream allows no overlap)."""
        return "loop-workers"

    @property
    def audit_stream(self) -> str:
        return self._name("AUDIT")

    @property
    def advisories_stream(self) -> str:
        return self._name("ADVISORIES")

    @property
    def advisories_consumer(self) -> str:
        return "deadletter"

    @property
    def webhooks_consumer(self) -> str:
        return "webhooks"

    def pool_consumer(self, pool: str) -> str:
        return f"pool-{check_token(pool, 'pool')}"

    @property
    def sessions_bucket(self) -> str:
        return f"{self.prefix}-sessions"

    @property
    def leases_bucket(self) -> str:
        return f"{self.prefix}-leases"

    @property
    def effects_bucket(self) -> str:
        return f"{self.prefix}-effects"

    @property
    def catalog_bucket(self) -> str:
        return f"{self.prefix}-catalog"

    @property
    def control_bucket(self) -> str:
        return f"{self.prefix}-control"

    @property
    def usage_bucket(self) -> str:
        return f"{self.prefix}-usage"

    @property
    def embeddings_bucket(self) -> str:
        return f"{self.prefix}-embeddings"

    @property
    def agents_bucket(self) -> str:
        return f"{self.prefix}-agents"

    @property
    def webhooks_bucket(self) -> str:
        return f"{self.prefix}-webhooks"

    @property
    def schedules_bucket(self) -> str:
        return f"{self.prefix}-schedules"

    @property
    def a2a_tasks_bucket(self) -> str:
        return f"{self.prefix}-a2a-tasks"

    @property
    def a2a_push_bucket(self) -> str:
        return f"{self.prefix}-a2a-push"

    @property
    def limits_bucket(self) -> str:
        return f"{self.prefix}-limits"

    @property
    def memory_bucket(self) -> str:
        return f"{self.prefix}-memory"


def _fnv1a(data: bytes) -> int:
    """32-bit FNV-1a, the hash of nats-server's ``partition()`` subject mapping."""
    h = 0x811C9DC5
    for byte in data:
        h = ((h ^ byte) * 0x01000193) & 0xFFFFFFFF
    return h
