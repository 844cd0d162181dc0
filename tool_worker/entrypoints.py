"""Tools from installed packages, found through the ``loopmesh.tools`` entry point group.

A package ships tools by naming them in its ``pyproject.toml``::

    [project.entry-points."loopmesh.tools"]
    text = "text_tools.tools"                 # a module: its @tool functions
    slug = "text_tools.tools:slugify"         # one @tool function
    more = "text_tools.tools:TOOLS"           # a list of @tool functions

and a worker serves the entry points its settings name (``[tool_worker] entry_points =
["text"]``, or ``["*"]`` for every installed one). Loading fails closed: a name that no
installed package provides, two packages providing one name, an import that fails or an
object that is no tool each stop the worker with :class:`EntryPointError`, rather than
a pool that starts without tools it was meant to serve.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from .errors import EntryPointError, ToolModuleError, ToolWorkerError
from .local import is_tool, load_module, to_tool
from .registry import Tool

GROUP = "loopmesh.tools"
ALL = "*"


def installed(group: str = GROUP) -> dict[str, list[importlib.metadata.EntryPoint]]:
    """The entry points of ``group`` by name (a name two packages use has two)."""
    found: dict[str, list[importlib.metadata.EntryPoint]] = {}
    for entry in importlib.metadata.entry_points(group=group):
        found.setdefault(entry.name, []).append(entry)
    return found


def load_entry_points(names: Sequence[str], *, group: str = GROUP) -> list[Tool]:
    """The tools of the entry points ``names`` (``["*"]``: all) of ``group``."""
    if not names:
        return []
    available = installed(group)
    if ALL in names:
        if len(names) > 1:
            raise EntryPointError(ALL, f"{ALL!r} loads every entry point: name nothing else")
        if not available:
            raise EntryPointError(ALL, f"no installed package has {group!r} entry points")
        names = sorted(available)
    tools: list[Tool] = []
    for name in names:
        entries = available.get(name)
        if not entries:
            known = ", ".join(sorted(available)) or "none"
            raise EntryPointError(name, f"no installed package provides it (installed: {known})")
        if len({e.value for e in entries}) > 1:
            values = ", ".join(sorted(e.value for e in entries))
            raise EntryPointError(name, f"several installed packages provide it ({values})")
        tools += _load(entries[0])
    return tools


def _load(entry: importlib.metadata.EntryPoint) -> list[Tool]:
    if entry.attr is None:  # a module: its @tool functions
        try:
            return load_module(entry.module)
        except ToolModuleError as exc:
            raise EntryPointError(entry.name, str(exc)) from exc
    try:
        obj = entry.load()
    except Exception as exc:
        raise EntryPointError(entry.name, f"{entry.value}: {type(exc).__name__}: {exc}") from exc
    functions = [obj] if callable(obj) else _iterable(entry, obj)
    tools = []
    for fn in functions:
        if not is_tool(fn):
            raise EntryPointError(entry.name, f"{entry.value}: {fn!r} is not decorated with @tool")
        try:
            tools.append(to_tool(fn))
        except ToolWorkerError as exc:
            raise EntryPointError(entry.name, f"{entry.value}: {exc}") from exc
    if not tools:
        raise EntryPointError(entry.name, f"{entry.value} holds no tools")
    return tools


def _iterable(entry: importlib.metadata.EntryPoint, obj: Any) -> list[Callable[..., Any]]:
    if isinstance(obj, Iterable) and not isinstance(obj, str | bytes):
        return list(obj)
    raise EntryPointError(
        entry.name, f"{entry.value} is a {type(obj).__name__}, not a @tool function or a list"
    )
