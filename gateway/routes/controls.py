"""What a client tells a session's running turn: cancel, pause or resume it, approve or
deny one of its pending tool calls. Each is a control message to the loop worker that
runs the turn; the turn's events say what came of it (``cancelled``, ``paused``,
``resumed``, the call's result)."""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from schemas import ApprovalDecision, Cancel, Pause, Resume

from .. import api
from ..api import json_response as _json
from ..checks import check_id, check_length
from ..core import Gateway, Handler
from ..openapi import CALL_ID, SESSION, Operation

#: The controls of ``POST /v1/sessions/{session}/<kind>``.
KINDS = ("cancel", "pause", "resume")


class Controls:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def control(self, request: Request) -> Response:
        g = self.gateway
        who = g.principal(request)
        session = check_id(request.path_params["session"], "session")
        body = await g.body(request, api.ControlRequest)
        reason = body.reason or ""
        check_length(reason, g.settings.max_reason_chars, "reason")
        await g.existing(who, session)
        kind = request.url.path.rsplit("/", 1)[1]
        now = time.time()
        match kind:
            case "cancel":
                control: Any = Cancel(tenant=who.tenant, session=session, at=now, reason=reason)
            case "pause":
                control = Pause(tenant=who.tenant, session=session, at=now)
            case _:
                control = Resume(tenant=who.tenant, session=session, at=now)
        await g.backend.send_control(control)
        return _json(api.ControlAccepted(type=kind, session=session), 202)

    async def approval(self, request: Request) -> Response:
        g = self.gateway
        who = g.principal(request)
        session = check_id(request.path_params["session"], "session")
        call_id = check_id(request.path_params["call_id"], "call_id")
        body = await g.body(request, api.ApprovalRequest)
        reason = body.reason or ""
        check_length(reason, g.settings.max_reason_chars, "reason")
        await g.existing(who, session)
        decision = ApprovalDecision(
            tenant=who.tenant, session=session, call_id=call_id, approved=body.approve,
            reason=reason, at=time.time(),
        )  # fmt: skip
        await g.backend.send_control(decision)
        kind = "approve" if body.approve else "deny"
        return _json(api.ControlAccepted(type=kind, session=session, call_id=call_id), 202)

    def operations(self) -> list[tuple[Operation, Handler]]:
        controls: list[tuple[Operation, Handler]] = [
            (Operation("POST", f"/v1/sessions/{{session}}/{kind}", f"{kind} the session's turn",
                       202, api.ControlAccepted, api.ControlRequest, (SESSION,),
                       (400, 401, 404, 413, 422, 429, 503)), self.control)
            for kind in KINDS
        ]  # fmt: skip
        return [
            *controls,
            (Operation("POST", "/v1/sessions/{session}/approvals/{call_id}",
                       "approve or deny a pending tool call", 202, api.ControlAccepted,
                       api.ApprovalRequest, (SESSION, CALL_ID),
                       (400, 401, 404, 413, 422, 429, 503)), self.approval),
        ]  # fmt: skip
