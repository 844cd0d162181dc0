"""The A2A endpoints of the gateway (routed, and described in ``/openapi.json``, with the
rest in ``gateway/app.py``): each agent's card, and its JSON-RPC endpoint served by the
SDK's dispatcher.

========================================  ========  ========================================
path                                      key       what
========================================  ========  ========================================
``/.well-known/agent-card.json``          public    the ``default`` agent's card
``/a2a/<agent>/.well-known/agent-card.json``  public  ``<agent>``'s card (404: no such agent)
``POST /a2a/<agent>``                     required  A2A JSON-RPC 2.0 (protocol 1.0): send,
                                                    stream, get, list, cancel, subscribe,
                                                    push-notification configs
========================================  ========  ========================================

Before the SDK sees a request, the gateway does what it does for every request: the API
key (401 without one: no key, no task), the key's rate limit (429), the agent (404 if
nobody defined it), the body's size (413 past ``max_body_bytes``) and, for the two
streaming methods and ``SendMessage``, the key's cap on long-lived calls (429,
``max_streams_per_key``: each holds a slot until it is answered). What the SDK answers
after that
is the protocol's: a JSON-RPC result or error (``-32602`` invalid params, ``-32001``
task not found, ...), or an SSE stream of them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from a2a.server.routes import create_jsonrpc_routes
from google.protobuf.json_format import MessageToDict
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Message

from schemas import DEFAULT_AGENT, AgentSpec

from .. import api
from ..auth import Principal, StreamSlots
from ..backend import Backend
from ..checks import check_id, read_body
from ..errors import NotFound
from ..openapi import AGENT, Operation
from ..settings import GatewaySettings
from ..sse import Guarded
from .caller import SCOPE_KEY, Caller, ContextBuilder
from .card import agent_card, handler_card
from .handler import Handler
from .push import PushConfigStore, PushSender

#: The JSON-RPC methods whose answer is a stream.
STREAMING = frozenset({"SendStreamingMessage", "SubscribeToTask"})
#: The methods that hold a slot of the key's ``max_streams_per_key`` while they run: the
#: streams, and a send, whose answer (unless it asks to return at once) waits for the
#: turn.
HOLDING = STREAMING | {"SendMessage"}


class _Method(msgspec.Struct):
    method: Any = None


_method_of = msgspec.json.Decoder(_Method)


class A2A:
    """The SDK's request handler and JSON-RPC dispatcher, behind the gateway's checks."""

    def __init__(
        self,
        backend: Backend,
        settings: GatewaySettings,
        principal: Callable[[Request], Principal],
        slots: StreamSlots,
        on_turn: Callable[[], None] = lambda: None,
    ) -> None:
        self.backend = backend
        self.settings = settings
        self.principal = principal
        self.slots = slots
        push_store = PushConfigStore(backend)
        self.push = PushSender(
            push_store, allowlist=settings.push_allowlist, timeout_s=settings.push_timeout_s,
            queue=settings.push_queue,
        )  # fmt: skip
        self.handler = Handler(backend, settings, handler_card(), push_store, self.push, on_turn)
        (route,) = create_jsonrpc_routes(
            self.handler, rpc_url="/a2a/{agent}", context_builder=ContextBuilder()
        )
        assert isinstance(route, Route)
        self._dispatch = route.endpoint

    async def close(self) -> None:
        """End the tasks this gateway follows (their turns go on) and the push client."""
        await self.handler.aclose()
        await self.push.aclose()

    async def agent(self, request: Request) -> AgentSpec:
        name = check_id(request.path_params.get("agent", DEFAULT_AGENT), "agent")
        agent = await self.backend.agent(name)
        if agent is None:
            raise NotFound(f"no agent {name!r} (GET /v1/agents lists them)")
        return agent

    async def card(self, request: Request) -> Response:
        agent = await self.agent(request)
        base = self.settings.public_url or listening_at(request)
        card = agent_card(agent, base, keys=not self.settings.no_auth)
        return JSONResponse(MessageToDict(card))

    async def rpc(self, request: Request) -> Response:
        who = self.principal(request)
        agent = await self.agent(request)
        body = await read_body(request, self.settings.max_body_bytes)
        scope = dict(request.scope)
        scope[SCOPE_KEY] = Caller(who.tenant, who.key, agent.name)
        inner = Request(scope, _replay(body, request))
        method = _method(body)
        if method not in HOLDING:
            return await self._dispatch(inner)
        if method not in STREAMING:  # answered once the turn ends (or asks for input)
            with self.slots.held(who.key):
                return await self._dispatch(inner)
        self.slots.acquire(who.key)
        try:
            response = await self._dispatch(inner)
        except BaseException:
            self.slots.release(who.key)
            raise

        async def release() -> None:
            self.slots.release(who.key)

        return Guarded(response, release)  # type: ignore[return-value]

    def operations(self) -> list[tuple[Operation, Callable[[Request], Awaitable[Response]]]]:
        """The A2A routes with their OpenAPI entries (public: the cards)."""
        return [
            (Operation("GET", "/.well-known/agent-card.json", "the default agent's A2A card",
                       200, api.A2AAgentCard, errors=(503,), public=True, tags=("a2a",)),
             self.card),
            (Operation("GET", "/a2a/{agent}/.well-known/agent-card.json", "an agent's A2A card",
                       200, api.A2AAgentCard, params=(AGENT,), errors=(404, 422, 503),
                       public=True, tags=("a2a",)), self.card),
            (Operation("POST", "/a2a/{agent}", "A2A JSON-RPC: send, stream, tasks, push configs",
                       200, api.JsonRpcResponse, api.JsonRpcRequest, params=(AGENT,),
                       errors=(401, 404, 413, 422, 429, 503), tags=("a2a",)), self.rpc),
        ]  # fmt: skip


def listening_at(request: Request) -> str:
    """The base URL of the address ``request`` arrived at: the gateway's own socket, never
    the request's ``Host`` or ``X-Forwarded-*`` headers (a shared cache would keep a card
    whose URL a client chose, and send the next callers' keys there). The gateway serves
    plain HTTP; behind a proxy, ``[gateway] public_url`` says the address callers use."""
    host, port = request.scope["server"]  # uvicorn's: the socket's own address
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


def _method(body: bytes) -> object:
    try:
        return _method_of.decode(body).method
    except msgspec.DecodeError:
        return None  # the SDK answers it with the protocol's parse error


def _replay(body: bytes, request: Request) -> Callable[[], Any]:
    """A ``receive`` that gives the body already read, then the client's own."""
    given = False

    async def receive() -> Message:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await request.receive()

    return receive
