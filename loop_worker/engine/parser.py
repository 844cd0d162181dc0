"""Reading tool calls from model output, and naming tools for the model.

Two things live here:

- the text tool format, for models without function calling::

      <tool>{"server_name": "files", "tool_name": "read", "arguments": {"path": "a.txt"}}</tool>

  :func:`parse_text_calls` returns a :class:`ParsedCall` or a typed
  :class:`~loop_worker.engine.errors.ToolFormatError` for each ``<tool>`` block;
- function names: OpenAI function names must match ``^[a-zA-Z0-9_-]{1,64}$``, so
  ``server.tool`` becomes ``server__tool`` (hash-shortened when too long) and
  :class:`ToolNames` maps a name the model wrote back to its tool.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import msgspec

from loopmesh.toolnames import FUNCTION_NAME, function_name
from schemas import ToolSpec

from .errors import ToolFieldError, ToolFormatError, ToolParseError

_TOOL_BLOCK = re.compile(r"<tool>(.*?)</tool>", re.DOTALL)
_FENCE = re.compile(r"^```[a-zA-Z]*\s*|\s*```$")


class ParsedCall(msgspec.Struct, frozen=True, kw_only=True):
    server: str
    tool: str
    arguments: dict[str, Any] = {}


# -- the text format ---------------------------------------------------------------------


def parse_text_calls(text: str) -> list[ParsedCall | ToolFormatError]:
    """Every ``<tool>…</tool>`` block of ``text``, in order, read or refused.

    An opening ``<tool>`` with no closing tag after the last block is a parse error.
    """
    out: list[ParsedCall | ToolFormatError] = []
    end = 0
    for match in _TOOL_BLOCK.finditer(text):
        out.append(_read_block(match.group(1)))
        end = match.end()
    rest = text[end:]
    if "<tool>" in rest:
        body = rest[rest.index("<tool>") + len("<tool>") :]
        out.append(ToolParseError("a <tool> block has no closing </tool> tag", text=body[:200]))
    return out


def has_text_call(text: str) -> bool:
    return "<tool>" in text


def _read_block(body: str) -> ParsedCall | ToolFormatError:
    body = _FENCE.sub("", body.strip())
    try:
        data = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        return ToolParseError(f"the <tool> body is not valid JSON ({exc})", text=body[:200])
    if not isinstance(data, dict):
        return ToolParseError("the <tool> body must be a JSON object", text=body[:200])
    server = data.get("server_name")
    tool = data.get("tool_name")
    if not isinstance(tool, str) or not tool:
        return ToolFieldError("missing or empty string field 'tool_name'", field="tool_name")
    if not isinstance(server, str):
        return ToolFieldError("missing string field 'server_name'", field="server_name")
    arguments = data.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = parse_arguments(arguments)
        except ToolFormatError as exc:
            return ToolFieldError(f"'arguments': {exc}", field="arguments")
    if not isinstance(arguments, dict):
        return ToolFieldError("'arguments' must be a JSON object", field="arguments")
    return ParsedCall(server=server, tool=tool, arguments=arguments)


def parse_arguments(raw: str) -> dict[str, Any]:
    """A native call's arguments text as an object; ``""`` is ``{}``."""
    if not raw.strip():
        return {}
    try:
        data = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise ToolParseError(f"arguments are not valid JSON ({exc})", text=raw[:200]) from None
    if not isinstance(data, dict):
        raise ToolParseError("arguments must be a JSON object", text=raw[:200])
    return data


# -- function names ----------------------------------------------------------------------


class ToolNames:
    """Function name <-> tool, for one tool list. Built-in tools keep their bare name."""

    def __init__(self, specs: Iterable[ToolSpec], *, builtin_server: str = "") -> None:
        self._by_name: dict[str, ToolSpec] = {}
        self._by_key: dict[tuple[str, str], str] = {}
        for spec in specs:
            server = "" if spec.server == builtin_server else spec.server
            name = function_name(server, spec.name)
            if name in self._by_name:  # a collision after mapping: disambiguate by hash
                name = function_name(f"{spec.server}.", spec.name)
            self._by_name[name] = spec
            self._by_key[(spec.server, spec.name)] = name

    def function(self, server: str, tool: str) -> str:
        return self._by_key[(server, tool)]

    def resolve(self, name: str) -> ToolSpec | None:
        """The tool a function name stands for; ``None`` when there is none."""
        return self._by_name.get(name)

    def find(self, server: str, tool: str) -> ToolSpec | None:
        """A tool by server and name (the text format), tolerating a missing server
        for tools whose name is unique."""
        key = self._by_key.get((server, tool))
        if key is not None:
            return self._by_name[key]
        matches = [s for s in self._by_name.values() if s.name == tool]
        return matches[0] if len(matches) == 1 else None

    def specs(self) -> list[ToolSpec]:
        return list(self._by_name.values())

    def items(self) -> list[tuple[str, ToolSpec]]:
        return list(self._by_name.items())


def safe_function_name(name: str) -> str:
    """``name`` if it is a valid function name, else a valid stand-in (for history)."""
    return name if FUNCTION_NAME.fullmatch(name) else function_name("", name or "unnamed")
