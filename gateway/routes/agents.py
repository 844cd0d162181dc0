"""``/v1/agents``: the named agents (docs/AGENTS.md), as tenants see them."""

from __future__ import annotations

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from schemas import AgentSpec

from .. import api
from ..api import json_response as _json
from ..checks import check_id
from ..core import Gateway, Handler
from ..errors import NotFound
from ..openapi import AGENT, Operation


class Agents:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def listing(self, request: Request) -> Response:
        self.gateway.principal(request)
        agents = await self.gateway.backend.agents()
        return _json(api.AgentList(agents=[_shown(a) for a in agents]))

    async def get(self, request: Request) -> Response:
        self.gateway.principal(request)
        name = check_id(request.path_params["agent"], "agent")
        agent = await self.gateway.backend.agent(name)
        if agent is None:
            raise NotFound(f"no agent {name!r} (GET /v1/agents lists them)")
        return _json(_shown(agent))

    def operations(self) -> list[tuple[Operation, Handler]]:
        return [
            (Operation("GET", "/v1/agents", "the named agents", 200, api.AgentList,
                       errors=(401, 429, 503), tags=("agents",)), self.listing),
            (Operation("GET", "/v1/agents/{agent}", "read a named agent", 200, AgentSpec,
                       params=(AGENT,), errors=(401, 404, 422, 429, 503), tags=("agents",)),
             self.get),
        ]  # fmt: skip


def _shown(agent: AgentSpec) -> AgentSpec:
    """An agent as tenants see it: without its webhook (the operator's URL)."""
    return agent if agent.webhook is None else msgspec.structs.replace(agent, webhook=None)
