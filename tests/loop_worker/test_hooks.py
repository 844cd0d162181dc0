"""Hooks: loaded from import paths, called around the LLM and each tool call."""

from __future__ import annotations

import sys
import types

import pytest

from loop_worker.engine.hooks import SKIP, HookError, Hooks, load
from loop_worker.engine.protocols import Completion
from loopmesh.testing.fake_llm import FakeLLM, text, tool_calls
from schemas import ChatMessage, ToolCallRequest, ToolResult, Turn
from schemas.events import ToolErrorEvent, ToolResultEvent
from tests.loop_worker.scripted import Rig


def finish() -> object:
    return tool_calls(("task_completion", {"result": "ok"}))


def echo_call(value: str = "hi") -> object:
    return tool_calls(("local__echo", {"text": value}))


class Audit:
    def __init__(self) -> None:
        self.seen: list[str] = []

    async def before_llm(self, messages: list[ChatMessage]) -> list[ChatMessage]:
        self.seen.append("before_llm")
        return [*messages, ChatMessage(role="user", content="AUDITED", name="loopmesh")]

    def after_llm(self, completion: Completion) -> None:
        self.seen.append("after_llm")


@pytest.fixture
def hook_module() -> types.ModuleType:
    module = types.ModuleType("loopmesh_test_hooks")
    module.Audit = Audit  # type: ignore[attr-defined]
    module.plain = object()  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module
    yield module
    del sys.modules[module.__name__]


def test_hooks_load_from_import_paths_and_classes_are_instantiated(
    hook_module: types.ModuleType,
) -> None:
    hooks = Hooks.from_paths(["loopmesh_test_hooks:Audit", "loopmesh_test_hooks:plain"])
    assert isinstance(hooks.hooks[0], Audit)
    assert hooks.hooks[1] is hook_module.plain


@pytest.mark.parametrize(
    ("path", "says"),
    [
        ("no_colon_here", "expected 'package.module:object'"),
        ("loopmesh_missing_module_xyz:thing", "cannot import module"),
        ("loopmesh_test_hooks:missing", "has no attribute 'missing'"),
    ],
)
def test_a_bad_hook_path_is_a_clear_error(
    hook_module: types.ModuleType, path: str, says: str
) -> None:
    with pytest.raises(HookError, match=says) as info:
        load(path)
    assert info.value.path == path


async def test_before_and_after_llm_hooks_see_and_change_the_exchange(fake_llm: FakeLLM) -> None:
    audit = Audit()
    fake_llm.script(finish())
    async with Rig.openai(fake_llm, hooks=Hooks([audit])) as rig:
        await rig.run()
    assert audit.seen == ["before_llm", "after_llm"]
    assert fake_llm.requests[0]["messages"][-1]["content"] == "AUDITED"


async def test_after_llm_can_replace_the_reply(fake_llm: FakeLLM) -> None:
    class Censor:
        def after_llm(self, completion: Completion) -> Completion:
            return Completion(content="[redacted]", finish_reason="stop")

    fake_llm.script(text("secret"), finish())
    async with Rig.openai(fake_llm, hooks=Hooks([Censor()]), max_no_tool_reminders=0) as rig:
        end = await rig.run()
    assert (end.reason, end.content) == ("converse", "[redacted]")


async def test_before_tool_can_modify_a_call(fake_llm: FakeLLM) -> None:
    class Shout:
        def before_tool(self, request: ToolCallRequest) -> ToolCallRequest:
            args = {"text": request.arguments["text"].upper()}
            return ToolCallRequest(**{**_fields(request), "arguments": args})

    fake_llm.script(echo_call("hi"), finish())
    async with Rig.openai(fake_llm, hooks=Hooks([Shout()])) as rig:
        await rig.run()
    assert rig.tools.runs[0].arguments == {"text": "HI"}
    assert fake_llm.requests[1]["messages"][-1]["content"] == "HI"


async def test_before_tool_can_answer_a_call_without_running_it(fake_llm: FakeLLM) -> None:
    class Cache:
        async def before_tool(self, request: ToolCallRequest) -> ToolResult:
            return ToolResult(call_id=request.call_id, content="from cache")

    fake_llm.script(echo_call(), finish())
    async with Rig.openai(fake_llm, hooks=Hooks([Cache()])) as rig:
        await rig.run()
    assert rig.tools.runs == []
    assert [e.content for e in rig.of(ToolResultEvent) if e.tool == "echo"] == ["from cache"]


async def test_before_tool_can_skip_a_call(fake_llm: FakeLLM) -> None:
    class Skipper:
        def before_tool(self, request: ToolCallRequest) -> object:
            return SKIP

    fake_llm.script(echo_call(), finish())
    async with Rig.openai(fake_llm, hooks=Hooks([Skipper()])) as rig:
        await rig.run()
    assert rig.tools.runs == []
    assert "skipped by a hook" in fake_llm.requests[1]["messages"][-1]["content"]


async def test_after_tool_can_modify_a_result(fake_llm: FakeLLM) -> None:
    class Stamp:
        def after_tool(self, request: ToolCallRequest, result: ToolResult) -> ToolResult:
            return ToolResult(call_id=result.call_id, content=result.content + " (checked)")

    fake_llm.script(echo_call(), finish())
    async with Rig.openai(fake_llm, hooks=Hooks([Stamp()])) as rig:
        await rig.run()
    assert fake_llm.requests[1]["messages"][-1]["content"] == "hi (checked)"


async def test_approve_tool_can_reject_a_call_with_a_reason(fake_llm: FakeLLM) -> None:
    class Policy:
        def approve_tool(self, request: ToolCallRequest) -> tuple[bool, str]:
            return False, "echo is not allowed on Sundays"

    fake_llm.script(echo_call(), finish())
    async with Rig.openai(fake_llm, hooks=Hooks([Policy()])) as rig:
        await rig.run()
    assert rig.tools.runs == []
    failed = rig.one(ToolErrorEvent)
    assert (failed.code, failed.message) == ("rejected", "echo is not allowed on Sundays")


async def test_a_hook_that_raises_becomes_an_error_result_not_a_crash(fake_llm: FakeLLM) -> None:
    class Broken:
        def before_tool(self, request: ToolCallRequest) -> None:
            raise ValueError("bug in hook")

    fake_llm.script(echo_call(), finish())
    async with Rig.openai(fake_llm, hooks=Hooks([Broken()])) as rig:
        end = await rig.run()
    assert end.reason == "task_completion"
    assert rig.one(ToolErrorEvent).message == "ValueError: bug in hook"


async def test_hooks_named_in_settings_are_loaded_by_the_engine(
    fake_llm: FakeLLM, hook_module: types.ModuleType
) -> None:
    fake_llm.script(finish())
    async with Rig.openai(fake_llm, hooks=("loopmesh_test_hooks:Audit",)) as rig:
        await rig.run()
    assert fake_llm.requests[0]["messages"][-1]["content"] == "AUDITED"


async def test_a_retrieve_hook_adds_context_to_the_prompt(fake_llm: FakeLLM) -> None:
    class Search:
        async def retrieve(self, turn: Turn) -> str:
            return f"Doc about {turn.input}"

    fake_llm.script(finish())
    async with Rig.openai(fake_llm, hooks=Hooks([Search()])) as rig:
        await rig.run("llamas")
    assert "Doc about llamas" in fake_llm.requests[0]["messages"][-1]["content"]


def _fields(request: ToolCallRequest) -> dict[str, object]:
    return {f: getattr(request, f) for f in request.__struct_fields__}
