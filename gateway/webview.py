"""The live web view at ``/``: one static page (``gateway/static/``: HTML, CSS and a JS
module; no build step, nothing from a CDN) that talks to the ``/v1`` API like any client.

The page sends the API key (pasted once, kept in the tab's ``sessionStorage``) as an
``Authorization: Bearer`` header on every call, including the event stream, which it
reads with ``fetch()`` rather than ``EventSource`` (which cannot set headers): a key
never goes into a URL, so never into an access log or the browser history. The page is
public, like ``/docs``: it holds no data until a key (or no-auth mode) lets it ask.

Served with a strict Content-Security-Policy (scripts and styles from this origin only,
no inline script, no ``eval``), as a second wall behind the page's rule of putting
event data on screen as text only.
"""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import Message, Receive, Scope, Send

STATIC_DIR = Path(__file__).parent / "static"

#: Headers of the page and its assets.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-cache",
}


async def index(request: Request) -> Response:
    return FileResponse(STATIC_DIR / "index.html", headers=SECURITY_HEADERS)


class _Assets:
    """The static files, with the page's security headers."""

    def __init__(self) -> None:
        self._files = StaticFiles(directory=STATIC_DIR)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers += [(k.lower().encode(), v.encode()) for k, v in SECURITY_HEADERS.items()]
                message = {**message, "headers": headers}
            await send(message)

        await self._files(scope, receive, send_with_headers)


def routes() -> list[BaseRoute]:
    """``/`` and ``/static/...``."""
    return [
        Route("/", index, methods=["GET"]),
        Mount("/static", app=_Assets(), name="webview-static"),
    ]
