"""Write the settings reference of docs/CONFIGURATION.md from the settings Structs.

    python -m docs.settings_doc          # rewrite the reference in docs/CONFIGURATION.md
    python -m docs.settings_doc --check  # exit 1 if it is stale or a field has no description

Each command reads its configuration as one Struct (:data:`CONFIGS`) whose fields are the
TOML file's tables. A field's description is the ``#:`` comment right above it in the
class, the way Sphinx reads attribute comments::

    class LoopSettings(msgspec.Struct, frozen=True, kw_only=True):
        #: LLM calls per turn; then the turn ends, reason ``max_iterations``.
        max_iterations: Annotated[int, msgspec.Meta(ge=1)] = 20

Its type, range and default come from msgspec's view of the Struct, its variable from
:func:`loopmesh.settings.env_var`. Only the text between :data:`BEGIN` and :data:`END`
is written; the rest of CONFIGURATION.md is prose.
"""

from __future__ import annotations

import argparse
import ast
import functools
import inspect
import re
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import msgspec.inspect as mi

from gateway.settings import GatewayConfig
from loop_worker.config import LoopWorkerConfig
from loopmesh.client.config import ClientConfig
from loopmesh.commands.agents import AgentsConfig
from loopmesh.commands.schedules import SchedulerConfig
from loopmesh.exporter import ExporterConfig
from loopmesh.settings import RuntimeConfig, env_var
from loopmesh.up import UpConfig
from nats_agents.settings import NatsAgentsConfig
from schemas.agents import TOOL_REF_PATTERN
from schemas.ids import TOKEN_PATTERN
from tool_worker.config import ToolWorkerConfig
from webhooks.cli import WebhooksConfig

DOC = Path(__file__).resolve().parent / "CONFIGURATION.md"
COMMAND = "python -m docs.settings_doc"
BEGIN = f"<!-- The settings reference below is written by `{COMMAND}`: edit the code. -->"
END = "<!-- End of the settings reference. -->"

#: What each command reads (``loopmesh <command>``), in the order the tables are listed.
CONFIGS: tuple[tuple[type[msgspec.Struct], tuple[str, ...]], ...] = (
    (LoopWorkerConfig, ("loop-worker",)),
    (ToolWorkerConfig, ("tool-worker", "tools")),
    (GatewayConfig, ("gateway",)),
    (WebhooksConfig, ("webhooks",)),
    (ExporterConfig, ("exporter",)),
    (NatsAgentsConfig, ("nats-agents",)),
    (UpConfig, ("up",)),
    (AgentsConfig, ("agents",)),
    (SchedulerConfig, ("schedules",)),
    (ClientConfig, ("run", "events", "approve", "deny", "cancel", "schedules")),
    (RuntimeConfig, ("every command",)),
)

#: Patterns a type names instead of printing them.
PATTERNS = {TOKEN_PATTERN: "id", TOOL_REF_PATTERN: "tool name", r"^\S+$": "model name"}


@dataclass
class Section:
    """One table of the file: ``[loop.budget]``, ``[[agents]]``, ``[prices."<model>"]``."""

    header: str
    struct: type[msgspec.Struct]
    #: The variable that sets it (a top-level table's keys have one each), and how.
    variable: str | None
    whole: bool  # the variable sets the whole table as JSON (a table nested in another)
    readers: dict[str, tuple[str, ...] | None] = field(default_factory=dict)  # None: all
    children: list[Section] = field(default_factory=list)
    tables: set[str] = field(default_factory=set)  # its keys that are tables of their own


@dataclass
class Row:
    key: str
    variable: str | None
    type: str
    default: str
    description: str


class MissingDescription(Exception):
    def __init__(self, missing: list[str]) -> None:
        self.missing = missing
        super().__init__(
            "settings without a description (a `#:` comment above the field): " + ", ".join(missing)
        )


# -- descriptions ----------------------------------------------------------------------------


def descriptions(cls: type) -> dict[str, str]:
    """Field name → its ``#:`` comment, for ``cls`` and the classes it inherits from."""
    found: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if base.__module__.split(".")[0] in ("builtins", "msgspec"):
            continue
        found.update(_own_descriptions(base))
    return found


@functools.cache
def _own_descriptions(cls: type) -> dict[str, str]:
    source = Path(inspect.getfile(cls)).read_text().splitlines()
    tree = _module_ast(inspect.getfile(cls))
    (node,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__]
    found = {}
    for item in node.body:
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            lines: list[str] = []
            i = item.lineno - 2
            while i >= 0 and source[i].strip().startswith("#:"):
                lines.insert(0, source[i].strip()[2:].strip())
                i -= 1
            if lines:
                found[item.target.id] = " ".join(lines)
    return found


@functools.cache
def _module_ast(path: str) -> ast.Module:
    return ast.parse(Path(path).read_text())


def docstring(cls: type) -> str:
    """The class's own docstring as Markdown paragraphs ('' when it has none), less a
    first ``[table]:`` that the heading says already."""
    doc = _markdown(inspect.cleandoc(cls.__dict__.get("__doc__") or ""))
    doc = re.sub(r"^`\[[^`]*\]`: ", "", doc)
    return doc[:1].upper() + doc[1:]


def _markdown(text: str) -> str:
    """reStructuredText's inline literals (````x````) and roles as Markdown code."""
    text = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", text)
    return text.replace("``", "`")


# -- the tables ------------------------------------------------------------------------------


def sections() -> list[Section]:
    """Every table any command reads, each once, in the order of :data:`CONFIGS`."""
    top: dict[str, Section] = {}
    for config, commands in CONFIGS:
        for f in msgspec.structs.fields(config):
            struct, header, variable = _table_of(f.encode_name, f.type)
            if struct is None:
                continue
            section = top.get(f.encode_name)
            if section is None:
                section = top[f.encode_name] = _section(header, struct, variable)
            elif struct is not section.struct:
                _check_partial(section, struct)
            partial = None if struct is section.struct else _names(struct)
            for command in commands:
                section.readers.setdefault(command, partial)
    return list(top.values())


def _table_of(name: str, type_: Any) -> tuple[type[msgspec.Struct] | None, str, str | None]:
    """The Struct of top-level field ``name``, its header, and its variable (None: none)."""
    info = _unwrap(mi.type_info(type_))
    match info:
        case mi.StructType(cls=cls):
            return cls, f"[{name}]", env_var(name, "").removesuffix("__")
        case mi.DictType(value_type=mi.StructType(cls=cls)):
            return cls, f'[{name}."<{_singular(name)}>"]', None
        case mi.VarTupleType(item_type=mi.StructType(cls=cls)):
            return cls, f"[[{name}]]", None
    return None, "", None


def _section(
    header: str, struct: type[msgspec.Struct], variable: str | None, whole: bool = False
) -> Section:
    """The table ``header`` and the tables nested in it. ``variable``: the variable of
    each key (``variable__KEY``), or with ``whole`` the one that sets the whole table."""
    section = Section(header, struct, variable, whole)
    prefix = header.strip("[]")
    for f in fields_of(struct):
        match _unwrap(f.type):
            case mi.StructType(cls=cls):
                sub = f"[{prefix}.{f.encode_name}]"
            case mi.DictType(value_type=mi.StructType(cls=cls)):
                sub = f'[{prefix}.{f.encode_name}."<{_singular(f.encode_name)}>"]'
            case mi.VarTupleType(item_type=mi.StructType(cls=cls)):
                sub = f"[[{prefix}.{f.encode_name}]]"
            case _:
                continue
        inner = variable if whole or variable is None else f"{variable}__{f.encode_name.upper()}"
        section.children.append(_section(sub, cls, inner, whole=inner is not None))
        section.tables.add(f.encode_name)
    return section


def _check_partial(section: Section, struct: type[msgspec.Struct]) -> None:
    """Another command reads ``struct`` for ``section``'s table: a partial view (the
    gateway's ``[loop]``), whose fields must be the full table's, with its defaults."""
    full = {f.encode_name: f for f in fields_of(section.struct)}
    for f in fields_of(struct):
        if f.encode_name not in full or full[f.encode_name].default != f.default:
            raise ValueError(
                f"{struct.__name__}.{f.encode_name} is not a field of {section.header} "
                f"({section.struct.__name__}) with the same default"
            )


def _names(struct: type[msgspec.Struct]) -> tuple[str, ...]:
    return tuple(f.encode_name for f in fields_of(struct))


def _singular(name: str) -> str:
    return {"prices": "model", "models": "model", "tenants": "tenant"}.get(name, name)


def rows(section: Section) -> list[Row]:
    """The keys of ``section`` that hold values (not tables), each described."""
    notes = descriptions(section.struct)
    found = []
    for f in fields_of(section.struct):
        if f.encode_name in section.tables:
            continue
        variable = None
        if section.variable is not None and not section.whole:
            variable = f"{section.variable}__{f.encode_name.upper()}"
        found.append(
            Row(
                key=f.encode_name,
                variable=variable,
                type=type_name(f.type),
                default=default(f),
                description=_markdown(notes.get(f.name, "")),
            )
        )
    return found


def fields_of(struct: type[msgspec.Struct]) -> tuple[mi.Field, ...]:
    info = mi.type_info(struct)
    assert isinstance(info, mi.StructType)
    return info.fields


def walk(items: list[Section]) -> list[Section]:
    return [s for section in items for s in (section, *walk(section.children))]


def missing() -> list[str]:
    """Every key that has no description, as ``header key``."""
    return [
        f"{section.header} {row.key} ({section.struct.__module__}.{section.struct.__name__})"
        for section in walk(sections())
        for row in rows(section)
        if not row.description
    ]


# -- types and defaults ----------------------------------------------------------------------


def _unwrap(info: mi.Type) -> mi.Type:
    while isinstance(info, mi.Metadata):
        info = info.type
    if isinstance(info, mi.UnionType):
        members = [t for t in info.types if not isinstance(t, mi.NoneType)]
        if len(members) == 1:
            return _unwrap(members[0])
    return info


def type_name(info: mi.Type) -> str:
    """``int ≥ 1``, ``float ≥ 0, ≤ 2``, ``list of str``, ``"auto" or "constrained"``..."""
    info = _unwrap(info)
    match info:
        case mi.BoolType():
            return "bool"
        case mi.IntType() | mi.FloatType():
            return ("int" if isinstance(info, mi.IntType) else "float") + _range(info)
        case mi.StrType(pattern=pattern):
            if pattern in PATTERNS:
                return PATTERNS[pattern]
            return f"str matching `{pattern}`" if pattern else "str"
        case mi.LiteralType(values=values):
            return " or ".join(f'`"{v}"`' for v in values)
        case mi.VarTupleType(item_type=item, max_length=most):
            bound = f", at most {most}" if most is not None else ""
            item = _unwrap(item)
            if isinstance(item, mi.LiteralType):
                return "list of " + ", ".join(f'`"{v}"`' for v in item.values) + bound
            return f"list of {type_name(item)}{bound}"
        case mi.DictType(key_type=key, value_type=value):
            return f"table of {type_name(key)} → {type_name(value)}"
        case mi.UnionType(types=types):
            return " or ".join(type_name(t) for t in types if not isinstance(t, mi.NoneType))
    raise TypeError(f"no name for the settings type {info!r}")


def _range(info: mi.IntType | mi.FloatType) -> str:
    parts = []
    if info.ge is not None:
        parts.append(f"≥ {_number(info.ge)}")
    if info.gt is not None:
        parts.append(f"> {_number(info.gt)}")
    if info.le is not None:
        parts.append(f"≤ {_number(info.le)}")
    if info.lt is not None:
        parts.append(f"< {_number(info.lt)}")
    return " " + ", ".join(parts) if parts else ""


def _number(value: float) -> str:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def default(f: mi.Field) -> str:
    if f.required:
        return "required"
    value = f.default if f.default_factory is msgspec.NODEFAULT else f.default_factory()
    if value is None:
        return "unset"
    return f"`{_toml(value)}`"


def _toml(value: Any) -> str:
    match value:
        case bool():
            return "true" if value else "false"
        case int():
            return str(value)
        case float():
            return str(int(value)) if value.is_integer() else repr(value)
        case str():
            return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
        case tuple() | list():
            return "[" + ", ".join(_toml(v) for v in value) + "]"
        case dict():
            return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"no TOML for the default {value!r}")


# -- Markdown --------------------------------------------------------------------------------


def reference() -> str:
    """The generated part of CONFIGURATION.md, between :data:`BEGIN` and :data:`END`."""
    gaps = missing()
    if gaps:
        raise MissingDescription(gaps)
    out = [BEGIN, ""]
    for section in walk(sections()):
        out += _section_markdown(section)
    out.append(END)
    return "\n".join(out)


def _section_markdown(section: Section) -> list[str]:
    out = [f"### `{section.header}`", ""]
    doc = docstring(section.struct)
    if doc:
        out += [doc, ""]
    readers = [
        c if " " in c else f"`loopmesh {c}`"
        for c, partial in section.readers.items()
        if partial is None
    ]
    partial = [
        f"`loopmesh {c}` (only " + ", ".join(f"`{n}`" for n in names) + ")"
        for c, names in section.readers.items()
        if names is not None
    ]
    if readers or partial:
        out += ["Read by " + ", ".join(readers + partial) + ".", ""]
    if section.variable is None:
        out += ["Only in the file: no variable sets it.", ""]
    elif section.whole:
        out += [
            f"No variable per key: `{section.variable}` sets the whole "
            f"{'list' if section.header.startswith('[[') else 'table'} as JSON.",
            "",
        ]
    table = rows(section)
    if table:
        with_variable = any(r.variable for r in table)
        head = ["Key", "Variable", "Type", "Default", "Description"]
        if not with_variable:
            head.remove("Variable")
        out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for row in table:
            cells = [f"`{row.key}`", row.type, row.default, row.description]
            if with_variable:
                cells.insert(1, f"`{row.variable}`" if row.variable else "")
            out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        out.append("")
    return out


def render(text: str) -> str:
    """``text`` (CONFIGURATION.md) with its reference rewritten."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"{DOC.name} has no `{BEGIN}` ... `{END}` to rewrite")
    return text[:start] + reference() + text[end + len(END) :]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is stale")
    args = parser.parse_args(argv)
    text = DOC.read_text()
    try:
        wanted = render(text)
    except MissingDescription as exc:
        print(textwrap.fill(str(exc), 100), file=sys.stderr)
        return 1
    if args.check:
        if wanted != text:
            print(f"{DOC} is stale: run `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    if wanted != text:
        DOC.write_text(wanted)
        print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
