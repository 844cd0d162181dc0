"""A session's events, live over SSE (:mod:`gateway.stream` on the shared feed of
:mod:`gateway.fanout`), and the tenant's latest events across its sessions."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from .. import api
from ..checks import check_id, check_sequence
from ..core import Gateway, Handler
from ..errors import Unprocessable
from ..openapi import INT, INT_TEXT, SESSION, TOKEN, Operation, Param
from ..sse import Guarded, SseResponse
from ..stream import EventStream

_LATEST_SCAN_FACTOR = 50  # /v1/events/latest: up to limit x this many messages per stream

SINCE = Param(
    "since", "query", "stream events after this sequence (history); without it (and "
    "Last-Event-ID), from the start of the session's current turn", INT,
)  # fmt: skip
TURN = Param("turn", "query", "only this turn's events", TOKEN)
LAST_EVENT_ID = Param("Last-Event-ID", "header", "resume after this sequence", INT_TEXT)
LIMIT = Param("limit", "query", "how many events (default 100)", INT)


class Events:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def stream(self, request: Request) -> Response:
        g = self.gateway
        who = g.principal(request)
        session = check_id(request.path_params["session"], "session")
        turn = request.query_params.get("turn")
        if turn is not None:
            check_id(turn, "turn")
        after = check_sequence(request.query_params.get("since"), "since")
        resume = check_sequence(request.headers.get("last-event-id"), "Last-Event-ID")
        if resume is not None:
            after = resume  # a reconnect continues after what it last got
        await g.existing(who, session)
        if after is None:  # from the start of the session's current turn, if it has one
            after = await g.backend.current_turn_start(who.tenant, session)
        g.slots.acquire(who.key)
        stream = EventStream(
            g.fanout, who.tenant, session, after=after, turn=turn,
            buffer=g.settings.stream_buffer,
        )  # fmt: skip
        try:
            await stream.__aenter__()
        except BaseException:
            g.slots.release(who.key)
            raise
        g.metrics.sse_clients.inc()

        async def cleanup() -> None:
            await stream.close()
            if stream.was_cut:
                g.metrics.sse_cut.inc()
            g.slots.release(who.key)
            g.metrics.sse_clients.dec()

        response = SseResponse(
            stream,
            keepalive_s=g.settings.keepalive_s,
            send_timeout_s=g.settings.send_timeout_s,
        )
        return Guarded(response, cleanup)  # type: ignore[return-value]

    async def latest(self, request: Request) -> Response:
        g = self.gateway
        who = g.principal(request)
        limit = check_sequence(request.query_params.get("limit"), "limit")
        limit = 100 if limit is None else limit
        if not 1 <= limit <= g.settings.latest_max:
            raise Unprocessable(
                f"`limit` must be between 1 and {g.settings.latest_max}", field="limit"
            )
        found = await g.backend.latest_events(who.tenant, limit, scan=limit * _LATEST_SCAN_FACTOR)
        body = b"[" + b",".join(_with_seq(seq, data) for seq, data in found) + b"]"
        return Response(body, media_type="application/json")

    def operations(self) -> list[tuple[Operation, Handler]]:
        return [
            (Operation("GET", "/v1/sessions/{session}/events", "stream the session's events (SSE)",
                       200, None, params=(SESSION, TURN, SINCE, LAST_EVENT_ID),
                       errors=(401, 404, 422, 429, 503), media="text/event-stream"),
             self.stream),
            (Operation("GET", "/v1/events/latest", "the tenant's latest events, with `seq`", 200,
                       api.LatestEvents, params=(LIMIT,), errors=(401, 422, 429, 503),
                       tags=("events",)), self.latest),
        ]  # fmt: skip


def _with_seq(seq: int, data: bytes) -> bytes:
    """An event's JSON with ``"seq"`` first."""
    body = data.strip()
    if not body.startswith(b"{"):
        return b'{"seq":%d}' % seq
    rest = body[1:].lstrip()
    sep = b"" if rest.startswith(b"}") else b","
    return b'{"seq":%d%s%s' % (seq, sep, rest)
