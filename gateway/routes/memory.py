"""``/v1/memory``: the tenant's memories across sessions ([loop.memory]), by user or by
agent: list, add, delete one, erase all of a user's (or an agent's)."""

from __future__ import annotations

import secrets
import time

from starlette.requests import Request
from starlette.responses import Response

from loopmesh.memory import MemoryStore
from schemas.memory import Memory, MemoryKind, MemorySource

from .. import api
from ..api import json_response as _json
from ..checks import check_id
from ..core import Gateway, Handler
from ..errors import NotFound, Unprocessable
from ..openapi import Operation, Param

_ID = {"type": "string", "pattern": api.PATH_ID_PATTERN}
USER = Param("user", "query", "the user whose memories (or `agent`)", _ID)
AGENT = Param("agent", "query", "the agent whose memories (or `user`)", _ID)
MEMORY = Param("memory", "path", "memory id", _ID, True)
TAGS = ("memory",)


class MemoryRoutes:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def _store(self) -> MemoryStore:
        return await self.gateway.backend.memory()

    async def listing(self, request: Request) -> Response:
        who = self.gateway.principal(request)
        kind, name = _namespace(request.query_params.get("user"), request.query_params.get("agent"))
        found = await (await self._store()).list(who.tenant, kind, name)
        return _json(api.MemoryList(memories=[_view(m) for m in found]))

    async def add(self, request: Request) -> Response:
        who = self.gateway.principal(request)
        body = await self.gateway.body(request, api.MemoryNew)
        kind, name = _namespace(body.user, body.agent)
        memory = Memory(
            id=secrets.token_hex(10), tenant=who.tenant, kind=kind, name=name,
            text=body.text, created_at=time.time(), source=MemorySource(by="api"),
        )  # fmt: skip
        await (await self._store()).put(memory)
        return _json(_view(memory), status=201)

    async def delete(self, request: Request) -> Response:
        who = self.gateway.principal(request)
        id = check_id(request.path_params["memory"], "memory")
        kind, name = _namespace(request.query_params.get("user"), request.query_params.get("agent"))
        if not await (await self._store()).delete(who.tenant, kind, name, id):
            raise NotFound(f"no memory {id!r} of {kind} {name!r}")
        return Response(status_code=204)

    async def erase(self, request: Request) -> Response:
        who = self.gateway.principal(request)
        kind, name = _namespace(request.query_params.get("user"), request.query_params.get("agent"))
        erased = await (await self._store()).erase(who.tenant, kind, name)
        return _json(api.MemoryErased(erased=erased))

    def operations(self) -> list[tuple[Operation, Handler]]:
        return [
            (Operation("GET", "/v1/memory", "a user's or an agent's memories", 200,
                       api.MemoryList, params=(USER, AGENT), errors=(401, 422, 429, 503),
                       tags=TAGS), self.listing),
            (Operation("POST", "/v1/memory", "add a memory of a user or an agent", 201,
                       api.MemoryView, body=api.MemoryNew,
                       errors=(400, 401, 413, 422, 429, 503), tags=TAGS), self.add),
            (Operation("DELETE", "/v1/memory", "erase all of a user's (or an agent's) "
                       "memories", 200, api.MemoryErased, params=(USER, AGENT),
                       errors=(401, 422, 429, 503), tags=TAGS), self.erase),
            (Operation("DELETE", "/v1/memory/{memory}", "delete one memory", 204,
                       params=(MEMORY, USER, AGENT), errors=(401, 404, 422, 429, 503),
                       tags=TAGS), self.delete),
        ]  # fmt: skip


def _namespace(user: str | None, agent: str | None) -> tuple[MemoryKind, str]:
    """``("user", id)`` or ``("agent", name)``: exactly one of the two must be given."""
    if (user is None) == (agent is None):
        raise Unprocessable("give exactly one of `user` and `agent`", field="user")
    if user is not None:
        return "user", check_id(user, "user")
    return "agent", check_id(agent, "agent")


def _view(m: Memory) -> api.MemoryView:
    return api.MemoryView(
        id=m.id, kind=m.kind, name=m.name, text=m.text, created_at=m.created_at,
        source=m.source,
    )  # fmt: skip
