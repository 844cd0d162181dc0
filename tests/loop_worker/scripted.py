"""Test helpers for the engine: a scripted in-process LLM and a rig around the engine.

``ScriptedLLM`` implements the LLM Protocol from a list of :class:`Completion` steps
(or exceptions, or :data:`HANG`), streaming content to ``on_delta``. ``Rig`` wires an
:class:`Engine` to in-memory events, store and tools and runs turns on it; with
``Rig.openai(fake_llm)`` the LLM is the real ``openai`` client against the fake server,
and ``rig.fork()`` is a second worker on the same session store and tools.
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from loop_worker.engine import Engine
from loop_worker.engine.control import TurnControl
from loop_worker.engine.hooks import Hooks
from loop_worker.engine.inmemory import InMemoryEvents, InMemoryStore, LocalTools
from loop_worker.engine.llm import OpenAILLM
from loop_worker.engine.protocols import LLM, Completion, OnDelta, OnRetry
from loop_worker.engine.settings import LLMSettings, LoopSettings
from schemas import ChatMessage, ToolCall, Turn
from schemas.events import Event, LoopEnd, Usage

HANG = object()  # a step that never answers (until cancelled)


def say(content: str) -> Completion:
    return Completion(content=content, finish_reason="stop", usage=Usage(total_tokens=1))


def call(*calls: tuple[str, dict[str, Any] | str], content: str = "") -> Completion:
    return Completion(
        content=content,
        tool_calls=tuple(
            ToolCall(id=f"m{i}", name=n, arguments=a if isinstance(a, str) else json.dumps(a))
            for i, (n, a) in enumerate(calls)
        ),
        finish_reason="tool_calls",
    )


def done(result: str = "done") -> Completion:
    return call(("task_completion", {"result": result}))


@dataclass
class Request:
    messages: list[ChatMessage]
    tools: list[dict[str, Any]]
    model: str | None


@dataclass
class ScriptedLLM:
    steps: list[Any] = field(default_factory=list)
    default: Any = None
    chunk_size: int = 16
    requests: list[Request] = field(default_factory=list)

    def script(self, *steps: Any) -> None:
        self.steps.extend(steps)

    async def complete(
        self,
        messages: Sequence[ChatMessage],
        *,
        tools: Sequence[dict[str, Any]] = (),
        model: str | None = None,
        on_delta: OnDelta | None = None,
        on_retry: OnRetry | None = None,
    ) -> Completion:
        self.requests.append(Request(list(messages), list(tools), model))
        step = self.steps.pop(0) if self.steps else self.default
        if step is None:
            raise AssertionError("the scripted LLM ran out of steps")
        if step is HANG:
            await asyncio.Event().wait()
        if isinstance(step, BaseException):
            raise step
        assert isinstance(step, Completion)
        if on_delta is not None:
            for i in range(0, len(step.content), self.chunk_size):
                await on_delta(step.content[i : i + self.chunk_size])
        return step


def echo(text: str) -> str:
    """Echo the text back."""
    return text


class CountingTools(LocalTools):
    """``count`` (a side effect, counted by name; its result is ``answer(name)``) and
    ``wait`` (blocks until released)."""

    def __init__(self, answer: Callable[[str], str] = "counted {}".format) -> None:
        super().__init__()
        self.counted: Counter[str] = Counter()
        self.waiting = asyncio.Event()
        self.release = asyncio.Event()

        @self.tool()
        async def count(name: str) -> str:
            """Count fruit of one kind."""
            self.counted[name] += 1
            return answer(name)

        @self.tool()
        async def wait() -> str:
            """Wait for a while."""
            self.waiting.set()
            await self.release.wait()
            return "released"


class Rig:
    """An engine on in-memory parts. ``async with Rig(llm, max_iterations=5) as rig``."""

    def __init__(
        self,
        llm: LLM,
        *,
        tools: LocalTools | None = None,
        hooks: Hooks | tuple[str, ...] | None = None,
        model: str = "",
        fallback_message: str | None = None,
        **settings: Any,
    ) -> None:
        self.llm = llm
        if isinstance(hooks, tuple):  # import paths: the engine loads them from settings
            settings["hooks"], hooks = hooks, None
        self.settings = LoopSettings(**settings)
        self.tools = tools or LocalTools()
        if tools is None:
            self.tools.add(echo)
        self.events = InMemoryEvents()
        self.store = InMemoryStore()
        self.control = TurnControl()
        self.engine = Engine(
            settings=self.settings,
            llm=llm,
            tools=self.tools,
            events=self.events,
            store=self.store,
            hooks=hooks,
            model=model,
            fallback_message=fallback_message,
        )

    def fork(self, llm: LLM | None = None) -> Rig:
        """Another worker: its own events, control and store handle on the same data,
        the same tools (so recorded results persist), this LLM or ``llm``."""
        other = copy.copy(self)
        other.llm = self.llm if llm is None else llm
        other.events = InMemoryEvents()
        other.store = self.store.fork()
        other.control = TurnControl()
        other.engine = copy.copy(self.engine)
        other.engine.llm, other.engine.events = other.llm, other.events
        other.engine.store = other.store
        return other

    @classmethod
    def openai(cls, fake_llm: Any, *, llm: dict[str, Any] | None = None, **kw: Any) -> Rig:
        """A rig whose LLM is :class:`OpenAILLM` against ``fake_llm`` (no backoff waits)."""
        options = {"model": "fake-model", "max_retries": 1, **(llm or {})}
        settings = LLMSettings(base_url=fake_llm.base_url, api_key="test", **options)

        async def no_sleep(_: float) -> None:
            return None

        return cls(OpenAILLM(settings, sleep=no_sleep), **kw)

    async def __aenter__(self) -> Rig:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        aclose = getattr(self.llm, "aclose", None)
        if aclose is not None:
            await aclose()

    def turn(self, text: str = "do the task", *, id: str = "t1", **fields: Any) -> Turn:
        return Turn(id=id, tenant="acme", session="s1", input=text, **fields)

    async def run(self, text: str = "do the task", *, id: str = "t1", **fields: Any) -> LoopEnd:
        end = await asyncio.wait_for(
            self.engine.run(self.turn(text, id=id, **fields), self.control), 20
        )
        assert end is not None
        return end

    @property
    def types(self) -> list[str]:
        return self.events.types

    def of(self, cls: type[Any]) -> list[Any]:
        return self.events.of(cls)

    def one(self, cls: type[Event]) -> Any:
        found = self.events.of(cls)
        assert len(found) == 1, f"{len(found)} {cls.__name__} events: {self.types}"
        return found[0]
