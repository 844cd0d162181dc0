"""How people and models name a tool of the catalog, and which written names match none.

A tool ``server.tool`` is also called by its function name, the one the model sees:
``server__tool`` (:func:`function_name`). Lists that name tools (``[loop] tools``,
``approval_tools``, an agent's) accept either (:func:`aliases`); :func:`unmatched`
says which names of such a list match no tool, with the closest ones, so that the loop
worker and ``loopmesh agents`` say the same. NATS-free: the loop engine uses it.
"""

from __future__ import annotations

import difflib
import hashlib
import re
from collections.abc import Iterable, Sequence

from schemas import ToolSpec

FUNCTION_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_UNSAFE = re.compile(r"[^a-zA-Z0-9_-]")


def function_name(server: str, tool: str) -> str:
    """The OpenAI function name of ``server.tool``: ``server__tool``, always valid."""
    name = f"{server}__{tool}" if server else tool
    if FUNCTION_NAME.fullmatch(name):
        return name
    digest = hashlib.blake2s(name.encode(), digest_size=4).hexdigest()
    return f"{_UNSAFE.sub('_', name)[: 64 - 9]}_{digest}"


def aliases(spec: ToolSpec) -> tuple[str, str]:
    """The names a user may write for ``spec``: ``server.tool`` and its function name."""
    return f"{spec.server}.{spec.name}", function_name(spec.server, spec.name)


def unmatched(names: Iterable[str], specs: Sequence[ToolSpec]) -> dict[str, tuple[str, ...]]:
    """Each of ``names`` that matches none of ``specs``, with the closest ``server.tool``
    keys (best first; empty when nothing is close)."""
    known = {alias for spec in specs for alias in aliases(spec)}
    keys = sorted({aliases(spec)[0] for spec in specs})
    out: dict[str, tuple[str, ...]] = {}
    for name in names:
        if name in known:
            continue
        tool = name.rpartition(".")[2].rpartition("__")[2]
        same_tool = [k for k in keys if k.rpartition(".")[2] == tool]
        close = difflib.get_close_matches(name, keys, n=3, cutoff=0.5)
        out[name] = tuple(dict.fromkeys([*same_tool, *close]))[:3]
    return out
