"""``loopmesh nats-mappings``: the nats-server configuration ``[nats] turn_partitions``
needs."""

from __future__ import annotations

import argparse

import msgspec

from loopmesh.cli import config_from_args
from loopmesh.mappings import mappings_conf
from loopmesh.settings import NatsSettings

from .options import token

#: Quiet at a terminal: only what it prints.
LOG_LEVEL = "WARNING"

HELP = """Print the subject mappings every nats-server needs for [nats] turn_partitions.

With more than one turns partition, each server routes a turn published on
<prefix>.turns.<tenant>.<session> to its tenant's turns stream: add what this prints to
every server's configuration (in the account loopmesh uses) and reload it. Every
loopmesh service checks the mappings at start and refuses to run without them. With one
partition it prints nothing.

The server checks a client's permissions against the mapped subject: with --tenant, it
also prints, per tenant, the subject a NATS user of that tenant must be allowed to
publish its turns on (<prefix>.turnp.<k>.<tenant>.>)."""


class _NatsOnly(msgspec.Struct, frozen=True, kw_only=True):
    nats: NatsSettings = NatsSettings()


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tenant", action="append", default=[], type=token("tenant"),
        help="print where this tenant's NATS user publishes its turns (repeatable)",
    )  # fmt: skip


async def main(args: argparse.Namespace) -> int:
    subjects = config_from_args(_NatsOnly, args).nats.subjects
    print(mappings_conf(subjects), end="")
    for tenant in args.tenant:
        print(f"# tenant {tenant} publishes its turns on: {subjects.published_turns_of(tenant)}")
    return 0
