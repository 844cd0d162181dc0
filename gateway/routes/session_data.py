"""A session as data: ``PATCH /v1/sessions/{session}`` sets its title and labels,
``DELETE /v1/sessions/{session}`` erases it everywhere (:mod:`loopmesh.erase`: its
running turn cancelled first, the sessions of the agents it called with it, the erase
recorded on the tenant's audit subject). Listing and filtering: :mod:`gateway.listing`."""

from __future__ import annotations

import msgspec
from nats.js.errors import KeyWrongLastSequenceError
from starlette.requests import Request
from starlette.responses import Response

from loopmesh.errors import EraseError
from loopmesh.sessions import summary

from .. import api
from ..api import json_response as _json
from ..checks import check_id
from ..core import Gateway, Handler
from ..errors import Conflict, NotFound, Unavailable
from ..listing import check_labels, check_title
from ..openapi import SESSION, Operation

_WRITE_TRIES = 5


class SessionData:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def update(self, request: Request) -> Response:
        g = self.gateway
        who = g.principal(request)
        session = check_id(request.path_params["session"], "session")
        body = await g.body(request, api.UpdateSession)
        title = check_title(body.title) if body.title is not None else None
        labels = check_labels(body.labels) if body.labels is not None else None
        snapshot = await g.existing(who, session)
        for _ in range(_WRITE_TRIES):
            meta, revision = await g.backend.session_meta(who.tenant, session)
            changed = msgspec.structs.replace(
                meta,
                title=meta.title if title is None else title,
                labels=meta.labels if labels is None else labels,
            )
            try:
                await g.backend.put_session_meta(who.tenant, session, changed, revision)
            except KeyWrongLastSequenceError:
                continue  # another change came first: apply this one to it
            return _json(summary(snapshot, changed))
        raise Conflict(f"session {session!r} is being changed by others; try again")

    async def delete(self, request: Request) -> Response:
        g = self.gateway
        who = g.principal(request)
        session = check_id(request.path_params["session"], "session")
        eraser = g.backend.eraser(g.settings.erase_cancel_wait_s)
        try:
            erased = await eraser.erase(who.tenant, session, by=f"key {who.key}")
        except EraseError as exc:
            raise Unavailable(exc.message) from None
        if erased is None:
            raise NotFound(f"no session {session!r}")
        return _json(
            api.SessionErasedView(
                session=session, erased_at=erased.at, children=list(erased.children),
                removed=dict(erased.removed),
            )
        )  # fmt: skip

    def operations(self) -> list[tuple[Operation, Handler]]:
        return [
            (Operation("PATCH", "/v1/sessions/{session}", "set a session's title or labels", 200,
                       api.SessionSummary, api.UpdateSession, (SESSION,),
                       (400, 401, 404, 409, 413, 422, 429, 503)), self.update),
            (Operation("DELETE", "/v1/sessions/{session}",
                       "erase a session everywhere, with the sessions of the agents it called",
                       200, api.SessionErasedView, params=(SESSION,),
                       errors=(401, 404, 422, 429, 503)), self.delete),
        ]  # fmt: skip
