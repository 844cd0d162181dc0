"""Named agents in the configuration, and in the agents KV bucket.

The configuration defines agents as ``[[agents]]`` tables (fields: :class:`AgentSettings`,
which are :class:`schemas.agents.AgentSpec`'s); a service whose configuration carries
them checks them as it loads (:func:`check_agents`: names unique, callees defined, the
message naming the field) and provisioning makes the bucket hold exactly them
(:func:`apply_agents`): the configuration is the source of truth. The ``default`` agent
is always there: when no table names it, it is the deployment's ``[loop]``.

Readers: :func:`read_agents` reads the whole bucket at once (the gateway, the CLI);
:class:`AgentsWatch` keeps it current with a KV watch (the loop workers'
``loop_worker/agents.py``, and the NATS Agent Protocol's host, ``nats_agents/``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import msgspec
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from schemas import DecodeError, Subjects, ToolSpec, decode, encode
from schemas.agents import DEFAULT_AGENT, AgentSpec, default_agent

from . import toolnames
from .kv import kv_entries
from .watch import BucketWatch
from .webhook import WebhookRequest

log = logging.getLogger("loopmesh.agents")


class AgentSettings(AgentSpec, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One ``[[agents]]`` table: a named agent (docs/AGENTS.md), the fields of
    :class:`~schemas.agents.AgentSpec`, a misspelt one refused rather than ignored (its
    webhook's too). A field left unset is the deployment's ``[loop]`` or ``[llm]`` one."""

    webhook: WebhookRequest | None = None


#: The ``agents`` field of a service's configuration (the ``[[agents]]`` tables).
Agents = tuple[AgentSettings, ...]


def check_agents(agents: Sequence[AgentSpec]) -> None:
    """Raise ``ValueError`` naming the field (``agents[2].name``) when a name is defined
    twice, an agent names itself or an undefined agent among those it may call, or a
    table sets ``revision`` (the bucket's, not the configuration's)."""
    first: dict[str, int] = {}
    for i, agent in enumerate(agents):
        if agent.name in first:
            raise ValueError(
                f"`agents[{i}].name`: agent {agent.name!r} is defined twice "
                f"(first as agents[{first[agent.name]}])"
            )
        first[agent.name] = i
        if agent.revision:
            raise ValueError(
                f"`agents[{i}].revision`: set by the agents bucket, not by configuration"
            )
    defined = {*first, DEFAULT_AGENT}
    for i, agent in enumerate(agents):
        for j, callee in enumerate(agent.agents):
            where = f"`agents[{i}].agents[{j}]`"
            if callee == agent.name:
                raise ValueError(f"{where}: agent {agent.name!r} cannot call itself")
            if callee not in defined:
                known = ", ".join(sorted(defined))
                raise ValueError(
                    f"{where}: agent {agent.name!r} may call {callee!r}, which is not "
                    f"defined (defined: {known})"
                )


def agent_specs(agents: Sequence[AgentSpec]) -> tuple[AgentSpec, ...]:
    """What the bucket should hold for ``agents``: each as a plain
    :class:`~schemas.agents.AgentSpec`, with the ``default`` agent first unless defined."""
    specs = tuple(msgspec.convert(msgspec.to_builtins(a), AgentSpec) for a in agents)
    if not any(s.name == DEFAULT_AGENT for s in specs):
        specs = (default_agent(), *specs)
    return specs


def spec_of(key: str, value: bytes | None, revision: int) -> AgentSpec | None:
    """The agent a bucket entry holds, its revision set; ``None`` for a delete, a purge
    or a value that is not one (logged)."""
    if not value:
        return None
    try:
        spec = decode(value, AgentSpec)
    except DecodeError as exc:
        log.warning("bad agent definition key=%s error=%s", key, exc)
        return None
    if spec.name != key:
        log.warning("agent definition under another name key=%s name=%s", key, spec.name)
        return None
    return msgspec.structs.replace(spec, revision=revision)


class AgentsWatch(BucketWatch[AgentSpec]):
    """Every agent the agents bucket holds, each with its revision, kept current by a KV
    watch (:class:`~loopmesh.watch.BucketWatch` says how). ``default`` is there only when
    the bucket holds it; a changed definition calls ``on_change`` too."""

    what = "agents"
    values_change = True

    def decode(self, key: str, revision: int, value: bytes) -> AgentSpec | None:
        return spec_of(key, value, revision)


async def read_agents(
    js: JetStreamContext, subjects: Subjects, *, timeout: float = 5.0
) -> dict[str, AgentSpec]:
    """Every agent in the bucket by name, with its revision: ``default`` first (revision 0
    when the bucket does not hold it), then the others by name."""
    found: dict[str, AgentSpec] = {DEFAULT_AGENT: default_agent()}
    entries = await kv_entries(js, subjects.agents_bucket, timeout=timeout)
    for key, entry in sorted(entries.items()):
        spec = spec_of(key, entry.value, entry.revision)
        if spec is not None:
            found[key] = spec
    return found


async def apply_agents(
    js: JetStreamContext, subjects: Subjects, agents: Sequence[AgentSpec]
) -> list[str]:
    """Make the agents bucket hold ``agents`` (and ``default``) and nothing else: put
    what is new or changed, delete what the configuration no longer defines, leave the
    rest (and its revision) alone. Every write is revision-checked, so two services
    provisioning at once write each change once. Returns what was done."""
    kv = await js.key_value(subjects.agents_bucket)
    wanted = {s.name: s for s in agent_specs(agents)}
    have = await kv_entries(js, subjects.agents_bucket)
    actions = []
    for name, spec in wanted.items():
        entry = have.get(name)
        current = spec_of(name, entry.value, 0) if entry is not None else None
        if current == spec:
            continue
        payload = encode(spec)
        try:
            if entry is None:
                revision = await kv.create(name, payload)
            else:
                revision = await kv.update(name, payload, last=entry.revision)
        except KeyWrongLastSequenceError:
            log.info("agent %s was written meanwhile; leaving it", name)
            continue
        actions.append(f"{'updated' if entry else 'created'} agent {name} (revision {revision})")
    for name, entry in have.items():
        if name in wanted:
            continue
        try:
            await kv.delete(name, last=entry.revision)
        except (KeyWrongLastSequenceError, KeyNotFoundError):
            continue
        actions.append(f"deleted agent {name} (no longer configured)")
    return actions


def unmatched(agents: Sequence[AgentSpec], specs: Sequence[ToolSpec]) -> dict[str, str]:
    """What the agents name that matches nothing: tools and approval names not in the
    catalog ``specs``, callees not among ``agents``."""
    defined = {a.name for a in agents} | {DEFAULT_AGENT}
    out: dict[str, str] = {}
    for agent in agents:
        lists = {"tools": agent.tools or (), "approval_tools": agent.approval_tools}
        for field, names in lists.items():
            missing = toolnames.unmatched(names, specs)
            for i, name in enumerate(names):
                if name in missing:
                    closest = ", ".join(missing[name]) or "none close"
                    effect = (
                        "it allows nothing"
                        if field == "tools"
                        else "until it does, every tool call of its turns needs a person's approval"
                    )
                    out[f"{agent.name}.{field}[{i}]"] = (
                        f"{name!r} matches no tool in the catalog (closest: {closest}); {effect}"
                    )
        for i, callee in enumerate(agent.agents):
            if callee not in defined:
                out[f"{agent.name}.agents[{i}]"] = f"{callee!r} is not a defined agent"
    return out
