"""The tool catalog as its readers see it: every served tool's :class:`~schemas.ToolSpec`,
in the catalog KV bucket under ``<server>.<tool>``.

Tool workers keep it (``tool_worker/catalog.py``); ``loopmesh tools`` and ``loopmesh
agents`` read it with :func:`read_catalog`.
"""

from __future__ import annotations

import logging

from nats.js import JetStreamContext

from schemas import DecodeError, Subjects, ToolSpec, decode

from .jetstream import kv_values

log = logging.getLogger("loopmesh.catalog")


async def read_catalog(js: JetStreamContext, subjects: Subjects) -> list[ToolSpec]:
    """Every spec in the catalog, sorted by pool, server and name."""
    specs = []
    for key, value in (await kv_values(js, subjects.catalog_bucket)).items():
        try:
            specs.append(decode(value, ToolSpec))
        except DecodeError as exc:
            log.warning("skipping unreadable catalog entry %s: %s", key, exc)
    return sorted(specs, key=lambda s: (s.pool, s.server, s.name))
