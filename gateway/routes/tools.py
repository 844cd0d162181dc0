"""``/v1/tools``: the tool catalog, every tool the tool workers serve."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from .. import api
from ..api import json_response as _json
from ..core import Gateway, Handler
from ..openapi import Operation


class Tools:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def catalog(self, request: Request) -> Response:
        self.gateway.principal(request)
        return _json(api.ToolList(tools=await self.gateway.backend.tools()))

    def operations(self) -> list[tuple[Operation, Handler]]:
        return [
            (Operation("GET", "/v1/tools", "the tool catalog", 200, api.ToolList,
                       errors=(401, 429, 503), tags=("tools",)), self.catalog),
        ]  # fmt: skip
