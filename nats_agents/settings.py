"""The NATS Agent Protocol host's settings: the ``[nats]`` and ``[nats_agents]`` tables.

::

    [nats_agents]
    tenant = "acme"                 # required: the tenant every prompt's turn runs in
    max_concurrent_prompts = 64     # prompts one agent serves at once, in one process
    max_input_chars = 100000        # a longer prompt is refused (400)
    turn_timeout_s = 600            # a turn not ended by then: an error (it goes on)
    heartbeat_s = 30                # the protocol's heartbeat, per agent
    drain_s = 10                    # on stop, prompts in flight get this long to end
    metrics_port = 9468             # /metrics and /healthz (unset: none)
    metrics_host = "127.0.0.1"      # "0.0.0.0" in a pod, for probes and Prometheus

A protocol request carries no tenant and no credential the host could map to one, so
the tenant is configuration, and there is no default: without it the host does not
start (``loopmesh up`` on its own loopback server takes ``local``, as its gateway does).
``metrics_port`` is unset by default, so neither ``loopmesh nats-agents`` nor ``loopmesh
up`` opens one unless asked; where set, its ``/healthz`` answers 200 while the host is
connected to NATS and serves the agents of the bucket (the probes of
``k8s/base/nats-agents.yaml``). Every field can be set with
``LOOPMESH_NATS_AGENTS__<FIELD>``.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from loopmesh.settings import NatsSettings
from schemas.ids import TOKEN_PATTERN

Positive = Annotated[float, msgspec.Meta(gt=0)]
AtLeastOne = Annotated[int, msgspec.Meta(ge=1)]
TenantId = Annotated[str, msgspec.Meta(pattern=TOKEN_PATTERN)]


class NatsAgentsSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[nats_agents]``: ``loopmesh nats-agents``, the agents on the NATS Agent Protocol
    (docs/AGENTS.md)."""

    #: The tenant every protocol prompt's turn runs in (its sessions, budgets, usage);
    #: also the ``owner`` token of the agents' subjects. Unset: the host does not start.
    tenant: TenantId | None = None
    #: Prompts one agent serves at once, in one process.
    max_concurrent_prompts: Annotated[int, msgspec.Meta(ge=1, le=10_000)] = 64
    #: A longer prompt is refused (400).
    max_input_chars: AtLeastOne = 100_000
    #: A prompt whose turn has not ended by then gets an error (the turn goes on).
    turn_timeout_s: Positive = 600.0
    #: The protocol's heartbeat of each agent, in seconds.
    heartbeat_s: Annotated[int, msgspec.Meta(ge=1, le=3600)] = 30
    #: At a stop, prompts in flight get this long to end.
    drain_s: Annotated[float, msgspec.Meta(ge=0)] = 10.0
    #: Where ``/metrics`` and ``/healthz`` listen (``0.0.0.0`` in a pod).
    metrics_host: str = "127.0.0.1"
    #: The port of ``/metrics`` and ``/healthz`` (``--metrics-port``; unset: none).
    metrics_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] | None = None


class NatsAgentsConfig(msgspec.Struct, frozen=True, kw_only=True):
    nats: NatsSettings = NatsSettings()
    nats_agents: NatsAgentsSettings = NatsAgentsSettings()
