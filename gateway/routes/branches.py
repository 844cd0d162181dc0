"""``POST /v1/sessions/{session}/fork`` and ``.../rewind``: a new session as a session was
at a turn, or the session itself taken back to a turn (:mod:`loopmesh.branching`, with
this gateway's NATS connection and its reader of a session's stored events)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from loopmesh.branching import Branching
from loopmesh.errors import BranchRefused
from schemas import new_id
from schemas.codec import DecodeError
from schemas.events import Event, decode_event

from .. import api
from ..api import json_response as _json
from ..checks import check_id
from ..core import Gateway, Handler
from ..errors import Busy, Conflict, GatewayError, NotFound, Unavailable, Unprocessable
from ..openapi import SESSION, Operation

#: The gateway's answer to each kind of refusal.
REFUSALS: dict[str, type[GatewayError]] = {
    "not_found": NotFound, "busy": Busy, "conflict": Conflict, "invalid": Unprocessable,
}  # fmt: skip


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

    async def fork(self, request: Request) -> Response:
        g = self.gateway
        who = g.principal(request)
        source = check_id(request.path_params["session"], "session")
        body = await g.body(request, api.ForkSession)
        turn_id, before = _point(body.at_turn, body.before_turn)
        into = check_id(body.session, "session") if body.session is not None else new_id()
        async with self._refusals("fork"):
            branching = await self._branching()
            fork, made = await branching.fork(who.tenant, source, turn_id, before=before, into=into)
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
        async with self._refusals("rewind"):
            branching = await self._branching()
            _, made = await branching.rewind(who.tenant, session, turn_id, before=before)
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

    async def _branching(self) -> Branching:
        b = self.gateway.backend
        s = b.subjects
        return Branching(
            b.js, b.publisher(), s, sessions=await b.kv(s.sessions_bucket),
            leases=await b.kv(s.leases_bucket), events=self._events, timeout=b.timeout,
        )  # fmt: skip

    async def _events(self, tenant: str, session: str) -> list[Event]:
        """The session's stored events, read from its partition's stream."""
        b = self.gateway.backend
        first, last = await b.events_bounds(tenant, session)
        if last == 0:
            return []
        stream = b.subjects.events_stream_of(tenant, session)
        subject = b.subjects.session_events(tenant, session)
        out: list[Event] = []
        async with contextlib.aclosing(
            b.stored_events(stream, subject, max(first, 1), "the session's events")
        ) as batches:
            async for batch in batches:
                for msg in batch:
                    with contextlib.suppress(DecodeError):
                        out.append(decode_event(msg.data))
        return out

    @staticmethod
    @contextlib.asynccontextmanager
    async def _refusals(what: str) -> AsyncIterator[None]:
        """A refusal as its HTTP answer; NATS not answering in time as a 503."""
        try:
            yield
        except BranchRefused as exc:
            raise REFUSALS[exc.kind](exc.message, field=exc.field) from None
        except TimeoutError:
            raise Unavailable(f"NATS did not answer in time ({what}); try again") from None

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
