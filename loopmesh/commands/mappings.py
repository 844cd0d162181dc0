"""``loopmesh nats-mappings``: the nats-server configuration ``[nats] turn_partitions``
needs."""

from __future__ import annotations

import argparse

import msgspec

from loopmesh.cli import config_from_args
from loopmesh.mappings import mappings_conf
from loopmesh.settings import NatsSettings

#: Quiet at a terminal: only what it prints.
LOG_LEVEL = "WARNING"

HELP = """Print the subject mappings every nats-server needs for [nats] turn_partitions.

With more than one turns partition, each server routes a turn published on
<prefix>.turns.<tenant>.<session> to its tenant's turns stream: add what this prints to
every server's configuration (in the account loopmesh uses) and reload it. Every
loopmesh service checks the mappings at start and refuses to run without them. With one
partition it prints nothing."""


class _NatsOnly(msgspec.Struct, frozen=True, kw_only=True):
    nats: NatsSettings = NatsSettings()


def configure(parser: argparse.ArgumentParser) -> None:
    del parser  # --config (and LOOPMESH_NATS__*) say which [nats] it is for


async def main(args: argparse.Namespace) -> int:
    print(mappings_conf(config_from_args(_NatsOnly, args).nats.subjects), end="")
    return 0
