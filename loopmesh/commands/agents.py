"""``loopmesh agents [NAME]``: list the named agents, or show one, from the agents bucket."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

import msgspec
from nats.js import JetStreamContext

from loopmesh.agents import (
    Agents,
    agent_specs,
    apply_agents,
    check_agents,
    read_agents,
    unmatched,
)
from loopmesh.catalog import read_catalog
from loopmesh.cli import config_from_args
from loopmesh.errors import LoopmeshError
from loopmesh.nats import connect
from loopmesh.provision import ensure_bucket, has_msg_ttl
from loopmesh.settings import NatsSettings
from schemas import AgentSpec, Subjects, encode
from schemas.streams import agents_bucket

from .options import token

#: Quiet at a terminal: only its own lines, unless -v or --log-level asks for logs.
LOG_LEVEL = "WARNING"

HELP = """List the named agents (name, revision, model, tools, description), or show one.

Agents are defined by the [[agents]] tables of the configuration and provisioned to the
agents bucket; `default` is the deployment's [loop]. --apply provisions the
configuration's agents now (loop workers take a change from their next turn). Run a
turn of one with `loopmesh run --agent NAME "task"`."""


class AgentsConfig(msgspec.Struct, frozen=True, kw_only=True):
    nats: NatsSettings = NatsSettings()
    agents: Agents = ()

    def __post_init__(self) -> None:
        check_agents(self.agents)


#: What a field left unset means (the deployment's setting on the loop worker).
INHERITED = {
    "instructions": "[loop] instructions",
    "model": "[llm] model",
    "fallback_models": "[llm] fallback_models",
    "tools": "[loop] tools",
    "mode": "[loop] mode",
}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", nargs="?", type=token("agent"), help="show this agent only")
    parser.add_argument("--json", action="store_true", help="print the definitions as JSON lines")
    parser.add_argument(
        "--apply", action="store_true",
        help="make the agents bucket hold the configuration's [[agents]] (and default), then list",
    )  # fmt: skip


def render(agents: list[AgentSpec]) -> str:
    """The agents as a table."""
    rows = [
        (
            a.name,
            str(a.revision),
            a.model or "-",
            ", ".join(a.tools) if a.tools is not None else "-",
            a.description,
        )
        for a in agents
    ]
    header = ("AGENT", "REVISION", "MODEL", "TOOLS", "DESCRIPTION")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row[:4], widths, strict=True)) + "  " + row[4]
        for row in [header, *rows]
    ]
    return "\n".join(line.rstrip() for line in lines) + "\n"


def describe(agent: AgentSpec) -> str:
    """One agent, a field a line; an unset field says whose setting applies."""
    lines = []
    for field, value in msgspec.structs.asdict(agent).items():
        if value is None:
            if field not in INHERITED:
                continue
            shown = f"(the deployment's {INHERITED[field]})"
        elif isinstance(value, tuple):
            if not value:
                continue
            shown = ", ".join(value)
        elif isinstance(value, str) and "\n" in value:
            shown = value.replace("\n", "\n" + " " * 20)
        else:
            shown = str(value)
        lines.append(f"{field:<18}  {shown}")
    return "\n".join(lines) + "\n"


async def main(args: argparse.Namespace) -> int:
    config = config_from_args(AgentsConfig, args)
    subjects = config.nats.subjects
    nc = await connect(config.nats, name="loopmesh-agents")
    try:
        if args.apply:
            await ensure_bucket(
                nc.jetstream(), agents_bucket(subjects, replicas=config.nats.replicas),
                msg_ttl=has_msg_ttl(nc),
            )  # fmt: skip
            actions = await apply_agents(nc.jetstream(), subjects, config.agents)
            for action in actions or ["the agents bucket holds the configured agents already"]:
                print(action, file=sys.stderr)
            for where, why in (await _unmatched(nc.jetstream(), subjects, config.agents)).items():
                print(f"warning: agent {where}: {why}", file=sys.stderr)
        found = await read_agents(nc.jetstream(), subjects)
    finally:
        await nc.close()
    agents = list(found.values())
    if args.name is not None:
        if args.name not in found:
            raise LoopmeshError(f"no agent {args.name!r} (defined: {', '.join(found)})")
        agents = [found[args.name]]
    if args.json:
        for agent in agents:
            sys.stdout.write(json.dumps(json.loads(encode(agent))) + "\n")
    elif args.name is not None:
        sys.stdout.write(describe(agents[0]))
    else:
        sys.stdout.write(render(agents))
    return 0


async def _unmatched(
    js: JetStreamContext, subjects: Subjects, agents: Sequence[AgentSpec]
) -> dict[str, str]:
    """What the agents name that matches nothing, against the catalog as it is now (the
    loop workers say the same, loudly, while it stays so); nothing while the catalog is
    empty (no tool worker has started: nothing to tell yet)."""
    specs = await read_catalog(js, subjects)
    return unmatched(agent_specs(agents), specs) if specs else {}
