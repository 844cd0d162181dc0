"""The client through the HTTP gateway (docs/GATEWAY.md), with httpx.

A turn is ``POST /v1/sessions/S/turns`` (its id the ``Idempotency-Key``, so a retried
post is the same turn); a session's events are the SSE stream ``GET
/v1/sessions/S/events`` read with ``httpx-sse``, resumed with ``Last-Event-ID`` after
a dropped connection or a ``cut``, so nothing is missed or repeated; controls and
approvals are their POSTs; agents are ``GET /v1/agents``. The gateway's error
answers become :mod:`.errors`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator
from typing import Any

import httpx
import msgspec
from httpx_sse import aconnect_sse

from loopmesh.sessions import Query
from schemas import AgentSpec, ApprovalDecision, Cancel, Control, Pause, Resume, Turn

from .errors import (
    ClientError,
    InvalidRequest,
    NotFound,
    RateLimited,
    TurnRefused,
    Unauthorized,
    Unavailable,
)
from .transport import Erased, Fork, MemoryItem, Rewind, SessionEvent, SessionPage, Submitted

log = logging.getLogger("loopmesh.client")

#: The fields of a turn that ``POST /v1/sessions/S/turns`` takes (the gateway's
#: ``PostTurn``); the others a turn has are set by the gateway, or by agents and ``[loop]``.
TURN_FIELDS = (
    "input", "instructions", "model", "max_iterations", "tools", "mode", "planner_model",
    "executor_model", "context", "parts", "on_busy", "agent", "webhook", "user", "priority",
)  # fmt: skip

#: What the gateway sends besides events (no ``id``): see docs/GATEWAY.md.
NOTICES = frozenset({"trimmed", "caught_up", "cut"})


class _Error(msgspec.Struct):
    code: str = ""
    message: str = ""
    field: str | None = None


class _ErrorBody(msgspec.Struct):
    error: _Error


class _Posted(msgspec.Struct):
    turn_id: str
    session: str
    events_url: str


class _Memories(msgspec.Struct):
    memories: list[MemoryItem]


class _Erased(msgspec.Struct):
    erased: int


class _Agents(msgspec.Struct):
    agents: list[AgentSpec]


class GatewayTransport:
    """See the module docstring. ``timeout``: how long a request may take (an event
    stream may stay quiet for as long as it likes)."""

    #: Reconnects of an event stream in a row that bring nothing new, before giving up.
    RETRIES = 5

    def __init__(self, url: str, api_key: str | None, *, timeout: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.where = f"gateway {self.url}"
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(base_url=self.url, headers=headers, timeout=timeout)
        self._stream_timeout = httpx.Timeout(timeout, read=None)

    async def open(self) -> None:
        pass  # httpx connects on the first request

    async def close(self) -> None:
        await self._http.aclose()

    async def submit(self, turn: Turn) -> Submitted:
        fields = msgspec.to_builtins(turn)
        body = {k: fields[k] for k in TURN_FIELDS if fields.get(k) not in (None, [])}
        path = f"/v1/sessions/{turn.session}/turns"
        r = await self._request("POST", path, body, {"Idempotency-Key": turn.id}, turn=turn)
        posted = msgspec.json.decode(r.content, type=_Posted)
        since = httpx.URL(posted.events_url).params.get("since")
        return Submitted(posted.turn_id, posted.session, int(since) if since else 0)

    async def events(
        self, session: str, *, since: int, turn: str | None, follow: bool
    ) -> AsyncGenerator[SessionEvent, None]:
        """The session's events after ``since``, resumed across cuts and dropped
        connections; without ``follow``, only those stored when it was called."""
        last, fruitless = since, 0
        params = {"turn": turn} if turn else {}
        path = f"/v1/sessions/{session}/events"
        while True:
            got = False
            try:
                async with aconnect_sse(
                    self._http, "GET", path, params=params,
                    headers={"Last-Event-ID": str(last)}, timeout=self._stream_timeout,
                ) as source:  # fmt: skip
                    r = source.response
                    if r.status_code >= 400:
                        await r.aread()
                        raise self._refused(r, what=f"session {session!r}")
                    async for sse in source.aiter_sse():
                        if sse.event == "caught_up" and not follow:
                            return  # all that was stored has come
                        if sse.event == "cut":
                            break  # fell behind: resume after the last id
                        if sse.event == "trimmed":
                            log.warning("the gateway trimmed history: %s", sse.data)
                        if sse.event in NOTICES or not sse.data or not sse.id.isdigit():
                            continue  # (a keep-alive repeats the last id, with no data)
                        got = True
                        last = int(sse.id)
                        item = SessionEvent.of(last, sse.data.encode())
                        if item is not None:
                            yield item
            except httpx.HTTPError as exc:
                fruitless = 0 if got else fruitless + 1
                if fruitless > self.RETRIES:
                    raise Unavailable(
                        f"the gateway's event stream keeps failing: {exc}", url=self.url
                    ) from None
                await asyncio.sleep(0.2 * fruitless)
                continue
            fruitless = 0 if got else fruitless + 1
            if fruitless > self.RETRIES:
                raise Unavailable(
                    "the gateway's event stream keeps ending with nothing new", url=self.url
                )

    async def send(self, control: Control) -> None:
        base = f"/v1/sessions/{control.session}"
        what = f"session {control.session!r}"
        match control:
            case Cancel(turn_id=str(turn_id)):
                raise InvalidRequest(
                    f"cancelling turn {turn_id} by its id needs NATS: through the gateway, "
                    "cancel stops the session's running turn (give no turn id)",
                    field="turn_id",
                )
            case Cancel(reason=reason):
                await self._request(
                    "POST", f"{base}/cancel", {"reason": reason} if reason else {}, what=what
                )
            case Pause():
                await self._request("POST", f"{base}/pause", {}, what=what)
            case Resume():
                await self._request("POST", f"{base}/resume", {}, what=what)
            case ApprovalDecision(call_id=call_id, approved=approved, reason=reason):
                body: dict[str, Any] = {"approve": approved}
                if reason:
                    body["reason"] = reason
                await self._request("POST", f"{base}/approvals/{call_id}", body, what=what)

    async def agents(self) -> list[AgentSpec]:
        r = await self._request("GET", "/v1/agents", None)
        return msgspec.json.decode(r.content, type=_Agents).agents

    async def memories(self, kind: str, name: str) -> list[MemoryItem]:
        r = await self._request("GET", f"/v1/memory?{kind}={name}", None)
        return msgspec.json.decode(r.content, type=_Memories).memories

    async def remember(self, kind: str, name: str, text: str) -> MemoryItem:
        r = await self._request("POST", "/v1/memory", {kind: name, "text": text})
        return msgspec.json.decode(r.content, type=MemoryItem)

    async def forget(self, kind: str, name: str, id: str) -> bool:
        try:
            await self._request("DELETE", f"/v1/memory/{id}?{kind}={name}", None)
        except NotFound:
            return False
        return True

    async def erase_memories(self, kind: str, name: str) -> int:
        r = await self._request("DELETE", f"/v1/memory?{kind}={name}", None)
        return msgspec.json.decode(r.content, type=_Erased).erased

    async def fork(self, session: str, *, turn: str, before: bool, into: str | None) -> Fork:
        body = {"before_turn" if before else "at_turn": turn}
        if into is not None:
            body["session"] = into
        path = f"/v1/sessions/{session}/fork"
        r = await self._request("POST", path, body, what=f"session {session!r}")
        return msgspec.json.decode(r.content, type=Fork)

    async def rewind(self, session: str, *, turn: str, before: bool) -> Rewind:
        body = {"before_turn" if before else "at_turn": turn}
        path = f"/v1/sessions/{session}/rewind"
        r = await self._request("POST", path, body, what=f"session {session!r}")
        return msgspec.json.decode(r.content, type=Rewind)

    async def sessions(self, tenant: str, query: Query) -> SessionPage:
        params: list[tuple[str, str]] = [("limit", str(query.limit))]
        if query.agent is not None:
            params.append(("agent", query.agent))
        for key, value in query.labels.items():
            params.append(("label", key if value is None else f"{key}={value}"))
        if query.active_after is not None:
            params.append(("active_after", repr(query.active_after)))
        if query.active_before is not None:
            params.append(("active_before", repr(query.active_before)))
        if query.after is not None:
            params.append(("cursor", query.after))
        try:
            r = await self._http.get("/v1/sessions", params=tuple(params))
        except httpx.HTTPError as exc:
            raise Unavailable(
                f"cannot reach the gateway at {self.url}: {exc}", url=self.url
            ) from None
        if r.status_code >= 400:
            raise self._refused(r, what="/v1/sessions")
        return msgspec.json.decode(r.content, type=SessionPage)

    async def delete_session(self, tenant: str, session: str) -> Erased:
        path = f"/v1/sessions/{session}"
        r = await self._request("DELETE", path, None, what=f"session {session!r}")
        return msgspec.json.decode(r.content, type=Erased)

    # -- answers ------------------------------------------------------------------------

    async def _request(
        self,
        method: str,
        path: str,
        body: Any,
        headers: dict[str, str] | None = None,
        *,
        what: str = "",
        turn: Turn | None = None,
    ) -> httpx.Response:
        try:
            r = await self._http.request(method, path, json=body, headers=headers)
        except httpx.HTTPError as exc:
            raise Unavailable(
                f"cannot reach the gateway at {self.url}: {exc}", url=self.url
            ) from None
        if r.status_code >= 400:
            raise self._refused(r, what=what or path, turn=turn)
        return r

    def _refused(self, r: httpx.Response, *, what: str, turn: Turn | None = None) -> ClientError:
        """The error an answer of 400 or more stands for (docs/GATEWAY.md, "Errors")."""
        try:
            error = msgspec.json.decode(r.content, type=_ErrorBody).error
        except msgspec.DecodeError:
            error = _Error(message=r.content.decode(errors="replace")[:300])
        status, code, field = r.status_code, error.code, error.field
        message = f"the gateway answered {status} {code}: {error.message}"
        if status == 401:
            return Unauthorized(message, status=status, code=code)
        if status == 404:
            return NotFound(message, what=what, status=status, code=code)
        if status == 429:
            retry_after = r.headers.get("retry-after", "")
            wait = float(retry_after) if retry_after.isdigit() else 0.0
            return RateLimited(message, url=self.url, retry_after=wait, status=status, code=code)
        if status >= 500:
            return Unavailable(message, url=self.url, status=status, code=code)
        if turn is not None and status in (400, 409, 413, 422):
            return TurnRefused(
                message, turn_id=turn.id, session=turn.session, status=status, code=code,
                field=field,
            )  # fmt: skip
        if status in (400, 413, 422):
            return InvalidRequest(message, status=status, code=code, field=field)
        return ClientError(message, status=status, code=code)
