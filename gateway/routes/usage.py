"""``/v1/usage``: the tenant's LLM usage per day, agent and model (the usage bucket the
loop workers add to)."""

from __future__ import annotations

import time

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from loopmesh.usage import day_of

from .. import api
from ..api import json_response as _json
from ..checks import check_sequence
from ..core import Gateway, Handler
from ..errors import Unprocessable
from ..openapi import INT, Operation, Param

MAX_USAGE_DAYS = 31  # /v1/usage?days= at most (the bucket keeps 40)

DAYS = Param("days", "query", f"days back, today included (default 7, at most "
             f"{MAX_USAGE_DAYS})", INT)  # fmt: skip


class Usage:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def get(self, request: Request) -> Response:
        who = self.gateway.principal(request)
        days = check_sequence(request.query_params.get("days"), "days")
        days = 7 if days is None else days
        if not 1 <= days <= MAX_USAGE_DAYS:
            raise Unprocessable(f"`days` must be between 1 and {MAX_USAGE_DAYS}", field="days")
        since = day_of(time.time() - (days - 1) * 86_400)
        found = [d for d in await self.gateway.backend.usage(who.tenant) if d.day >= since]
        views = [
            api.UsageDayView(
                day=d.day, tokens=d.tokens, cost=d.cost, cached_tokens=d.cached_tokens,
                lines=[api.UsageLineView(**msgspec.structs.asdict(line)) for line in d.lines],
            )
            for d in found
        ]  # fmt: skip
        return _json(
            api.Usage(
                tenant=who.tenant, days=views, tokens=sum(d.tokens for d in found),
                cost=sum(d.cost for d in found),
                calls=sum(line.calls for d in found for line in d.lines),
                cached_tokens=sum(d.cached_tokens for d in found),
            )
        )  # fmt: skip

    def operations(self) -> list[tuple[Operation, Handler]]:
        return [
            (Operation("GET", "/v1/usage", "the tenant's LLM usage per day, agent and model",
                       200, api.Usage, params=(DAYS,), errors=(401, 422, 429, 503),
                       tags=("usage",)), self.get),
        ]  # fmt: skip
