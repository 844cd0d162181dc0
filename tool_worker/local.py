"""Local tools: plain Python functions, described by their typed signature.

::

    from tool_worker import tool

    @tool(timeout_s=5)
    def word_count(text: str, unique: bool = False) -> int:
        \"\"\"Count the words in a text.\"\"\"
        ...

The JSON Schema of the arguments comes from the annotations (msgspec builds it, so
``Annotated[int, msgspec.Meta(ge=0, description=...)]``, ``Literal``, Structs and
optional parameters all work); the first paragraph of the docstring is the description.
A parameter annotated :class:`~tool_worker.context.ToolContext` (or ``ToolContext |
None``) is not an argument: it receives the call's context, with its idempotency key.
Sync functions run in a thread, off the event loop. A worker loads tool modules by
import path (``load_module("mypkg.tools")``) and serves every decorated function in them.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import typing
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

from . import context as call_context
from .context import ToolContext
from .errors import InvalidArguments, RegistryError, ToolError, ToolModuleError
from .registry import Tool

F = TypeVar("F", bound=Callable[..., Any])

_MARK = "__loopmesh_tool__"


class ToolOptions(msgspec.Struct, frozen=True, kw_only=True):
    name: str | None = None
    server: str = "local"
    timeout_s: float = 30.0
    needs_approval: bool = False
    description: str | None = None


@typing.overload
def tool(fn: F, /) -> F: ...


@typing.overload
def tool(
    *,
    name: str | None = None,
    server: str = "local",
    timeout_s: float = 30.0,
    needs_approval: bool = False,
    description: str | None = None,
) -> Callable[[F], F]: ...


def tool(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    name: str | None = None,
    server: str = "local",
    timeout_s: float = 30.0,
    needs_approval: bool = False,
    description: str | None = None,
) -> Any:
    """Mark a function as a tool (usable bare, ``@tool``, or with options)."""
    options = ToolOptions(
        name=name,
        server=server,
        timeout_s=timeout_s,
        needs_approval=needs_approval,
        description=description,
    )

    def mark(f: F) -> F:
        setattr(f, _MARK, options)
        return f

    return mark(fn) if fn is not None else mark


def to_tool(fn: Callable[..., Any]) -> Tool:
    """The :class:`Tool` of a function marked with :func:`tool` (or of any function)."""
    options: ToolOptions = getattr(fn, _MARK, None) or ToolOptions()
    args_type, context_param = _arguments_struct(fn)
    schema = _schema(args_type)
    names = [f.name for f in msgspec.structs.fields(args_type)]
    is_async = inspect.iscoroutinefunction(fn)
    convert = msgspec.convert

    async def invoke(arguments: dict[str, Any]) -> str:
        try:
            parsed = convert(arguments, args_type)
        except msgspec.ValidationError as exc:
            message, _, path = str(exc).partition(" - at `")
            raise InvalidArguments(message, path=path.rstrip("`") or "$") from None
        kwargs = {n: getattr(parsed, n) for n in names}
        if context_param is not None:
            context, required = call_context.current(), context_param[1]
            if context is None and required:
                raise ToolError(f"{fn.__qualname__} needs a call context: run it in a worker")
            kwargs[context_param[0]] = context
        if is_async:
            result = await fn(**kwargs)
        else:
            result = await asyncio.to_thread(fn, **kwargs)
        return as_text(result)

    return Tool(
        server=options.server,
        name=options.name or fn.__name__,
        invoke=invoke,
        description=options.description or _description(fn),
        input_schema=schema,
        timeout_s=options.timeout_s,
        needs_approval=options.needs_approval,
    )


def as_text(result: Any) -> str:
    """A tool's return value as the text the model reads: strings as they are,
    anything else as JSON."""
    if isinstance(result, str):
        return result
    if result is None:
        return ""
    return msgspec.json.encode(result).decode()


def is_tool(obj: object) -> bool:
    """Whether ``obj`` is a function marked with :func:`tool`."""
    return callable(obj) and hasattr(obj, _MARK)


def load_module(path: str) -> list[Tool]:
    """Import ``path`` (``"pkg.module"``) and return the tools its functions mark."""
    try:
        module = importlib.import_module(path)
    except Exception as exc:
        raise ToolModuleError(path, f"{type(exc).__name__}: {exc}") from exc
    found = [
        to_tool(obj)
        for obj in vars(module).values()
        if callable(obj) and hasattr(obj, _MARK) and getattr(obj, "__module__", None) == path
    ]
    if not found:
        raise ToolModuleError(path, "no functions decorated with @tool")
    return found


def _arguments_struct(
    fn: Callable[..., Any],
) -> tuple[type[msgspec.Struct], tuple[str, bool] | None]:
    """The Struct of ``fn``'s arguments, and its context parameter (name, required)."""
    try:
        hints = typing.get_type_hints(fn, include_extras=True)
    except Exception as exc:
        raise RegistryError(f"cannot read the annotations of {fn.__qualname__}: {exc}") from exc
    fields: list[tuple[str, Any] | tuple[str, Any, Any]] = []
    context_param: tuple[str, bool] | None = None
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY):
            raise RegistryError(
                f"tool {fn.__qualname__}: parameter {p.name!r} must be a named parameter "
                "(no *args, **kwargs or positional-only parameters)"
            )
        type_ = hints.get(p.name, Any)
        if _is_context(type_):
            if context_param is not None:
                raise RegistryError(f"tool {fn.__qualname__}: two ToolContext parameters")
            context_param = (p.name, type_ is ToolContext)
            continue
        fields.append((p.name, type_) if p.default is p.empty else (p.name, type_, p.default))
    try:
        struct = msgspec.defstruct(
            f"{fn.__name__}_arguments", fields, kw_only=True, forbid_unknown_fields=True
        )
    except TypeError as exc:
        raise RegistryError(f"tool {fn.__qualname__}: {exc}") from exc
    return struct, context_param


def _is_context(type_: Any) -> bool:
    """``ToolContext`` or ``ToolContext | None``."""
    if type_ is ToolContext:
        return True
    args = typing.get_args(type_)
    return ToolContext in args and set(args) <= {ToolContext, type(None)}


def _schema(args_type: type[msgspec.Struct]) -> dict[str, Any]:
    try:
        (ref,), components = msgspec.json.schema_components(
            [args_type], ref_template="#/$defs/{name}"
        )
    except TypeError as exc:
        raise RegistryError(f"{args_type.__name__}: {exc}") from exc
    name = ref["$ref"].rsplit("/", 1)[-1]
    schema: dict[str, Any] = dict(components.pop(name))
    schema.pop("title", None)
    schema.setdefault("properties", {})
    if components:
        schema["$defs"] = components
    return schema


def _description(fn: Callable[..., Any]) -> str:
    doc = inspect.getdoc(fn) or ""
    return doc.split("\n\n", 1)[0].replace("\n", " ").strip()
