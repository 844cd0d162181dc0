"""The tool catalog as a loop worker sees it: a live watch of the catalog KV bucket.

Tool workers put each tool's :class:`~schemas.ToolSpec` under ``<server>.<tool>`` and
put it again every third of the bucket's TTL (``tool_worker/catalog.py``). A
:class:`Catalog` watches the bucket (:class:`loopmesh.watch.BucketWatch`, which says how): a
tool is offered from the moment its worker has put it, and withdrawn when its key is
deleted or purged, or when its TTL lapses with no newer put. A spec that says
``pinned`` (put with ``Nats-TTL: never`` for a pool that may scale to zero,
``tool_worker/catalog.py``) does not lapse: it stays until deleted.

Loading: :meth:`Catalog.loaded` waits for the watch's initial values, so no turn runs
on a half-known catalog (:class:`~.errors.CatalogNotLoadedError` after the timeout).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from loopmesh.watch import BucketWatch
from schemas import DecodeError, ToolSpec, decode

from .errors import CatalogNotLoadedError

log = logging.getLogger("loopmesh.loop_worker.catalog")

#: Called with the whole tool list when the catalog loads and whenever its keys change.
OnChange = Callable[[Sequence[ToolSpec]], object]


class Catalog(BucketWatch[ToolSpec]):
    """Every tool spec in ``bucket``, kept current by a KV watch."""

    what = "catalog"

    def decode(self, key: str, revision: int, value: bytes) -> ToolSpec | None:
        try:
            return decode(value, ToolSpec)
        except DecodeError as exc:
            log.warning("bad catalog entry key=%s error=%s", key, exc)
            return None

    def lasts(self, item: ToolSpec) -> bool:
        return item.pinned  # its pool is provisioned to outlive its workers

    def not_loaded(self, timeout_s: float, last: BaseException | None) -> Exception:
        return CatalogNotLoadedError(self.bucket, timeout_s, last)

    def specs(self) -> Sequence[ToolSpec]:
        """The tools known now (empty until loaded), the same tuple until a change."""
        return self.items()
