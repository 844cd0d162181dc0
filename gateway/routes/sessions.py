"""``/v1/sessions``: create, list and read a tenant's sessions, and post a turn to one
(built and published by :meth:`~gateway.core.Gateway.start_turn`)."""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import Response

from schemas import SessionMeta, new_id

from .. import api
from ..api import json_response as _json
from ..checks import check_id
from ..core import Gateway, Handler
from ..errors import Conflict
from ..listing import check_labels, check_title, page, query_of
from ..openapi import SESSION, TOKEN, Operation, Param

IDEMPOTENCY_KEY = Param("Idempotency-Key", "header", "becomes the turn id", TOKEN)
NUMBER = {"type": "number", "minimum": 0}
LIST_PARAMS = (
    Param("agent", "query", "only the sessions of this agent", TOKEN),
    Param("label", "query", "`key=value` (or `key`: any value); repeat to ask for several",
          {"type": "string"}),
    Param("active_after", "query", "last active at or after (seconds since the epoch)", NUMBER),
    Param("active_before", "query", "last active before (seconds since the epoch)", NUMBER),
    Param("limit", "query", "sessions on a page (default 100, at most 1000)",
          {"type": "integer", "minimum": 1, "maximum": 1000}),
    Param("cursor", "query", "the previous page's `next_cursor`", {"type": "string"}),
)  # fmt: skip


class Sessions:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def create(self, request: Request) -> Response:
        g = self.gateway
        who = g.principal(request)
        body = await g.body(request, api.CreateSession)
        session = check_id(body.session, "session") if body.session is not None else new_id()
        agent = await g.known_agent(body.agent)
        meta = SessionMeta(
            title=check_title(body.title or ""), labels=check_labels(body.labels or {}),
            created_at=time.time(),
        )  # fmt: skip
        if not await g.backend.create_session(who.tenant, session, agent):
            raise Conflict(f"session {session!r} exists already", field="session")
        if meta.title or meta.labels:
            await g.backend.put_session_meta(who.tenant, session, meta, 0)
        return _json(api.SessionCreated(tenant=who.tenant, session=session, agent=agent), 201)

    async def listing(self, request: Request) -> Response:
        who = self.gateway.principal(request)
        query = query_of(request.query_params)
        return _json(page(await self.gateway.backend.session_index(who.tenant), query))

    async def get(self, request: Request) -> Response:
        g = self.gateway
        who = g.principal(request)
        s = await g.existing(who, check_id(request.path_params["session"], "session"))
        meta, _ = await g.backend.session_meta(who.tenant, s.session)
        return _json(
            api.SessionView(
                tenant=s.tenant, session=s.session, status=s.status, turn_id=s.turn_id,
                iteration=s.iteration, turns=s.turns, updated_at=s.updated_at,
                messages=list(s.messages), plan=list(s.plan), summary=s.summary,
                agent=s.agent, title=meta.title, labels=dict(meta.labels),
                tokens=s.tokens + (s.turn_tokens if s.status != "idle" else 0),
            )
        )  # fmt: skip

    async def post_turn(self, request: Request) -> Response:
        g = self.gateway
        who = g.principal(request)
        session = check_id(request.path_params["session"], "session")
        key = request.headers.get("idempotency-key")
        turn_id = check_id(key, "Idempotency-Key") if key is not None else new_id()
        body = await g.body(request, api.PostTurn)
        turn = g.turn(who, session, turn_id, body)
        last = await g.start_turn(request, turn)
        url = f"/v1/sessions/{session}/events?turn={turn_id}&since={last}"
        return _json(api.TurnPosted(turn_id=turn_id, session=session, events_url=url), 202)

    def operations(self) -> list[tuple[Operation, Handler]]:
        return [
            (Operation("POST", "/v1/sessions", "create a session", 201, api.SessionCreated,
                       api.CreateSession, errors=(400, 401, 409, 413, 422, 429, 503)),
             self.create),
            (Operation("GET", "/v1/sessions", "list the tenant's sessions", 200, api.SessionList,
                       params=LIST_PARAMS, errors=(401, 422, 429, 503)), self.listing),
            (Operation("GET", "/v1/sessions/{session}", "read a session", 200, api.SessionView,
                       params=(SESSION,), errors=(401, 404, 422, 429, 503)), self.get),
            (Operation("POST", "/v1/sessions/{session}/turns", "post a turn", 202, api.TurnPosted,
                       api.PostTurn, (SESSION, IDEMPOTENCY_KEY),
                       (400, 401, 409, 413, 422, 429, 503)), self.post_turn),
        ]  # fmt: skip
