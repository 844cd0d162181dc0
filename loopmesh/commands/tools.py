"""``loopmesh tools``: print the tool catalog (every tool some live worker serves)."""

from __future__ import annotations

import argparse
import json
import sys

from loopmesh.catalog import read_catalog
from loopmesh.nats import connect
from schemas import ToolSpec, encode

from .options import client_config

#: Quiet at a terminal: only its own lines, unless -v or --log-level asks for logs.
LOG_LEVEL = "WARNING"

HELP = """List the tools in the catalog: server.tool, pool, timeout and description.

Specs are refreshed by live tool workers and expire when none serves them."""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pool", help="only this pool's tools")
    parser.add_argument("--json", action="store_true", help="print the specs as JSON lines")


def render(specs: list[ToolSpec]) -> str:
    if not specs:
        return "no tools in the catalog (is a tool worker running?)\n"
    rows = [
        (
            f"{s.server}.{s.name}",
            s.pool,
            f"{s.timeout_s:g}s",
            ("approval " if s.needs_approval else "") + (s.description or s.title or ""),
        )
        for s in specs
    ]
    header = ("TOOL", "POOL", "TIMEOUT", "DESCRIPTION")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(3)]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row[:3], widths, strict=True)) + "  " + row[3]
        for row in [header, *rows]
    ]
    return "\n".join(line.rstrip() for line in lines) + "\n"


async def main(args: argparse.Namespace) -> int:
    nats = client_config(args).nats
    nc = await connect(nats, name="loopmesh-tools")
    try:
        specs = await read_catalog(nc.jetstream(), nats.subjects)
    finally:
        await nc.close()
    if args.pool:
        specs = [s for s in specs if s.pool == args.pool]
    if args.json:
        for spec in specs:
            sys.stdout.write(json.dumps(json.loads(encode(spec))) + "\n")
    else:
        sys.stdout.write(render(specs))
    return 0
