"""The constrained tool choice (``[loop] tool_choice_strategy = "constrained"``): every
reply is one tool call made by two forced calls, over the real ``openai`` client against
the fake OpenAI-compatible server."""

from __future__ import annotations

from typing import Any

from loop_worker.engine.constrained import ConstrainedLLM
from loop_worker.engine.llm import OpenAILLM
from loop_worker.engine.settings import LLMSettings
from loopmesh.testing.fake_llm import FakeLLM, text, tool_calls
from schemas import ChatMessage
from schemas.events import ToolCallEvent, ToolResultEvent
from tests.loop_worker.scripted import Rig


def constrained_rig(fake_llm: FakeLLM, **settings: Any) -> Rig:
    llm = OpenAILLM(LLMSettings(base_url=fake_llm.base_url, api_key="test", model="fake-model"))
    return Rig(ConstrainedLLM(llm), tool_choice_strategy="constrained", **settings)


def named(request: dict[str, Any]) -> str:
    choice = request["tool_choice"]
    assert choice["type"] == "function"
    return str(choice["function"]["name"])


async def test_a_tool_is_chosen_from_an_enum_then_called_then_the_answer_follows(fake_llm):
    fake_llm.script(
        tool_calls(("choose_tool", {"tool": "echo"})),
        tool_calls(("local__echo", {"text": "hi there"})),
        tool_calls(("task_completion", {"result": "It said hi there."})),
    )
    async with constrained_rig(fake_llm) as rig:
        end = await rig.run("Echo 'hi there' for me.")
    assert (end.reason, end.content) == ("task_completion", "It said hi there.")
    assert [e.tool for e in rig.of(ToolResultEvent) if e.server == "local"] == ["echo"]
    choose, fill, answer = fake_llm.requests  # no other call to the model
    # step 1: the deployment's tools first, the loop's own after; no plan tool
    assert named(choose) == "choose_tool"
    [spec] = choose["tools"]
    enum = spec["function"]["parameters"]["properties"]["tool"]["enum"]
    assert enum == ["echo", "task_completion", "ask_question", "converse"]
    prompt = choose["messages"][-1]["content"]
    assert "Request: Echo the text back.\nTool: echo\n" in prompt  # few-shot: descriptions
    assert prompt.endswith("Request: Echo 'hi there' for me.\nTool:")
    # step 2: only the chosen tool, forced
    assert named(fill) == "local__echo"
    assert [t["function"]["name"] for t in fill["tools"]] == ["local__echo"]
    assert fill["messages"][-1]["content"] == "Echo 'hi there' for me."
    # after the result: the answer, from the request and the result
    assert named(answer) == "task_completion"
    assert answer["messages"][-1]["content"].endswith("echo says: hi there")


async def test_an_unknown_choice_falls_back_to_answering(fake_llm):
    fake_llm.script(
        tool_calls(("choose_tool", {"tool": "no_such_tool"})),
        tool_calls(("task_completion", {"result": "done"})),
    )
    async with constrained_rig(fake_llm) as rig:
        end = await rig.run("Hello")
    assert (end.reason, end.content) == ("task_completion", "done")
    assert named(fake_llm.requests[1]) == "task_completion"


async def test_a_call_without_tools_goes_through_unchanged(fake_llm):
    fake_llm.script(text("a summary"))
    llm = ConstrainedLLM(OpenAILLM(LLMSettings(base_url=fake_llm.base_url, api_key="test")))
    async with Rig(llm) as rig:
        completion = await rig.llm.complete([_user("hi")])
    assert completion.content == "a summary"
    [request] = fake_llm.requests
    assert "tools" not in request and "tool_choice" not in request


def _user(content: str) -> ChatMessage:
    return ChatMessage(role="user", content=content)


async def test_the_constrained_strategy_sends_seed_and_temperature(fake_llm):
    fake_llm.script(tool_calls(("choose_tool", {"tool": "converse"})))
    fake_llm.script(tool_calls(("converse", {"message": "hello!"})))
    settings = LLMSettings(base_url=fake_llm.base_url, api_key="test", temperature=0, seed=7)
    async with Rig(ConstrainedLLM(OpenAILLM(settings))) as rig:
        end = await rig.run("Hello")
    assert (end.reason, end.content) == ("converse", "hello!")
    assert all(r["seed"] == 7 and r["temperature"] == 0 for r in fake_llm.requests)
    assert not [e for e in rig.of(ToolCallEvent) if e.server != "loop"]
