"""Hooks: code an operator plugs into the loop, named by import paths.

``settings.loop.hooks = ["mypkg.hooks:audit"]`` loads ``audit`` from ``mypkg.hooks``
(a class is instantiated with no arguments). A hook object may define any of these,
sync or async; hooks run in the order given, each seeing the previous one's output:

- ``before_llm(messages) -> messages | Completion | None``
                                                         change the prompt, or skip the
                                                         call: a Completion is the reply
- ``after_llm(completion) -> Completion | None``         change the reply
- ``before_tool(request) -> ToolCallRequest | ToolResult | SKIP | None``
                                                         change, answer or skip a call
- ``after_tool(request, result) -> ToolResult | None``   change a result
- ``approve_tool(request) -> bool | (bool, reason) | None``  reject a call
- ``retrieve(turn) -> passages | None``                  retrieved context for the prompt
                                                         (see :mod:`.context`)
- ``before_turn(turn) -> None``                          once, when a turn first starts
- ``after_turn(turn, end: LoopEnd) -> None``             once, just before its ``loop_end``

``None`` means "no change" everywhere. An exception in ``before_turn`` or
``after_turn`` becomes a ``hook_error`` event: one in ``before_turn`` ends the turn
(reason ``error``, failing closed, since such a hook may be a policy check); one in
``after_turn`` does not change how the turn ended.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Sequence
from typing import Any, Final

from schemas import ChatMessage, Passage, ToolCallRequest, ToolResult, Turn

from .context import passages
from .errors import LoopWorkerError
from .protocols import Completion


class HookError(LoopWorkerError):
    """A hook could not be loaded (``.path``)."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"hook {path!r}: {message}")
        self.path = path


class _Skip:
    def __repr__(self) -> str:
        return "SKIP"


#: Returned by ``before_tool`` to skip a call: the model is told it was skipped.
SKIP: Final = _Skip()


async def _call(fn: Any, *args: Any) -> Any:
    out = fn(*args)
    if inspect.isawaitable(out):
        out = await out
    return out


def load(path: str) -> Any:
    """The object at ``"package.module:attribute"`` (a class is instantiated)."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise HookError(path, "expected 'package.module:object'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise HookError(path, f"cannot import module {module_name!r}: {exc}") from exc
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise HookError(path, f"module {module_name!r} has no attribute {attr!r}") from None
    if inspect.isclass(obj):
        try:
            obj = obj()
        except Exception as exc:
            raise HookError(path, f"cannot instantiate {attr}: {exc}") from exc
    return obj


class Hooks:
    def __init__(self, hooks: Sequence[Any] = ()) -> None:
        self.hooks = list(hooks)

    @classmethod
    def from_paths(cls, paths: Sequence[str]) -> Hooks:
        return cls([load(p) for p in paths])

    def _each(self, name: str) -> list[Any]:
        return [getattr(h, name) for h in self.hooks if callable(getattr(h, name, None))]

    async def before_llm(self, messages: list[ChatMessage]) -> list[ChatMessage] | Completion:
        """The prompt to send, or a :class:`Completion` that replaces the call (the
        first hook to return one wins; the model is not asked)."""
        for fn in self._each("before_llm"):
            out = await _call(fn, messages)
            if isinstance(out, Completion):
                return out
            if out is not None:
                messages = list(out)
        return messages

    async def after_llm(self, completion: Completion) -> Completion:
        for fn in self._each("after_llm"):
            out = await _call(fn, completion)
            if out is not None:
                completion = out
        return completion

    async def before_tool(self, request: ToolCallRequest) -> ToolCallRequest | ToolResult | _Skip:
        for fn in self._each("before_tool"):
            out = await _call(fn, request)
            if out is None:
                continue
            if isinstance(out, ToolResult | _Skip):
                return out
            request = out
        return request

    async def after_tool(self, request: ToolCallRequest, result: ToolResult) -> ToolResult:
        for fn in self._each("after_tool"):
            out = await _call(fn, request, result)
            if out is not None:
                result = out
        return result

    async def approve_tool(self, request: ToolCallRequest) -> tuple[bool, str]:
        """``(False, reason)`` from the first hook that rejects, else ``(True, "")``."""
        for fn in self._each("approve_tool"):
            out = await _call(fn, request)
            if out is None:
                continue
            approved, reason = out if isinstance(out, tuple) else (bool(out), "")
            if not approved:
                return False, reason or "rejected by a hook"
        return True, ""

    async def around_turn(self, name: str, *args: Any) -> tuple[str, str] | None:
        """Run every ``name`` hook (``before_turn`` / ``after_turn``); the first one that
        raises stops the rest and is returned as (which hook, what it raised)."""
        for fn in self._each(name):
            try:
                await _call(fn, *args)
            except Exception as exc:
                owner = getattr(fn, "__self__", fn)
                where = getattr(owner, "__qualname__", None) or type(owner).__qualname__
                return f"{where}.{name}", f"{type(exc).__name__}: {exc}"
        return None

    async def retrieve(self, turn: Turn) -> list[Passage]:
        """Every retriever's passages, in order. Raises what a retriever raised, or
        ``TypeError`` / ``msgspec.ValidationError`` for a result that is no passages."""
        found: list[Passage] = []
        for fn in self._each("retrieve"):
            found += passages(await _call(fn, turn))
        return found


class Retriever:
    """A deployment's search as a hook (``[loop] retriever = "pkg.module:search"``):
    the object at that path is called with the turn (or its ``retrieve`` method is)."""

    def __init__(self, path: str) -> None:
        obj = load(path)
        fn = getattr(obj, "retrieve", obj)
        if not callable(fn):
            raise HookError(path, "a retriever must be callable or have a retrieve method")
        self._fn = fn

    def retrieve(self, turn: Turn) -> Any:
        return self._fn(turn)
