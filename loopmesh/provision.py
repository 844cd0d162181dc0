"""Provisioning: make the NATS server hold the streams, consumers and buckets of
:mod:`schemas.streams`, idempotently.

Each ``ensure_*`` creates what is missing, applies safe changes (max age, size limit
or TTL, duplicate window, description, message size, replicas, ack wait, delivery limits) and
returns what it did ("" when nothing changed). A change that would lose data —
another retention policy or storage type, dropping subjects that hold messages, a
shorter KV history, turning a pull consumer into something else — is refused with
:class:`~loopmesh.errors.ProvisionError`, and the server is left untouched::

    actions = await provision(nc.jetstream(), definitions(Subjects("loopmesh")))
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.errors import APIError, NotFoundError

from schemas.agents import AgentSpec
from schemas.streams import ConsumerDef, Definitions, KVDef, StreamDef, definitions
from schemas.subjects import MAX_PARTITIONS, Subjects

from .agents import apply_agents
from .errors import ProvisionError
from .jetstream import retry
from .mappings import check_turn_partitions
from .settings import NatsSettings

_RETENTION = {
    "limits": js_api.RetentionPolicy.LIMITS,
    "workqueue": js_api.RetentionPolicy.WORK_QUEUE,
    "interest": js_api.RetentionPolicy.INTEREST,
}
_STORAGE = {"file": js_api.StorageType.FILE, "memory": js_api.StorageType.MEMORY}
_DELIVER = {"all": js_api.DeliverPolicy.ALL, "new": js_api.DeliverPolicy.NEW}
_KV_DUPLICATE_WINDOW_S = 120.0

log = logging.getLogger("loopmesh.provision")

#: nats-server's "no suitable peers for placement": the cluster has not heard from as
#: many JetStream servers as the replicas asked for. It passes when the cluster has just
#: started or a node is restarting (a rolling upgrade), so a create or update waits for
#: it up to ``placement_wait_s`` (:data:`PLACEMENT_WAIT_S`); one that never passes (a
#: cluster smaller than the replicas) is then refused with that said.
NO_PEERS_ERR_CODE = 10005
PLACEMENT_WAIT_S = 30.0

#: Headers of a KV put that outlives the bucket's TTL (per-message TTL, nats-server 2.11+;
#: every bucket allows it, see :func:`ensure_bucket`).
PIN_HEADERS = {"Nats-TTL": "never"}


def has_msg_ttl(nc: Client) -> bool:
    """Whether the connected nats-server has per-message TTL (2.11 and newer). An older
    one drops ``allow_msg_ttl`` from a stream's config, so asking for it would look like
    a change on every start."""
    version = nc.connected_server_version
    return (version.major, version.minor) >= (2, 11)


async def provision(
    js: JetStreamContext,
    defs: Definitions,
    *,
    msg_ttl: bool = True,
    placement_wait_s: float = PLACEMENT_WAIT_S,
) -> list[str]:
    """Ensure every stream, consumer and bucket of ``defs``; return what was done."""
    wait = placement_wait_s
    actions = [await ensure_stream(js, s, placement_wait_s=wait) for s in defs.streams]
    actions += [await retire_consumer(js, stream, name) for stream, name in defs.retired]
    actions += [await ensure_consumer(js, c) for c in defs.consumers]
    actions += [
        await ensure_bucket(js, b, msg_ttl=msg_ttl, placement_wait_s=wait) for b in defs.buckets
    ]
    return [a for a in actions if a]


async def provision_all(
    nc: Client,
    settings: NatsSettings,
    *,
    agents: Sequence[AgentSpec] | None = None,
    placement_wait_s: float = PLACEMENT_WAIT_S,
) -> list[str]:
    """Provision everything loopmesh needs under ``settings.prefix``. With ``agents``
    (a configuration's ``[[agents]]``, checked), the agents bucket is made to hold
    exactly them (:func:`loopmesh.agents.apply_agents`); ``None`` leaves it as it is."""
    subjects = settings.subjects
    js = nc.jetstream()
    await check_partitions(js, subjects)
    defs = definitions(
        subjects,
        events_max_age_s=settings.events_max_age_s,
        events_max_bytes=settings.events_max_bytes,
        sessions_ttl_s=settings.sessions_ttl_s,
        replicas=settings.replicas,
    )
    actions = await provision(js, defs, msg_ttl=has_msg_ttl(nc), placement_wait_s=placement_wait_s)
    await check_turn_partitions(nc, subjects)
    if agents is not None:
        actions += await apply_agents(js, subjects, agents)
    return actions


async def events_partitions(js: JetStreamContext, subjects: Subjects) -> int | None:
    """How many partitions the server's events streams are for (``None``: there are none
    yet). Provisioning keeps them numbered from 0 with no gap (:func:`check_partitions`)."""
    if await _stream_info(js, subjects.events_stream) is not None:
        return 1
    found = 0
    while (
        found < MAX_PARTITIONS
        and await _stream_info(js, f"{subjects.events_stream}_{found}") is not None
    ):
        found += 1
    return found or None


async def check_partitions(js: JetStreamContext, subjects: Subjects) -> None:
    """Refuse a partition count (``[nats] partitions``) other than the one the server's
    events streams were made for: the sessions would hash to other streams, and their
    events would be looked for where they are not. No events streams yet is fine."""
    found = await events_partitions(js, subjects)
    if found is None or found == subjects.partitions:
        return
    held = Subjects(subjects.prefix, found).events_streams
    raise ProvisionError(
        subjects.events_stream,
        f"[nats] partitions is {subjects.partitions}, but the server keeps the events in "
        f"{found} partition{'s' if found > 1 else ''} ({', '.join(held)}): set "
        f"partitions = {found}, or delete those streams (their events are lost) to "
        "start over with another count",
    )


async def ensure_stream(
    js: JetStreamContext, s: StreamDef, *, placement_wait_s: float = PLACEMENT_WAIT_S
) -> str:
    # The server refuses a duplicate window longer than the stream keeps messages.
    window = min(s.duplicate_window_s, s.max_age_s) if s.max_age_s else s.duplicate_window_s
    want: dict[str, Any] = {
        "subjects": list(s.subjects),
        "max_age": s.max_age_s,
        "max_bytes": s.max_bytes,
        "discard": js_api.DiscardPolicy.OLD,
        "duplicate_window": window,
        "max_msg_size": s.max_msg_size,
        "num_replicas": s.replicas,
        "description": s.description or None,
        "subject_transform": js_api.SubjectTransform(*s.subject_transform)
        if s.subject_transform
        else None,
    }
    retention, storage = _RETENTION[s.retention], _STORAGE[s.storage]
    info = await _stream_info(js, s.name)
    if info is None:
        config = js_api.StreamConfig(name=s.name, retention=retention, storage=storage, **want)
        await _placed(
            f"create stream {s.name}", lambda: js.add_stream(config), s.replicas, placement_wait_s
        )
        return f"created stream {s.name}"
    have = info.config
    if have.retention != retention:
        raise ProvisionError(
            s.name,
            f"stream {s.name} has {_v(have.retention)} retention, the definition wants "
            f"{_v(retention)}: changing it would lose the stream's messages "
            f"({info.state.messages}); migrate or delete the stream by hand",
        )
    if have.storage != storage:
        raise ProvisionError(
            s.name,
            f"stream {s.name} has {_v(have.storage)} storage, the definition wants "
            f"{_v(storage)}: changing it would lose the stream's messages "
            f"({info.state.messages}); migrate or delete the stream by hand",
        )
    for dropped in sorted(set(have.subjects or ()) - set(s.subjects)):
        held = await _messages_on(js, s.name, dropped)
        if held:
            raise ProvisionError(
                s.name,
                f"stream {s.name} would stop covering subject {dropped!r}, which holds "
                f"{held} messages that would become unreachable; purge them first",
            )
    changes = _diff(have, want)
    if not changes:
        return ""
    update = have.evolve(**want)
    await _placed(
        f"update stream {s.name}", lambda: js.update_stream(update), s.replicas, placement_wait_s
    )
    return f"updated stream {s.name} ({changes})"


async def ensure_consumer(js: JetStreamContext, c: ConsumerDef) -> str:
    """A durable pull consumer with explicit ack. Each request is retried through a
    reconnect or a JetStream election (:func:`~loopmesh.retry.retry`): a process that
    starts while its servers do waits for them instead of exiting."""
    want: dict[str, Any] = {
        "ack_wait": c.ack_wait_s,
        "max_deliver": c.max_deliver,
        "max_ack_pending": c.max_ack_pending,
        "filter_subject": c.filter_subject,
        "description": c.description or None,
    }
    if c.inactive_s:
        want["inactive_threshold"] = c.inactive_s
    if c.filter_subjects:
        want["filter_subjects"] = list(c.filter_subjects)
    name = f"{c.stream}/{c.durable}"
    try:
        info = await retry(lambda: js.consumer_info(c.stream, c.durable), f"{name} info")
    except NotFoundError:
        config = js_api.ConsumerConfig(
            durable_name=c.durable,
            ack_policy=js_api.AckPolicy.EXPLICIT,
            deliver_policy=_DELIVER[c.deliver_policy],
            **want,
        )
        create = f"create consumer {name}"
        await _call(create, retry(lambda: js.add_consumer(c.stream, config), create))
        return f"created consumer {name}"
    have = info.config
    if have.deliver_subject or have.ack_policy != js_api.AckPolicy.EXPLICIT:
        raise ProvisionError(
            c.durable,
            f"consumer {name} exists but is not a pull consumer with explicit ack; "
            "replacing it would drop its delivery state: delete it by hand",
        )
    changes = _diff(have, want)
    if not changes:
        return ""
    update, changed = f"update consumer {name}", have.evolve(**want)
    await _call(update, retry(lambda: js.add_consumer(c.stream, changed), update))
    return f"updated consumer {name} ({changes})"


async def retire_consumer(js: JetStreamContext, stream: str, name: str) -> str:
    """Delete the consumer ``name`` of ``stream`` if it exists (what it held stays in
    the stream, for the consumers that replace it)."""
    try:
        await retry(lambda: js.delete_consumer(stream, name), f"delete consumer {stream}/{name}")
    except NotFoundError:
        return ""
    return f"deleted consumer {stream}/{name} (replaced)"


async def ensure_bucket(
    js: JetStreamContext,
    b: KVDef,
    *,
    msg_ttl: bool = True,
    placement_wait_s: float = PLACEMENT_WAIT_S,
) -> str:
    """A KV bucket; ``ttl_s`` is the bucket's TTL (0: keys never expire). ``msg_ttl``:
    the server has per-message TTL (:func:`has_msg_ttl`), which the bucket then allows."""
    stream = f"KV_{b.bucket}"
    want: dict[str, Any] = {
        "max_age": b.ttl_s,
        "max_msgs_per_subject": b.history,
        "max_msg_size": b.max_value_size,
        "num_replicas": b.replicas,
        "description": b.description or None,
        "allow_direct": True,  # reads are one direct-get round trip on any replica
    }
    if msg_ttl:  # pinned catalog entries (PIN_HEADERS); cannot be undone
        want["allow_msg_ttl"] = True
    info = await _stream_info(js, stream)
    if info is None:
        config = js_api.KeyValueConfig(
            bucket=b.bucket,
            description=b.description or None,
            history=b.history,
            ttl=b.ttl_s or None,
            max_value_size=b.max_value_size,
            replicas=b.replicas,
            direct=True,
        )
        await _placed(
            f"create bucket {b.bucket}",
            lambda: js.create_key_value(config),
            b.replicas,
            placement_wait_s,
        )
        return f"created bucket {b.bucket}"
    have = info.config
    if b.history < have.max_msgs_per_subject:
        raise ProvisionError(
            b.bucket,
            f"bucket {b.bucket} keeps {have.max_msgs_per_subject} revisions per key, the "
            f"definition wants {b.history}: shrinking it would delete older revisions; "
            "change it by hand if that is intended",
        )
    changes = _diff(have, want)
    if not changes:
        return ""
    window = min(_KV_DUPLICATE_WINDOW_S, b.ttl_s) if b.ttl_s else _KV_DUPLICATE_WINDOW_S
    update = have.evolve(**want, duplicate_window=window)
    info = await _placed(
        f"update bucket {b.bucket}", lambda: js.update_stream(update), b.replicas, placement_wait_s
    )
    if msg_ttl and not info.config.allow_msg_ttl and not have.allow_msg_ttl:
        # asked of a server before 2.11 by a caller that did not know: it dropped the
        # field, so it is no change (and pinned pools refuse to run there)
        del want["allow_msg_ttl"]
        changes = _diff(have, want)
    return f"updated bucket {b.bucket} ({changes})" if changes else ""


# -- helpers -----------------------------------------------------------------------------


async def _stream_info(js: JetStreamContext, name: str) -> js_api.StreamInfo | None:
    """The stream's info, or None when there is none. A stream electing its leader (a
    cluster's node restarting) times out or answers 503 for a while: that is retried."""
    try:
        return await retry(lambda: js.stream_info(name), f"{name} info")
    except NotFoundError:
        return None


async def _messages_on(js: JetStreamContext, stream: str, subject: str) -> int:
    """How many messages of ``stream`` are on subjects matching ``subject``."""
    info = await js.stream_info(stream, subjects_filter=subject)
    return sum((info.state.subjects or {}).values()) if info.state.subjects else 0


async def _call(what: str, op: Awaitable[Any]) -> Any:
    try:
        return await op
    except APIError as exc:
        raise _refused(what, exc) from exc


async def _placed(what: str, op: Callable[[], Awaitable[Any]], replicas: int, wait_s: float) -> Any:
    """``await op()``, waiting up to ``wait_s`` for a cluster to have as many JetStream
    servers up as ``replicas`` (:data:`NO_PEERS_ERR_CODE`)."""
    deadline = time.monotonic() + wait_s
    waited = False
    while True:
        try:
            return await op()
        except APIError as exc:
            if getattr(exc, "err_code", None) != NO_PEERS_ERR_CODE:
                raise _refused(what, exc) from exc
            if time.monotonic() + 0.5 > deadline:
                raise _refused(
                    what,
                    exc,
                    f" (waited {wait_s:g} s for {replicas} JetStream servers to be up: "
                    f"does the cluster have {replicas}, each with JetStream enabled and "
                    "room for it?)",
                ) from exc
            if not waited:
                log.warning("waiting for %d JetStream servers to %s", replicas, what)
                waited = True
            await asyncio.sleep(0.5)  # the server tells no one when a peer joins


def _refused(what: str, exc: APIError, detail: str = "") -> ProvisionError:
    name = what.rsplit(" ", 1)[-1]
    return ProvisionError(name, f"cannot {what}: {exc.description or exc}{detail}")


def _diff(have: Any, want: dict[str, Any]) -> str:
    """The fields of ``have`` that differ from ``want``, as ``field a → b, ...``."""
    changed = []
    for field, new in want.items():
        old = getattr(have, field)
        if not _same(old, new):
            changed.append(f"{field} {old!r} → {new!r}")
    return ", ".join(changed)


def _same(old: Any, new: Any) -> bool:
    if isinstance(old, float) or isinstance(new, float):
        return abs((old or 0.0) - (new or 0.0)) < 1e-6
    if old in (None, "") and new in (None, ""):
        return True
    return bool(old == new)


def _v(policy: Any) -> str:
    return str(getattr(policy, "value", policy))
