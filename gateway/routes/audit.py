"""``/v1/audit``: the tenant's audit records (``schemas/audit.py``: sessions erased or
expired), read back from the audit stream."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from .. import api
from ..api import json_response as _json
from ..checks import check_sequence
from ..core import Gateway, Handler
from ..errors import Unprocessable
from ..openapi import INT, Operation, Param

MAX_AUDIT = 1_000  # /v1/audit?limit= at most

LIMIT = Param("limit", "query", f"the latest records (default 100, at most {MAX_AUDIT})", INT)


class Audit:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def get(self, request: Request) -> Response:
        who = self.gateway.principal(request)
        limit = check_sequence(request.query_params.get("limit"), "limit")
        limit = 100 if limit is None else limit
        if not 1 <= limit <= MAX_AUDIT:
            raise Unprocessable(f"`limit` must be between 1 and {MAX_AUDIT}", field="limit")
        records = await self.gateway.backend.audit(who.tenant, limit)
        return _json(api.AuditList(records=records))

    def operations(self) -> list[tuple[Operation, Handler]]:
        return [
            (Operation("GET", "/v1/audit", "the tenant's audit records: sessions erased or expired",
                       200, api.AuditList, params=(LIMIT,), errors=(401, 422, 429, 503),
                       tags=("audit",)), self.get),
        ]  # fmt: skip
