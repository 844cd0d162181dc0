"""Built-in tools: ``calculator``, ``current_time`` and ``http_fetch``.

``calculator`` evaluates arithmetic by walking the ``ast`` of the expression (numbers,
``+ - * / // % **``, unary signs, parentheses, a few functions and constants of
:mod:`math`); nothing is ever passed to ``eval``, and exponents are bounded so that
``9**9**9`` is refused instead of eating the CPU. ``http_fetch`` reads an http(s) URL
with a size and a time limit, only from public addresses unless the allowlist names a
host (see :mod:`loopmesh.egress`); it sends the call's idempotency key as an
``Idempotency-Key`` header (see :mod:`tool_worker.context`).
"""

from __future__ import annotations

import ast
import asyncio
import datetime as dt
import math
import operator
import time
from collections.abc import Callable
from typing import Annotated, Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import httpx
import msgspec

from loopmesh.egress import Address, Allowlist, Egress, Resolver, pinned, resolve
from loopmesh.errors import EgressRefused, EgressUnresolved

from .context import HEADER, ToolContext
from .errors import Rejected, ToolError
from .local import to_tool, tool
from .registry import Tool

MAX_EXPRESSION = 1000
MAX_POWER_BITS = 10_000  # an integer power may have at most this many bits

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}
_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "abs": abs,
    "round": round,
    "min": min,
    "max": max,
    "sqrt": math.sqrt,
    "exp": math.exp,
    "log": math.log,
    "log10": math.log10,
    "sin": math.sin,
    "cos": math.cos,
    "tan": math.tan,
    "floor": math.floor,
    "ceil": math.ceil,
}
_CONSTANTS = {"pi": math.pi, "e": math.e, "tau": math.tau}


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression; raises :class:`ToolError` when it is not one."""
    if len(expression) > MAX_EXPRESSION:
        raise ToolError(f"expression longer than {MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ToolError(f"not an arithmetic expression: {exc.msg}") from None
    try:
        return _eval(tree.body)
    except ZeroDivisionError:
        raise ToolError("division by zero") from None
    except (OverflowError, ValueError) as exc:
        raise ToolError(f"cannot compute: {exc}") from None


def _eval(node: ast.AST) -> Any:
    match node:
        case ast.Constant(value=bool()):
            raise ToolError("booleans are not numbers here")
        case ast.Constant(value=int() | float() as value):
            return value
        case ast.BinOp(left=left, op=ast.Pow(), right=right):
            return _power(_eval(left), _eval(right))
        case ast.BinOp(left=left, op=op, right=right) if type(op) in _BINARY:
            return _BINARY[type(op)](_eval(left), _eval(right))
        case ast.UnaryOp(op=op, operand=operand) if type(op) in _UNARY:
            return _UNARY[type(op)](_eval(operand))
        case ast.Name(id=name) if name in _CONSTANTS:
            return _CONSTANTS[name]
        case ast.Call(func=ast.Name(id=name), args=args, keywords=[]) if name in _FUNCTIONS:
            return _FUNCTIONS[name](*(_eval(a) for a in args))
        case ast.Call(func=ast.Name(id=name)):
            known = ", ".join(sorted(_FUNCTIONS))
            raise ToolError(f"unknown function {name!r} (known: {known})")
        case ast.Name(id=name):
            raise ToolError(f"unknown name {name!r} (known: {', '.join(sorted(_CONSTANTS))})")
    raise ToolError(f"{type(node).__name__} is not allowed in arithmetic")


def _power(base: Any, exponent: Any) -> Any:
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0:
        if max(base.bit_length(), 1) * exponent > MAX_POWER_BITS:
            raise ToolError(f"{base}**{exponent} is too large (limit {MAX_POWER_BITS} bits)")
    elif abs(exponent) > MAX_POWER_BITS:
        raise ToolError(f"exponent {exponent} is too large")
    return base**exponent


@tool(timeout_s=5)
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression (+ - * / // % **, parentheses, sqrt, log, sin, pi...)."""
    return str(evaluate(expression))


@tool(timeout_s=5)
async def current_time(timezone: str | None = None) -> str:
    """The current date and time in ISO 8601, in an IANA timezone (default UTC)."""
    try:
        zone = ZoneInfo(timezone) if timezone else dt.UTC
    except (ZoneInfoNotFoundError, ValueError):
        raise ToolError(
            f"unknown timezone {timezone!r} (use an IANA name like Europe/Paris)"
        ) from None
    return dt.datetime.now(zone).isoformat()


class FetchResult(msgspec.Struct, frozen=True, kw_only=True):
    url: str
    status: int
    content_type: str
    content: str
    truncated: bool
    elapsed_ms: float


def http_fetch_tool(
    *,
    allowlist: tuple[str, ...] = (),
    max_bytes: int = 1_000_000,
    timeout_s: float = 10.0,
    resolver: Resolver = resolve,
    transport: httpx.AsyncBaseTransport | None = None,
) -> Tool:
    """The ``http_fetch`` tool with its limits and egress policy (see
    :mod:`loopmesh.egress`): by default only public addresses; ``allowlist`` entries
    name hosts (``*.example.com`` allows subdomains), addresses or networks. Raises
    ``ValueError`` for a bad allowlist entry. ``resolver`` and ``transport`` are for tests."""
    egress = Egress(Allowlist(allowlist), resolver)

    @tool(timeout_s=timeout_s + 1)
    async def http_fetch(
        url: Annotated[
            str, msgspec.Meta(description="The URL exactly as given, http:// or https://")
        ],
        max_chars: Annotated[int, msgspec.Meta(ge=1)] | None = None,
        context: ToolContext | None = None,
    ) -> FetchResult:
        """Fetch http(s) URL: read a web page and return its text."""
        try:
            target = httpx.URL(url)
        except (httpx.InvalidURL, TypeError) as exc:
            raise Rejected(f"not a valid URL {url!r}: {exc}") from None
        if target.scheme not in ("http", "https"):
            raise Rejected(f"only http and https URLs can be fetched, not {target.scheme!r}")
        if not target.host:
            raise Rejected(f"URL {url!r} has no host")
        start = time.perf_counter()
        body = bytearray()
        truncated = False
        # No redirects (each hop would need the same check) and no proxies from the
        # environment (a proxy would connect by name, past the pinned address).
        async with httpx.AsyncClient(
            timeout=timeout_s, follow_redirects=False, trust_env=False, transport=transport
        ) as client:
            try:
                async with asyncio.timeout(timeout_s):
                    port = target.port or (443 if target.scheme == "https" else 80)
                    try:
                        addresses = await egress.check(target.raw_host.decode("ascii"), port)
                    except EgressRefused as exc:
                        raise Rejected(str(exc)) from None
                    except EgressUnresolved as exc:
                        raise ToolError(str(exc)) from None
                    key = context.idempotency_key if context is not None else None
                    response = await _send_pinned(client, target, addresses, key)
                    try:
                        async for chunk in response.aiter_bytes():
                            body += chunk
                            if len(body) > max_bytes:
                                del body[max_bytes:]
                                truncated = True
                                break
                    finally:
                        await response.aclose()
            except httpx.HTTPError as exc:
                raise ToolError(f"fetching {url} failed: {type(exc).__name__}: {exc}") from None
        text = bytes(body).decode(response.encoding or "utf-8", errors="replace")
        if max_chars is not None and len(text) > max_chars:
            text, truncated = text[:max_chars], True
        return FetchResult(
            url=str(target),
            status=response.status_code,
            content_type=response.headers.get("content-type", ""),
            content=text,
            truncated=truncated,
            elapsed_ms=round((time.perf_counter() - start) * 1000, 1),
        )

    return to_tool(http_fetch)


async def _send_pinned(
    client: httpx.AsyncClient,
    url: httpx.URL,
    addresses: list[Address],
    idempotency_key: str | None = None,
) -> httpx.Response:
    """GET ``url`` from the first of ``addresses`` that accepts a connection
    (:func:`loopmesh.egress.pinned`); the call's ``Idempotency-Key`` goes with it."""
    headers = {HEADER: idempotency_key} if idempotency_key else {}
    request = client.build_request("GET", url, headers=headers)
    for i, address in enumerate(addresses):
        try:
            return await client.send(pinned(request, address), stream=True)
        except httpx.ConnectError:
            if i == len(addresses) - 1:
                raise
    raise AssertionError("no addresses")  # Egress.check never returns none


#: Names of the built-ins, for configuration.
BUILTINS = ("calculator", "current_time", "http_fetch")


def builtin_tools(
    names: tuple[str, ...] = BUILTINS,
    *,
    http_allowlist: tuple[str, ...] = (),
    http_max_bytes: int = 1_000_000,
    http_timeout_s: float = 10.0,
) -> list[Tool]:
    factories: dict[str, Callable[[], Tool]] = {
        "calculator": lambda: to_tool(calculator),
        "current_time": lambda: to_tool(current_time),
        "http_fetch": lambda: http_fetch_tool(
            allowlist=http_allowlist, max_bytes=http_max_bytes, timeout_s=http_timeout_s
        ),
    }
    unknown = [n for n in names if n not in factories]
    if unknown:
        raise ValueError(f"unknown built-in tools {unknown} (known: {', '.join(factories)})")
    return [factories[n]() for n in names]
