"""The server's turn mappings (``[nats] turn_partitions``): what to write in each
nats-server's configuration, and the check that the server routes turns where the
services look for them (docs/ARCHITECTURE.md, "Partitions").

Clients publish a turn on ``<prefix>.turns.<tenant>.<session>`` whatever the count; with
more than one partition, the server's ``mappings`` send it to the stream of its tenant's
partition (:attr:`~schemas.subjects.Subjects.turn_mappings`). A server without them, or
with them for another count, would keep a tenant's turns where no loop worker pulls, so
every process checks before it goes on::

    await check_turn_partitions(nc, settings.subjects)
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping

import nats.errors
from nats.aio.client import Client

from schemas.subjects import PROBE_HEADER, Subjects

from .errors import ProvisionError

#: How long a probe that finds no stream is asked again (a stream's leader may be
#: changing) before the mapping is said to be missing.
PROBE_WAIT_S = 10.0
#: A last sequence no stream reaches: the server answers a probe, and stores nothing.
_NEVER = str(2**63)


def mappings_conf(subjects: Subjects) -> str:
    """The nats-server configuration block that routes turns to their partitions ("" for
    one partition): put it in every server's configuration, in the account loopmesh
    uses (at the top level for the default account)."""
    return mappings_block(subjects.turn_mappings)


def mappings_block(mappings: Mapping[str, str]) -> str:
    """``mappings = { … }`` in nats-server's configuration syntax ("" for none)."""
    if not mappings:
        return ""
    lines = [f"  {json.dumps(source)}: {json.dumps(to)}" for source, to in mappings.items()]
    return "mappings = {\n" + "\n".join(lines) + "\n}\n"


def probe_tenants(subjects: Subjects) -> list[str]:
    """One tenant name per turns partition, partition 0's first: a probe of each shows
    that every partition's turns reach its stream."""
    found: dict[int, str] = {}
    i = 0
    while len(found) < subjects.turn_partitions:
        name = f"loopmesh-probe-{i}"
        found.setdefault(subjects.turn_partition(name), name)
        i += 1
    return [found[k] for k in range(subjects.turn_partitions)]


async def check_turn_partitions(
    nc: Client, subjects: Subjects, *, wait_s: float = PROBE_WAIT_S
) -> None:
    """Raise :class:`~loopmesh.errors.ProvisionError` unless the server stores each
    partition's turns in its stream (``[nats] turn_partitions``, and the turns streams
    provisioned). Each probe publishes on a tenant's turn subject expecting a last
    sequence no stream has: the stream that takes it answers with its name and stores
    nothing, and loop workers ignore it (:data:`~schemas.subjects.PROBE_HEADER`)."""
    found = await asyncio.gather(
        *(_stream_taking(nc, subjects, tenant, wait_s) for tenant in probe_tenants(subjects))
    )
    for tenant, stream in zip(probe_tenants(subjects), found, strict=True):
        want = subjects.turns_stream_of(tenant)
        if stream == want:
            continue
        subject = subjects.turn(tenant, "probe")
        n = subjects.turn_partitions
        fix = (
            f"add to every nats-server's configuration:\n{mappings_conf(subjects)}"
            if n > 1
            else "remove the server's mappings of turn subjects"
        )
        where = f"stream {stream}" if stream else "no stream"
        raise ProvisionError(
            want,
            f"[nats] turn_partitions is {n}, so the turns of tenant {tenant} belong in "
            f"stream {want}, but the server stores {subject} in {where}: {fix}",
        )


async def _stream_taking(nc: Client, subjects: Subjects, tenant: str, wait_s: float) -> str:
    """The stream that takes a turn of ``tenant``, or "" if none does."""
    headers = {PROBE_HEADER: "1", "Nats-Expected-Last-Sequence": _NEVER}
    subject = subjects.turn(tenant, "probe")
    deadline = time.monotonic() + wait_s
    while True:
        try:
            reply = await nc.request(subject, b"", timeout=2.0, headers=headers)
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
            if time.monotonic() >= deadline:
                return ""
            await asyncio.sleep(0.5)
            continue
        try:
            stream = json.loads(reply.data).get("stream", "")
        except (ValueError, AttributeError):
            stream = ""
        return stream if isinstance(stream, str) else ""
