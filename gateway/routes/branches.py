"""``POST /v1/sessions/{session}/fork`` and ``.../rewind``: a new session as a session was
at a turn, or the session itself taken back to a turn (:mod:`gateway.branching`)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from schemas import new_id

from .. import api
from ..api import json_response as _json
from ..branching import Branching
from ..checks import check_id
from ..core import Gateway, Handler
from ..errors import Unprocessable
from ..openapi import SESSION, Operation


def _point(at_turn: str | None, before_turn: str | None) -> tuple[str, bool]:
    """The turn named and whether it is ``before_turn``: exactly one of the two."""
    if (at_turn is None) == (before_turn is None):
        raise Unprocessable(
            "name the point with exactly one of `at_turn` (the session as it was at the "
            "end of that turn) or `before_turn` (as it was before that turn began)",
            field="at_turn" if at_turn is not None else "before_turn",
        )
    if before_turn is not None:
        return check_id(before_turn, "before_turn"), True
    assert at_turn is not None
    return check_id(at_turn, "at_turn"), False


class Branches:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.store = Branching(gateway.backend)

    async def fork(self, request: Request) -> Response:
        g = self.gateway
        who = g.principal(request)
        source = check_id(request.path_params["session"], "session")
        body = await g.body(request, api.ForkSession)
        turn_id, before = _point(body.at_turn, body.before_turn)
        into = check_id(body.session, "session") if body.session is not None else new_id()
        if into == source:
            raise Unprocessable("a fork needs a session id of its own", field="session")
        fork, made = await self.store.fork(who.tenant, source, turn_id, before=before, into=into)
        return _json(
            api.SessionForked(
                tenant=who.tenant, session=into, source=source, agent=fork.agent,
                at_turn=made.last, turns=list(made.kept), messages=len(made.messages),
            ),
            201,
        )  # fmt: skip

    async def rewind(self, request: Request) -> Response:
        g = self.gateway
        who = g.principal(request)
        session = check_id(request.path_params["session"], "session")
        body = await g.body(request, api.RewindSession)
        turn_id, before = _point(body.at_turn, body.before_turn)
        _, made = await self.store.rewind(who.tenant, session, turn_id, before=before)
        calls = [
            api.RanCallView(call_id=c.call_id, server=c.server, tool=c.tool, status=c.status)
            for c in made.calls
        ]
        return _json(
            api.SessionRewound(
                tenant=who.tenant, session=session, to_turn=made.last, undone=list(made.later),
                calls=calls, messages=len(made.messages),
            )
        )  # fmt: skip

    def operations(self) -> list[tuple[Operation, Handler]]:
        return [
            (Operation("POST", "/v1/sessions/{session}/fork",
                       "fork a session as it was at a turn", 201, api.SessionForked,
                       api.ForkSession, (SESSION,), (400, 401, 404, 409, 413, 422, 429, 503)),
             self.fork),
            (Operation("POST", "/v1/sessions/{session}/rewind",
                       "take a session back to a turn", 200, api.SessionRewound,
                       api.RewindSession, (SESSION,), (400, 401, 404, 409, 413, 422, 429, 503)),
             self.rewind),
        ]  # fmt: skip
