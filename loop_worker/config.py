"""The loop worker's configuration: the ``[nats]``, ``[llm]``, ``[loop]`` and
``[loop_worker]`` tables, and the ``[[agents]]``.

::

    [loop_worker]
    max_active_turns = 256     # turns run at once by one process
    tenant_max_active = 16     # per tenant, per process (default 0: no limit)
    ack_wait_s = 2             # the turns consumer's AckWait; in-progress acks every third
    lease_ttl_s = 2            # a dead worker's sessions are free again after this
    drain_timeout_s = 20       # on SIGTERM, in-flight turns get this long to finish
    metrics_port = 9464        # /metrics and /healthz (unset: none)

Every field can be set with ``LOOPMESH_LOOP_WORKER__<FIELD>``.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from loopmesh.agents import Agents, check_agents
from loopmesh.settings import NatsSettings, Port, Price, SchedulerSettings, Tenants
from loopmesh.webhook import WebhookSettings, check_agent_webhooks
from schemas.streams import LEASE_TTL_S, TURN_ACK_WAIT_S

from .engine.settings import LLMSettings, LoopSettings

Positive = Annotated[float, msgspec.Meta(gt=0)]
AtLeastOne = Annotated[int, msgspec.Meta(ge=1)]
Count = Annotated[int, msgspec.Meta(ge=0)]


class ServiceSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[loop_worker]``: one loop worker process: its capacity, its timers, its metrics."""

    #: The worker's name in events and leases (empty: ``host-pid``).
    name: str = ""
    #: Turns one process runs at once.
    max_active_turns: AtLeastOne = 256
    #: Turns held besides, waiting while an earlier turn of their session runs.
    max_waiting_turns: Count = 256
    #: Turns of one tenant one process runs at once (0: no limit).
    tenant_max_active: Count = 0
    #: Each tenant's turns consumer's AckWait: a turn unacked this long goes to another worker; a
    #: running turn is kept with in-progress acks every third of it.
    ack_wait_s: Positive = TURN_ACK_WAIT_S
    #: A session's lease outlives its worker by this long: then another worker may take
    #: the session of a worker that died. Renewed every third of it.
    lease_ttl_s: Positive = LEASE_TTL_S
    #: A worker full of waiting turns hands back a turn that waited this long for an
    #: earlier turn of its session running elsewhere.
    order_wait_s: Positive = 30.0
    #: Deliveries of a turn (the consumer's ``max_deliver``); then it is dead-lettered.
    max_deliveries: AtLeastOne = 10
    #: A pull request for turns lasts this long on the server, holding a place meanwhile;
    #: a turn is handed over the moment it is delivered. Short: every worker hears of a
    #: new turn, and those that ask for it after another took it wait in vain.
    fetch_timeout_s: Positive = 0.1
    #: The consumers and the turns stream are scanned for turns waiting this often
    #: (besides the publishes the worker sees as they happen).
    rescan_s: Positive = 10.0
    #: A tenant's consumer unused this long is removed, and made again at its next turn.
    tenant_idle_s: Positive = 3600.0
    #: At SIGTERM, turns in flight get this long to finish; the rest are handed back.
    drain_timeout_s: Positive = 20.0
    #: Unused: the catalog is watched, not re-read.
    catalog_refresh_s: Positive = 5.0
    #: A turn waits this long for the tool catalog's first load.
    catalog_load_timeout_s: Positive = 10.0
    #: A tenant's spend today is read from the usage ledger at most this often (the
    #: daily budgets, ``[loop.budget]``; 0: before every LLM call).
    usage_read_every_s: Annotated[float, msgspec.Meta(ge=0)] = 1.0
    #: Added to a tool's timeout while the worker waits for its reply (the tool
    #: worker reports its own timeouts first).
    tool_grace_s: Positive = 5.0
    #: The rate-limit leader (``[llm.limits]``) is replaced after its key went this long
    #: without renewal; it renews every third of this, at most every second, and grants
    #: only within two thirds of this from when it sent its last renewal.
    limiter_ttl_s: Positive = 6.0
    #: Where ``/metrics`` and ``/healthz`` listen (``0.0.0.0`` in a pod).
    metrics_host: str = "127.0.0.1"
    #: The port of ``/metrics`` and ``/healthz`` (``--metrics-port``; unset: none).
    metrics_port: Port | None = None
    #: Create missing streams, consumers and buckets at start, and write ``[[agents]]``
    #: to the agents bucket (``--no-provision`` turns it off).
    provision: bool = True


class LoopWorkerConfig(msgspec.Struct, frozen=True, kw_only=True):
    nats: NatsSettings = NatsSettings()
    llm: LLMSettings = LLMSettings()
    loop: LoopSettings = LoopSettings()
    loop_worker: ServiceSettings = ServiceSettings()
    prices: dict[str, Price] = {}  # per model: the budgets' cost ([loop.budget])
    #: ``[tenants."<name>"]`` (``"*"``: every other tenant): weights and limits of the
    #: fair share between tenants.
    tenants: Tenants = {}
    scheduler: SchedulerSettings = SchedulerSettings()  # fires the schedules' ticks
    #: The named agents (``[[agents]]``, docs/AGENTS.md): provisioned to the agents
    #: bucket when the worker starts; its turns read them from there.
    agents: Agents = ()
    #: ``[webhooks]``: a turn's webhook is checked against its egress policy when the
    #: turn arrives from NATS (the gateway checks those it accepts).
    webhooks: WebhookSettings = WebhookSettings()

    def __post_init__(self) -> None:
        check_agents(self.agents)
        check_agent_webhooks(self.agents, self.webhooks)
