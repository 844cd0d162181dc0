"""How the commands people type (``run``, ``events``, ``approve``, ``deny``, ``cancel``)
reach loopmesh: through :class:`loopmesh.Client`, straight to NATS or through the HTTP
gateway, as ``[client]`` and ``[nats]`` say (:mod:`loopmesh.client.config`) and the
options below override (``--gateway URL``, ``--api-key KEY``, ``--tenant``)."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from loopmesh.cli import config_from_args
from loopmesh.client import Client, ClientConfig, NotSetUp
from loopmesh.settings import replace
from schemas import check_token


def token(kind: str) -> Any:
    """An argparse ``type`` that accepts only a valid id."""

    def check(value: str) -> str:
        try:
            return check_token(value, kind)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return check


def add_remote_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("how to reach loopmesh (default: straight to NATS)")
    group.add_argument(
        "--gateway", metavar="URL",
        help="through the HTTP gateway at URL instead of NATS ([client] gateway)",
    )  # fmt: skip
    group.add_argument(
        "--api-key", metavar="KEY",
        help="the gateway's API key ([client] api_key; prefer LOOPMESH_CLIENT__API_KEY, "
        "which other users cannot see in the process list)",
    )  # fmt: skip
    group.add_argument(
        "--tenant", type=token("tenant"),
        help="tenant id over NATS (default: [client] tenant, local); a gateway key decides it",
    )  # fmt: skip
    group.add_argument(
        "--connect-timeout", type=float, default=0.0, metavar="S",
        help="keep trying to reach NATS, and for loopmesh's streams to be there, for this "
        "long (for a `loopmesh up` still starting)",
    )  # fmt: skip


def client_config(args: argparse.Namespace) -> ClientConfig:
    config = config_from_args(ClientConfig, args)
    changes: dict[str, Any] = {}
    if getattr(args, "gateway", None):
        changes["gateway"] = args.gateway
    if getattr(args, "api_key", None):
        changes["api_key"] = args.api_key
    if getattr(args, "tenant", None):
        changes["tenant"] = args.tenant
    client = replace(config.client, "the command line", **changes)
    return msgspec.structs.replace(config, client=client)


@contextlib.asynccontextmanager
async def open_client(args: argparse.Namespace) -> AsyncIterator[Client]:
    """The client the options and settings name, connected."""
    wait_s = getattr(args, "connect_timeout", 0.0)
    client = Client.from_config(client_config(args), connect_wait_s=wait_s, name="loopmesh-cli")
    try:
        try:
            await client.connect()
        except NotSetUp as exc:
            raise NotSetUp(
                f"{exc}; --connect-timeout S waits for one starting",
                url=exc.url, missing=exc.missing,
            ) from None  # fmt: skip
        yield client
    finally:
        await client.close()
