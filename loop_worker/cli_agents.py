"""``loopmesh agents [NAME]``: list the named agents, or show one, from the agents bucket."""

from __future__ import annotations

import argparse
import json
import sys

import msgspec

from loopmesh.agents import read_agents
from loopmesh.cli import config_from_args
from loopmesh.nats import connect
from schemas import AgentSpec, Subjects, encode

from .remote import ClientConfig, token

#: Quiet at a terminal: only its own lines, unless -v or --log-level asks for logs.
LOG_LEVEL = "WARNING"

HELP = """List the named agents (name, revision, model, tools, description), or show one.

Agents are defined by the [[agents]] tables of the configuration and provisioned to the
agents bucket; `default` is the deployment's [loop]. Run a turn of one with
`loopmesh run --agent NAME "task"`."""

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
    config = config_from_args(ClientConfig, args)
    nc = await connect(config.nats, name="loopmesh-agents")
    try:
        found = await read_agents(nc.jetstream(), Subjects(config.nats.prefix))
    finally:
        await nc.close()
    agents = list(found.values())
    if args.name is not None:
        if args.name not in found:
            known = ", ".join(found)
            print(f"loopmesh agents: no agent {args.name!r} (defined: {known})", file=sys.stderr)
            return 1
        agents = [found[args.name]]
    if args.json:
        for agent in agents:
            sys.stdout.write(json.dumps(json.loads(encode(agent))) + "\n")
    elif args.name is not None:
        sys.stdout.write(describe(agents[0]))
    else:
        sys.stdout.write(render(agents))
    return 0
