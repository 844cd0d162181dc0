"""The tools one worker serves, by ``(server, name)``.

A :class:`Tool` is a spec (what the catalog shows) and an ``invoke`` coroutine function
that takes validated arguments and returns the result's text. Local tools
(:mod:`tool_worker.local`) and MCP tools (:mod:`tool_worker.mcp`) are both Tools, so the
service treats them alike. MCP servers replace their tools when they re-list, so the
registry tells listeners (the catalog) when it changes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import jsonschema
import jsonschema.exceptions

from schemas import ToolSpec, is_token

from .errors import InvalidArguments, RegistryError, UnknownTool

Invoke = Callable[[dict[str, Any]], Awaitable[str]]


@dataclass(eq=False)
class Tool:
    """One callable tool. ``name`` and ``server`` are subject tokens."""

    server: str
    name: str
    invoke: Invoke
    description: str = ""
    input_schema: dict[str, Any] = field(
        default_factory=lambda: {"type": "object", "properties": {}}
    )
    timeout_s: float = 30.0
    needs_approval: bool = False
    title: str | None = None

    def __post_init__(self) -> None:
        for kind, value in (("server", self.server), ("tool", self.name)):
            if not is_token(value):
                raise RegistryError(
                    f"{kind} name {value!r} is not a subject token ([A-Za-z0-9_-]{{1,64}})"
                )

    @property
    def key(self) -> tuple[str, str]:
        return (self.server, self.name)

    @cached_property
    def _validator(self) -> jsonschema.protocols.Validator:
        cls = jsonschema.validators.validator_for(self.input_schema)
        return cls(self.input_schema)

    def validate(self, arguments: dict[str, Any]) -> None:
        """Raise :class:`InvalidArguments` naming the first bad field."""
        error = jsonschema.exceptions.best_match(self._validator.iter_errors(arguments))
        if error is not None:
            path = "$" + "".join(
                f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path
            )
            raise InvalidArguments(error.message, path=path)

    def spec(self, pool: str, *, updated_at: float = 0.0, pinned: bool = False) -> ToolSpec:
        return ToolSpec(
            server=self.server,
            name=self.name,
            description=self.description,
            input_schema=self.input_schema,
            pool=pool,
            timeout_s=self.timeout_s,
            needs_approval=self.needs_approval,
            title=self.title,
            updated_at=updated_at,
            pinned=pinned,
        )


class Registry:
    """Tools by ``(server, name)``; ``on_change`` listeners run after every change."""

    def __init__(self, tools: Iterable[Tool] = ()) -> None:
        self._tools: dict[tuple[str, str], Tool] = {}
        self._listeners: list[Callable[[], None]] = []
        for tool in tools:
            self.add(tool)

    def add(self, tool: Tool) -> None:
        if tool.key in self._tools:
            raise RegistryError(f"tool {tool.server}.{tool.name} is registered twice")
        self._tools[tool.key] = tool
        self._changed()

    def replace_server(self, server: str, tools: Iterable[Tool]) -> None:
        """Make ``tools`` the whole of ``server``'s tools (an MCP server re-listed)."""
        kept = {k: t for k, t in self._tools.items() if k[0] != server}
        for tool in tools:
            if tool.server != server:
                raise RegistryError(f"tool {tool.server}.{tool.name} is not on server {server}")
            kept[tool.key] = tool
        self._tools = kept
        self._changed()

    def get(self, server: str, name: str) -> Tool:
        tool = self._tools.get((server, name))
        if tool is None:
            raise UnknownTool(server, name, sorted(f"{s}.{n}" for s, n in self._tools)[:20])
        return tool

    def on_change(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)

    def _changed(self) -> None:
        for listener in self._listeners:
            listener()

    def __iter__(self) -> Iterator[Tool]:
        return iter(list(self._tools.values()))

    def __len__(self) -> int:
        return len(self._tools)

    def __contains__(self, key: object) -> bool:
        return key in self._tools
