"""What is served without a key: ``/healthz`` (alive), ``/readyz`` (NATS connected and
streams present), ``/metrics`` (Prometheus), ``/openapi.json`` and the ``/docs`` page
that renders it."""

from __future__ import annotations

from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from .. import api, docs
from ..api import json_response as _json
from ..core import Gateway, Handler
from ..openapi import Operation


class Health:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        #: ``/openapi.json``'s body, set by the app once its operations are known.
        self.openapi_json = b""

    async def healthz(self, request: Request) -> Response:
        return _json(api.Health(status="ok"))

    async def readyz(self, request: Request) -> Response:
        problem = await self.gateway.backend.ready()
        if problem is not None:
            return _json(api.Health(status="unavailable", detail=problem), 503)
        return _json(api.Health(status="ready"))

    async def prometheus(self, request: Request) -> Response:
        registry = self.gateway.metrics.registry
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    async def openapi(self, request: Request) -> Response:
        return Response(self.openapi_json, media_type="application/json")

    async def docs_page(self, request: Request) -> Response:
        return HTMLResponse(docs.page("/openapi.json", "/docs/assets"))

    def operations(self) -> list[tuple[Operation, Handler]]:
        return [
            (Operation("GET", "/healthz", "alive", 200, api.Health, errors=(), public=True,
                       tags=("health",)), self.healthz),
            (Operation("GET", "/readyz", "NATS connected and streams present", 200, api.Health,
                       errors=(503,), public=True, tags=("health",)), self.readyz),
        ]  # fmt: skip

    def routes(self) -> list[Any]:
        """The routes outside the OpenAPI document: metrics, the document, its page."""
        return [
            Route("/metrics", self.prometheus, methods=["GET"]),
            Route("/openapi.json", self.openapi, methods=["GET"]),
            Route("/docs", self.docs_page, methods=["GET"]),
            Mount("/docs/assets", app=StaticFiles(directory=docs.assets_dir()), name="docs-assets"),
        ]
