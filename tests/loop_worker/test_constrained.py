"""The constrained tool choice (``[loop] tool_choice_strategy = "constrained"``): every
reply is one tool call made by two forced calls, over the real ``openai`` client against
the fake OpenAI-compatible server."""

from __future__ import annotations

from typing import Any

from loop_worker.engine.constrained import (
    ConstrainedLLM,
    closed,
    is_url_property,
    pin_urls,
    readable,
    unrepeated,
    urls_in,
)
from loop_worker.engine.inmemory import LocalTools
from loop_worker.engine.llm import OpenAILLM
from loop_worker.engine.settings import LLMSettings
from loopmesh.testing.fake_llm import FakeLLM, text, tool_calls
from schemas import ChatMessage, ToolCall
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


def fetching_tools() -> LocalTools:
    tools = LocalTools()

    @tools.tool()
    def fetch(url: str, max_chars: int | None = None) -> dict[str, Any]:
        """Fetch http(s) URL: read a web page and return its text."""
        html = "<html><body><h1>Notes</h1><p>The code is &#52;417.</p></body></html>"
        return {"url": url, "status": 200, "content": html, "truncated": False}

    @tools.tool()
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression."""
        return "391"

    return tools


async def test_a_url_argument_is_pinned_to_the_urls_the_request_spells_out(fake_llm):
    page = "http://127.0.0.1:8123/notes.html"
    fake_llm.script(
        tool_calls(("choose_tool", {"tool": "fetch"})),
        tool_calls(("local__fetch", {"url": page})),
        tool_calls(("task_completion", {"result": "It says the code is 4417."})),
    )
    async with constrained_rig(fake_llm, tools=fetching_tools()) as rig:
        end = await rig.run(
            f"Fetch {page} and tell me what it says. Not https://example.com/a?b=1."
        )
    assert (end.reason, end.content) == ("task_completion", "It says the code is 4417.")
    [result] = [e for e in rig.of(ToolResultEvent) if e.server == "local"]
    assert f'"url":"{page}"' in result.content  # the call had the URL as written
    _, fill, answer = fake_llm.requests
    assert named(fill) == "local__fetch"
    [spec] = fill["tools"]
    properties = spec["function"]["parameters"]["properties"]
    # the URLs in the request, in order, a sentence's full stop left out
    assert properties["url"]["enum"] == [page, "https://example.com/a?b=1"]
    assert properties["url"]["type"] == "string"
    assert "enum" not in str(properties["max_chars"])  # other arguments are left as they are
    assert spec["function"]["parameters"]["required"] == ["url"]
    # the answer's prompt shows the result plainly
    assert answer["messages"][-1]["content"].endswith(
        f"fetch says: url: {page}\nstatus: 200\ncontent: Notes The code is 4417.\ntruncated: false"
    )


async def test_without_a_url_in_the_request_the_schema_is_sent_unchanged(fake_llm):
    fake_llm.script(
        tool_calls(("choose_tool", {"tool": "fetch"})),
        tool_calls(("local__fetch", {"url": "http://example.org/"})),
        tool_calls(("task_completion", {"result": "done"})),
    )
    tools = fetching_tools()
    async with constrained_rig(fake_llm, tools=tools) as rig:
        await rig.run("Fetch the example page.")
    [spec] = fake_llm.requests[1]["tools"]
    [fetch] = [s for s in await tools.tools() if s.name == "fetch"]
    assert spec["function"]["parameters"] == fetch.input_schema


def test_urls_are_read_from_the_request_as_written() -> None:
    text = (
        "See http://127.0.0.1:8080/notes.html, then (https://example.com/a?b=1&c=2). "
        "Again: http://127.0.0.1:8080/notes.html! Also <ftp://files.example/x.txt> "
        'and "https://q.example/path#frag". Not a URL: https:// or example.com.'
    )
    assert urls_in(text) == [
        "http://127.0.0.1:8080/notes.html",
        "https://example.com/a?b=1&c=2",
        "ftp://files.example/x.txt",
        "https://q.example/path#frag",
    ]
    assert urls_in("What is 17 * 23?") == []


def test_url_arguments_are_known_by_format_or_name_and_pinned_in_any_of() -> None:
    urls = ["http://a.example/"]
    spec = {
        "type": "function",
        "function": {
            "name": "get",
            "parameters": {
                "type": "object",
                "properties": {
                    "target": {"type": "string", "format": "uri"},
                    "page_url": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                    "link": {"type": "string", "enum": ["http://b.example/"]},  # already fixed
                    "title": {"type": "string"},
                    "url": {"type": "array", "items": {"type": "string"}},  # not a string
                },
            },
        },
    }
    pinned = pin_urls(spec, urls)["function"]["parameters"]["properties"]
    assert pinned["target"] == {"type": "string", "format": "uri", "enum": urls}
    assert pinned["page_url"] == {"anyOf": [{"type": "string", "enum": urls}, {"type": "null"}]}
    assert pinned["link"]["enum"] == ["http://b.example/"]
    assert pinned["title"] == {"type": "string"}
    assert pinned["url"] == {"type": "array", "items": {"type": "string"}}
    assert spec["function"]["parameters"]["properties"]["target"] == {  # not changed in place
        "type": "string",
        "format": "uri",
    }
    assert pin_urls(spec, []) is spec
    assert is_url_property("homepage_url", {"type": "string"})
    assert not is_url_property("urlencoded", {"type": "string"})


def test_results_are_made_plain_for_a_small_model() -> None:
    page = '<!DOCTYPE html><html><head><style>p {color: red}</style><script>var x = "<p>";</script>'
    page += (
        "</head><body><h1>Title</h1>\n<p>One &amp; two.</p><ul><li>three</li></ul></body></html>"
    )
    assert readable(page) == "Title One & two. three"
    assert readable('{"status": 200, "items": [1, 2], "text": "<p>hi</p>"}') == (
        "status: 200\nitems: [1, 2]\ntext: hi"
    )
    for unchanged in ("391", "2026-11-23T04:12:01+00:00", "a < b and c > d", "[1, 2]", "{}"):
        assert readable(unchanged) == unchanged


async def test_an_answer_cut_by_the_token_limit_inside_its_text_is_closed(fake_llm):
    cut = '{"result": "The code is 4417. The code is 4417. The'
    fake_llm.script(
        tool_calls(("choose_tool", {"tool": "calculator"})),
        tool_calls(("local__calculator", {"expression": "17 * 23"})),
        tool_calls(("task_completion", cut)),
    )
    async with constrained_rig(fake_llm, tools=fetching_tools()) as rig:
        end = await rig.run("What is 17 * 23?")
    assert (end.reason, end.content) == ("task_completion", "The code is 4417.")


def test_cut_arguments_are_closed_and_others_left_alone() -> None:
    def args(text: str) -> str:
        return closed(ToolCall(id="c", name="f", arguments=text)).arguments

    assert args('{"result": "cut her') == '{"result": "cut her"}'
    assert args('{"n": 3') == '{"n": 3}'
    assert args('{"result": "whole"}') == '{"result": "whole"}'
    assert args('{"a": [1, 2') == '{"a": [1, 2'  # not closed by a quote or a brace: left
    assert args("") == ""
    # a cut call was looping: its texts end where they began to repeat themselves
    looped = '{"result": "The answer is 391. It is 391. It is 391. It is'
    assert args(looped) == '{"result":"The answer is 391. It is 391."}'
    assert args('{"result": "391.\\n391.\\n391.\\n39') == '{"result":"391."}'
    whole = '{"result": "It is 391. It is 391."}'  # not cut: the model meant it
    assert args(whole) == whole


def test_a_text_is_cut_back_where_it_begins_to_repeat_itself() -> None:
    assert unrepeated("A. B. A. B. A") == "A. B."  # a loop of two sentences
    # a loop that varies what it repeats: the variations are false
    assert unrepeated("The launch code is 4417. The launch code is 2018.") == (
        "The launch code is 4417."
    )
    looped = "The final answer for the user is 391. The final answer is 23. The final answer"
    assert unrepeated(looped) == "The final answer for the user is 391."
    assert unrepeated("It is 391. The code is 1. The code is 2.") == "It is 391. The code is 1."
    assert unrepeated("Yes! Yes! Yes!") == "Yes!"
    assert unrepeated("It is 391. It is") == "It is 391."  # a cut copy of the last
    assert unrepeated("The code is 4417. The co") == "The code is 4417."
    for unchanged in (
        "The answer is 391.",
        "It is 391. The time is noon. So",  # the cut sentence begins a new one
        "A. B. C. D. A.",  # a sentence said again after more than three others
        "The answer is 391. It is right. It is, I checked.",  # short openings: no loop
        "",
        "no end mark at all",
    ):
        assert unrepeated(unchanged) == unchanged, unchanged
