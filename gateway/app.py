"""The gateway's HTTP application (Starlette), assembled from the routes of
:mod:`gateway.routes` (one module per resource), ``/mcp``, A2A and the web view; their
operation table also generates ``/openapi.json``. Errors become the API's error body
here, whichever handler raised them."""

from __future__ import annotations

import logging
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp

from . import api, mcp, webview
from .core import Gateway, Metrics
from .errors import GatewayError, NotFound
from .openapi import Operation, document
from .routes.agents import Agents
from .routes.audit import Audit
from .routes.branches import Branches
from .routes.controls import Controls
from .routes.events import Events
from .routes.health import Health
from .routes.memory import MemoryRoutes
from .routes.schedules import Schedules
from .routes.session_data import SessionData
from .routes.sessions import Sessions
from .routes.tools import Tools
from .routes.usage import Usage

__all__ = ["VERSION", "Gateway", "Metrics", "create_app"]

log = logging.getLogger("loopmesh.gateway")

VERSION = "1"  # of the HTTP API: /v1


def create_app(gateway: Gateway, mcp_app: ASGIApp | None = None) -> Starlette:
    """The app of ``gateway``'s operations, with ``mcp_app``
    (:class:`gateway.mcp.McpEndpoint`) served at ``/mcp`` when given."""
    health = Health(gateway)
    ops: list[tuple[Operation, Any]] = [
        *Sessions(gateway).operations(),
        *Branches(gateway).operations(),
        *SessionData(gateway).operations(),
        *Audit(gateway).operations(),
        *Events(gateway).operations(),
        *Controls(gateway).operations(),
        *Tools(gateway).operations(),
        *Agents(gateway).operations(),
        *Usage(gateway).operations(),
        *MemoryRoutes(gateway).operations(),
        *Schedules(gateway).operations(),
        *([mcp.operation(mcp_app)] if mcp_app is not None else []),
        *gateway.a2a.operations(),
        *health.operations(),
    ]
    health.openapi_json = msgspec.json.encode(
        document([op for op, _ in ops], title="loopmesh gateway", version=VERSION)
    )
    routes: list[Any] = [Route(op.path, handler, methods=[op.method]) for op, handler in ops]
    routes += [*health.routes(), *webview.routes()]
    return Starlette(
        routes=routes,
        exception_handlers={
            GatewayError: _gateway_error,
            HTTPException: _http_error,
            Exception: _crash,
        },
    )


def _error(exc: GatewayError) -> Response:
    body = api.ErrorBody(error=api.ErrorDetail(code=exc.code, message=exc.message, field=exc.field))
    response = api.json_response(body, exc.status)
    retry_after = getattr(exc, "retry_after", None)
    if retry_after is not None:
        response.headers["Retry-After"] = str(retry_after)
    if exc.status == 401:
        response.headers["WWW-Authenticate"] = "Bearer"
    return response


async def _gateway_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, GatewayError)
    return _error(exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        return _error(NotFound(f"no route {request.url.path}"))
    error = GatewayError(str(exc.detail))
    error.status, error.code = exc.status_code, "http_error"
    response = _error(error)
    response.headers.update(exc.headers or {})  # a 405's Allow
    return response


async def _crash(request: Request, exc: Exception) -> Response:
    log.exception("gateway error path=%s", request.url.path)
    return _error(GatewayError("internal error; see the gateway's log"))
