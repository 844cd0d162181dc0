"""Settings: one TOML file shared by every service, overlaid by ``LOOPMESH_*`` variables.

A service describes its configuration as a frozen Struct whose fields are the TOML
file's top-level tables, each a Struct with defaults::

    class Config(msgspec.Struct, frozen=True, kw_only=True):
        nats: NatsSettings = NatsSettings()
        loop: LoopSettings = LoopSettings()

    config = load(Config)  # reads $LOOPMESH_CONFIG, then LOOPMESH_LOOP__MAX_ITERATIONS=5 etc.

Tables of the file that the service does not know are ignored, so one file serves
every service; unknown fields inside a known table are errors. This module is the only
place that reads ``os.environ``.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import msgspec
import msgspec.inspect as mi

from schemas.ids import TOKEN_PATTERN
from schemas.subjects import MAX_PARTITIONS, Subjects

from .errors import ConfigError

T = TypeVar("T")
S = TypeVar("S", bound=msgspec.Struct)

ENV_PREFIX = "LOOPMESH_"
CONFIG_VAR = "LOOPMESH_CONFIG"


Positive = Annotated[float, msgspec.Meta(gt=0)]
AtLeastOne = Annotated[int, msgspec.Meta(ge=1)]
Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]  # 0: any free port


class NatsSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[nats]``: the NATS server every service and client connects to, and the size of
    what provisioning creates there."""

    #: The server, or several of one cluster comma-separated (``nats://`` or ``tls://``;
    #: unset: ``nats://127.0.0.1:4222``, and ``loopmesh up`` starts an embedded server).
    url: str | None = None
    #: The subjects, streams and buckets of this deployment live under it.
    prefix: Annotated[str, msgspec.Meta(pattern=TOKEN_PATTERN)] = "loopmesh"
    #: The connection's name as the server shows it, where a command does not name its own.
    name: str = "loopmesh"
    #: One connection attempt's limit.
    connect_timeout_s: Positive = 5.0
    #: The wait before reconnecting to a server, scaled by a random factor from 0.5 to 1.5.
    reconnect_wait_s: Positive = 0.5
    #: A NATS credentials file (JWT and NKey seed) to connect with.
    creds_file: str | None = None
    #: TLS with a private CA, PEM files (docs/ARCHITECTURE.md, "NATS over TLS"): the CA
    #: that signed the server's certificate (unset: the system's CAs). Any ``tls_*``
    #: file, or a ``tls://`` URL, means TLS or no connection: never plaintext.
    tls_ca_file: str | None = None
    #: This client's certificate, where the server verifies clients (mutual TLS);
    #: with ``tls_key_file``, always both.
    tls_cert_file: str | None = None
    #: The key of ``tls_cert_file``.
    tls_key_file: str | None = None
    #: The JetStream store of the server ``loopmesh up`` starts (``--store-dir``).
    store_dir: str = ".loopmesh/nats"
    #: Events older than this leave the events stream (0: kept until ``events_max_bytes``).
    events_max_age_s: Annotated[float, msgspec.Meta(ge=0)] = 7 * 24 * 3600
    #: Copies of each stream and bucket (3 on a 3-node cluster): provisioning creates
    #: them so and waits for that many servers (docs/ARCHITECTURE.md, "Sizing").
    replicas: Annotated[int, msgspec.Meta(ge=1, le=5)] = 1
    #: The bytes all events streams hold together (each partition a share): past it the
    #: oldest events go.
    events_max_bytes: Annotated[int, msgspec.Meta(ge=2**20, le=2**40)] = 4 * 2**30
    #: A session untouched this long loses its snapshot (0: never).
    sessions_ttl_s: Annotated[float, msgspec.Meta(ge=0, le=10 * 365 * 24 * 3600)] = 30 * 24 * 3600
    #: The events streams the events are split over (docs/ARCHITECTURE.md, "Partitions"):
    #: every service of a deployment must say the same; they check it against the server.
    partitions: Annotated[int, msgspec.Meta(ge=1, le=MAX_PARTITIONS)] = 1
    #: The turns streams the tenants' turns are split over, a tenant's all in one
    #: (docs/ARCHITECTURE.md, "Partitions"). Past 1 every nats-server needs the mappings
    #: ``loopmesh nats-mappings`` prints; every service checks them at start.
    turn_partitions: Annotated[int, msgspec.Meta(ge=1, le=MAX_PARTITIONS)] = 1

    @property
    def subjects(self) -> Subjects:
        """The deployment's subjects and stream names (its prefix and partitions)."""
        return Subjects(self.prefix, self.partitions, self.turn_partitions)

    def __post_init__(self) -> None:
        for field in ("tls_ca_file", "tls_cert_file", "tls_key_file"):
            _check_readable(field, getattr(self, field))
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            given, missing = (
                ("tls_cert_file", "tls_key_file")
                if self.tls_key_file is None
                else ("tls_key_file", "tls_cert_file")
            )
            raise ValueError(
                f"`{given}` is set without `{missing}`: a client certificate and its key go "
                "together (set both, or neither)"
            )


class Price(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a model's tokens cost per million, in the budgets' unit (``[prices."<model>"]``:
    ``input`` for prompt tokens, ``cached_input`` for the prompt tokens the provider read
    from its prompt cache, ``output`` for completion tokens)."""

    #: The cost of a million prompt tokens.
    input: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    #: The cost of a million prompt tokens read from the provider's cache (unset: ``input``).
    cached_input: Annotated[float, msgspec.Meta(ge=0)] | None = None
    #: The cost of a million completion tokens.
    output: Annotated[float, msgspec.Meta(ge=0)] = 0.0

    def of(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> float:
        """The cost of a reply; ``cached_tokens`` are a part of ``prompt_tokens``."""
        cached = min(max(cached_tokens, 0), prompt_tokens)
        cached_price = self.input if self.cached_input is None else self.cached_input
        fresh = (prompt_tokens - cached) * self.input + cached * cached_price
        return (fresh + completion_tokens * self.output) / 1e6


class TenantSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[tenants."<name>"]``: one tenant's share of the fleet; ``[tenants."*"]`` is every
    tenant not named. Read by the loop workers (weight, max_active_turns, max_backlog) and
    the gateway (max_backlog, min_schedule_interval_s, the retention of sessions); set the
    same in every process."""

    #: The tenant's share of each loop worker's places, against the others' weights,
    #: while several tenants have turns waiting (a tenant alone gets every place).
    weight: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    #: The tenant's turns the whole fleet runs at once, both lanes (interactive, batch)
    #: together (0: no limit). Each lane's consumer holds at most this many delivered
    #: turns, running or waiting; the loop workers count the running ones together in
    #: the leases bucket (docs/ARCHITECTURE.md, "Fair share between tenants").
    max_active_turns: Annotated[int, msgspec.Meta(ge=0)] = 0
    #: Turns of the tenant waiting in the turns stream past which another is refused
    #: (0: no limit): by the gateway with a 429 ``backlog_full``, and, published on NATS,
    #: by the loop workers with an ``error`` event of that code; the refused turn never
    #: runs and is kept in the dead-letter stream.
    max_backlog: Annotated[int, msgspec.Meta(ge=0)] = 0
    #: The shortest time between two ticks of one of the tenant's schedules, in seconds:
    #: the gateway refuses a faster cron expression (422; 0: no minimum).
    min_schedule_interval_s: Annotated[float, msgspec.Meta(ge=0, le=86_400)] = 60.0
    #: The tenant's sessions idle this long (seconds) expire (0: never); an agent's own
    #: ``session_retention_s`` wins. The gateway sweeps them (``[gateway]
    #: retention_sweep_s``).
    session_retention_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    #: What expiring does: ``delete`` erases the session everywhere, ``snapshot`` keeps
    #: its last snapshot (and title and labels) and erases the rest.
    retention: Literal["delete", "snapshot"] = "delete"
    #: The tenant's memories ([loop.memory]) older than this (seconds) are erased (0:
    #: they stay until deleted). The gateway sweeps them with the sessions.
    memory_retention_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0


Tenants = dict[str, TenantSettings]


class SchedulerSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[scheduler]``: the scheduler every loop worker and gateway runs (docs/ARCHITECTURE.md,
    "Schedules"). A change to the schedules reaches every scheduler at once, through a
    watch of the bucket. A run claimed by a scheduler that stops before it says the turn is
    published is published again by another after ``republish_after_s``, up to
    ``republish_within_s`` after the claim (keep it under the turns stream's duplicate
    window, 120 s, which drops the second copy of a turn that did get out).

    ``max_per_tenant`` is the most schedules a tenant may have (0: no limit): a create
    past it is refused, through the gateway (429 ``quota_exceeded``) and ``loopmesh
    schedules add`` alike, each reading it from its own configuration. Two creates at
    the same moment may both pass the count, so a tenant can end a few over."""

    #: Run the scheduler in this process (off: this service fires no schedule).
    enabled: bool = True
    #: Until the schedules bucket is made, it is looked for again this often; a schedule
    #: whose step failed is tried again within this long.
    reload_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 30.0
    #: A schedule with a run held back (policy ``buffer_one``) checks this often whether
    #: the run before it has ended.
    buffer_check_s: Annotated[float, msgspec.Meta(gt=0, le=60)] = 1.0
    #: A claimed run not yet said to be published is published again after this long.
    republish_after_s: Annotated[float, msgspec.Meta(gt=0, le=60)] = 5.0
    #: A claimed run is published again only within this long of its claim (under the
    #: turns stream's 120 s duplicate window, which drops a second copy).
    republish_within_s: Annotated[float, msgspec.Meta(gt=0, le=110)] = 60.0
    #: The most schedules a tenant may have (0: no limit).
    max_per_tenant: Annotated[int, msgspec.Meta(ge=0)] = 100


class RuntimeSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How every command runs: ``[runtime]``, read before the command starts."""

    #: The asyncio event loop: ``uvloop`` where installed (else the standard one), or
    #: ``asyncio``, the standard one.
    event_loop: Literal["uvloop", "asyncio"] = "uvloop"


class RuntimeConfig(msgspec.Struct, frozen=True, kw_only=True):
    runtime: RuntimeSettings = RuntimeSettings()


def load(
    type_: type[T], path: str | Path | None = None, *, env: Mapping[str, str] | None = None
) -> T:
    """Read ``type_`` from a TOML file and ``LOOPMESH_<TABLE>__<FIELD>`` variables.

    The file is ``path``, else ``$LOOPMESH_CONFIG``, else none. Raises
    :class:`~loopmesh.errors.ConfigError` naming the file or variable, the field's path
    and the expected type.
    """
    env = os.environ if env is None else env
    if path is None and env.get(CONFIG_VAR):
        path = env[CONFIG_VAR]
    tables = _table_types(type_)
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        source = str(path)
        data = {k: v for k, v in _read_toml(Path(path)).items() if k in tables}
    overridden = _overlay_env(data, tables, env)
    try:
        return msgspec.convert(data, type_, strict=False)
    except msgspec.ValidationError as exc:
        if overridden and path is None:
            source = "environment (" + ", ".join(overridden) + ")"
        raise ConfigError(source, _name_keys(str(exc), data, type_)) from None


def replace(struct: S, source: str, **changes: Any) -> S:
    """``struct`` with ``changes`` (command-line options, say), validated the way a loaded
    file is: raises :class:`~loopmesh.errors.ConfigError` naming ``source`` and the field."""
    if not changes:
        return struct
    data = msgspec.to_builtins(struct)
    data.update(msgspec.to_builtins(changes))
    try:
        return msgspec.convert(data, type(struct), strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(source, str(exc)) from None


_AT = re.compile(r"`(\$[^`]*\[\.\.\.\][^`]*)`")
_STEP = re.compile(r'\.([^.\[]+)|\[(\d+)\]|\[("(?:[^"\\]|\\.)*")\]')


def _name_keys(message: str, data: dict[str, Any], type_: type[Any]) -> str:
    """msgspec's ``message`` with each ``[...]`` of its path (a value of a table keyed by
    name: ``[llm.limits.models."gpt-4o"]``) replaced by the key that fails: each key's
    value is converted alone until one fails the same way."""
    found = _AT.search(message)
    if found is None:
        return message
    path = found.group(1)
    head, _, tail = path.partition("[...]")
    table = _at(data, head)
    if not isinstance(table, dict):
        return message
    for key in list(table):
        others = {k: table.pop(k) for k in list(table) if k != key}
        try:
            msgspec.convert(data, type_, strict=False)
        except msgspec.ValidationError as exc:
            if str(exc).split(" - at ")[0] == message.split(" - at ")[0]:
                named = message.replace(path, f"{head}[{json.dumps(key)}]{tail}", 1)
                return _name_keys(named, data, type_)  # the next [...], within this key
        finally:
            table.update(others)
    return message


def _at(data: Any, path: str) -> Any:
    """The value at msgspec's ``path`` (``$.llm.limits.models``) in ``data``, or None."""
    for field, index, key in _STEP.findall(path.removeprefix("$")):
        if (field or key) and isinstance(data, dict):
            data = data.get(field or json.loads(key))
        elif index and isinstance(data, list) and int(index) < len(data):
            data = data[int(index)]
        else:
            return None
    return data


def environ(name: str, env: Mapping[str, str] | None = None, *, empty: bool = False) -> str | None:
    """One variable that another tool defines (``OPENAI_API_KEY``, say), or None when it
    is unset (or empty, unless ``empty``: tiktoken, say, takes an empty value as set)."""
    value = (os.environ if env is None else env).get(name)
    return value if value or (empty and value is not None) else None


def env_var(table: str, field: str) -> str:
    """The variable that overrides ``[table] field``: ``LOOPMESH_TABLE__FIELD``."""
    return f"{ENV_PREFIX}{table.upper()}__{field.upper()}"


def _check_readable(field: str, path: str | None) -> None:
    """A ValueError naming ``field`` when ``path`` (if set) cannot be opened for reading:
    inside a Struct's ``__post_init__`` it becomes the load's ConfigError."""
    if path is None:
        return
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise ValueError(f"`{field}`: cannot read {path}: {exc.strerror or exc}") from None


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(str(path), f"cannot read the file: {exc.strerror or exc}") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(str(path), f"not valid TOML: {exc}") from None


def _table_types(type_: type[Any]) -> dict[str, Any]:
    """Table name → the table's type, for each field of the top-level Struct."""
    try:
        return {f.encode_name: f.type for f in msgspec.structs.fields(type_)}
    except TypeError:
        raise TypeError(f"{type_!r} is not a msgspec Struct type") from None


def _overlay_env(data: dict[str, Any], tables: dict[str, Any], env: Mapping[str, str]) -> list[str]:
    """Set each ``LOOPMESH_<TABLE>__<FIELD>`` of a known table into ``data``; return the
    names of the variables applied. A value is converted to its field's type here, so
    a bad one is reported against its variable."""
    applied = []
    for var in sorted(env):
        if not var.startswith(ENV_PREFIX) or "__" not in var:
            continue
        table, _, field = var[len(ENV_PREFIX) :].lower().partition("__")
        if table not in tables:
            continue  # another service's table
        if not isinstance(_unwrap(mi.type_info(tables[table])), mi.StructType):
            # a table keyed by name ([prices."<model>"]) or an array of tables
            # ([[agents]]): no variable names one of its entries
            raise ConfigError(var, f"`[{table}]` is read from the config file only")
        fields = _struct_fields(tables[table])
        if field not in fields:
            if not _strict(tables[table]):
                continue  # a partial view of a table another service reads whole
            known = ", ".join(sorted(fields)) or "none"
            raise ConfigError(var, f"unknown setting `{table}.{field}` (known: {known})")
        value = _from_env(env[var], fields[field], var, f"{table}.{field}")
        section = data.get(table)
        if not isinstance(section, dict):
            section = data[table] = {}
        section[field] = value
        applied.append(var)
    return applied


def _strict(type_: Any) -> bool:
    """Whether a table's Struct refuses fields it does not know. One that does not is
    a service's partial view of a shared table (the gateway's ``[loop]``, say)."""
    info = _unwrap(mi.type_info(type_))
    return isinstance(info, mi.StructType) and info.forbid_unknown_fields


def _struct_fields(type_: Any) -> dict[str, Any]:
    info = _unwrap(mi.type_info(type_))
    if not isinstance(info, mi.StructType):
        return {}
    return {f.encode_name: f.type for f in msgspec.structs.fields(info.cls)}


def _unwrap(info: mi.Type) -> mi.Type:
    """The one non-None member of an optional type, else the type itself."""
    if isinstance(info, mi.UnionType):
        members = [t for t in info.types if not isinstance(t, mi.NoneType)]
        if len(members) == 1:
            return members[0]
    return info


_SEQUENCES = (mi.ListType, mi.TupleType, mi.VarTupleType, mi.SetType, mi.FrozenSetType)
_MAPPINGS = (mi.DictType, mi.StructType, mi.TypedDictType, mi.DataclassType)


def _from_env(raw: str, type_: Any, var: str, where: str) -> Any:
    """Convert a variable's text to ``type_``: numbers and bools by msgspec's lax rules,
    sequences from JSON lists or comma-separated text, tables from JSON objects."""
    info = _unwrap(mi.type_info(type_))
    value: Any = raw
    text = raw.strip()
    try:
        if isinstance(info, _MAPPINGS) or (isinstance(info, _SEQUENCES) and text[:1] == "["):
            value = json.loads(text)
        elif isinstance(info, _SEQUENCES):
            value = [item.strip() for item in text.split(",") if item.strip()]
    except json.JSONDecodeError as exc:
        raise ConfigError(var, f"`{where}`: not valid JSON: {exc}") from None
    try:
        return msgspec.convert(value, type_, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(var, f"`{where}`: {exc} (got {raw!r})") from None
