"""``/openapi.json``, generated: paths from the gateway's operation table, schemas from
the msgspec types with :func:`msgspec.json.schema_components`. Nothing here describes a
body by hand."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import msgspec

from schemas.events import AnyEvent

from .api import PATH_ID_PATTERN, ErrorBody

REF = "#/components/schemas/{name}"

_STATUS_TEXT = {
    202: "a notification, accepted",
    400: "malformed body: the message names the bad field's path",
    401: "missing or unknown API key",
    403: "an Origin header that is not a loopback one (no-auth mode)",
    405: "a method this path does not serve",
    406: "an Accept header without application/json and text/event-stream",
    404: "no such session or schedule in this tenant, no such agent, no such route (or MCP method)",
    409: "the session or schedule exists already",
    413: "body over the size limit",
    421: "a Host header that is not a loopback one (no-auth mode)",
    422: "a value out of bounds or an invalid id: `field` names it",
    429: "over the key's rate limit (see Retry-After) or its cap on long-lived calls",
    503: "NATS did not answer in time",
}


@dataclass(frozen=True)
class Param:
    name: str
    where: str  # "path", "query" or "header"
    description: str
    schema: dict[str, Any]
    required: bool = False


@dataclass(frozen=True)
class Operation:
    method: str
    path: str
    summary: str
    ok: int
    response: Any = None  # a msgspec type, or None for no JSON body
    body: Any = None
    params: tuple[Param, ...] = ()
    errors: tuple[int, ...] = (400, 401, 422, 429, 503)
    media: str = "application/json"
    public: bool = False  # no API key needed
    tags: tuple[str, ...] = field(default=("sessions",))
    # An endpoint whose answers another specification defines (``/mcp``: JSON-RPC):
    # errors carry this type instead of ErrorBody, the OK answer is JSON or a stream
    # of it (``text/event-stream``), and 202 acknowledges a notification.
    error_body: Any = ErrorBody
    streams: bool = False


SESSION = Param(
    "session", "path", "session id", {"type": "string", "pattern": PATH_ID_PATTERN}, True
)
CALL_ID = Param(
    "call_id", "path", "tool call id", {"type": "string", "pattern": PATH_ID_PATTERN}, True
)
AGENT = Param("agent", "path", "agent name", {"type": "string", "pattern": PATH_ID_PATTERN}, True)

#: Schemas of parameters: a count or sequence, one as header text, an id.
INT = {"type": "integer", "minimum": 0}
INT_TEXT = {"type": "string", "pattern": r"^[0-9]{1,19}$"}
TOKEN = {"type": "string", "pattern": PATH_ID_PATTERN}


def document(operations: list[Operation], *, title: str, version: str) -> dict[str, Any]:
    types: list[Any] = [ErrorBody, AnyEvent]
    for op in operations:
        for t in (op.body, op.response, op.error_body):
            if t is not None and t not in types:
                types.append(t)
    refs, components = msgspec.json.schema_components(types, ref_template=REF)
    ref_of = dict(zip(map(_key, types), refs, strict=True))
    paths: dict[str, dict[str, Any]] = {}
    for op in operations:
        entry: dict[str, Any] = {
            "summary": op.summary,
            "operationId": _operation_id(op),
            "tags": list(op.tags),
            "responses": {},
        }
        if op.params:
            entry["parameters"] = [
                {
                    "name": p.name,
                    "in": p.where,
                    "description": p.description,
                    "required": p.required,
                    "schema": p.schema,
                }
                for p in op.params
            ]
        if op.body is not None:
            entry["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": ref_of[_key(op.body)]}},
            }
        ok: dict[str, Any] = {"description": "OK"}
        if op.media == "text/event-stream":
            ok["content"] = {
                "text/event-stream": {
                    "schema": {"type": "string"},
                    "x-event-data": ref_of[_key(AnyEvent)],
                }
            }
        elif op.response is not None:
            ok["content"] = {op.media: {"schema": ref_of[_key(op.response)]}}
            if op.streams:  # each event: `data` holds one JSON message (the answer last)
                data = {"type": "string", "contentMediaType": "application/json",
                        "contentSchema": ref_of[_key(op.response)]}  # fmt: skip
                event = {"type": "object", "required": ["data"],
                         "properties": {"event": {"type": "string"}, "data": data,
                                        "id": {"type": "string"}}}  # fmt: skip
                ok["content"]["text/event-stream"] = {"schema": event}
        elif op.media != "application/json":
            ok["content"] = {op.media: {"schema": {"type": "string"}}}
        entry["responses"][str(op.ok)] = ok
        if op.streams:
            entry["responses"]["202"] = {"description": _STATUS_TEXT[202]}
        errors = op.errors if not op.public else tuple(e for e in op.errors if e not in (401, 429))
        for status in errors:
            entry["responses"][str(status)] = {
                "description": _STATUS_TEXT[status],
                "content": {"application/json": {"schema": ref_of[_key(op.error_body)]}},
            }
        if not op.public:
            entry["security"] = [{"bearer": []}]
        paths.setdefault(op.path, {})[op.method.lower()] = entry
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }


def _key(t: Any) -> str:
    return repr(t)


def _operation_id(op: Operation) -> str:
    words = re.sub(r"[{}]", "", op.path).strip("/").replace("/", "_")
    return f"{op.method.lower()}_{words}"
