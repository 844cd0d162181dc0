"""The text tool format and the tool-name <-> function-name mapping."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loop_worker.engine.errors import ToolFieldError, ToolParseError
from loop_worker.engine.parser import (
    FUNCTION_NAME,
    ParsedCall,
    ToolNames,
    function_name,
    parse_arguments,
    parse_text_calls,
)
from schemas import ToolSpec


def test_a_tool_block_becomes_a_parsed_call() -> None:
    out = parse_text_calls(
        'Sure. <tool>{"server_name": "files", "tool_name": "read",'
        ' "arguments": {"path": "a.txt"}}</tool> Done.'
    )
    assert out == [ParsedCall(server="files", tool="read", arguments={"path": "a.txt"})]


def test_several_blocks_are_read_in_order_and_fenced_json_is_accepted() -> None:
    out = parse_text_calls(
        '<tool>```json\n{"server_name": "a", "tool_name": "x"}\n```</tool>'
        '<tool>{"server_name": "b", "tool_name": "y", "arguments": "{\\"n\\": 1}"}</tool>'
    )
    assert out == [
        ParsedCall(server="a", tool="x", arguments={}),
        ParsedCall(server="b", tool="y", arguments={"n": 1}),
    ]


@pytest.mark.parametrize(
    ("body", "error", "field"),
    [
        ("{not json}", ToolParseError, None),
        ("[1, 2]", ToolParseError, None),
        ('{"server_name": "a"}', ToolFieldError, "tool_name"),
        ('{"tool_name": "x"}', ToolFieldError, "server_name"),
        ('{"server_name": "a", "tool_name": 3}', ToolFieldError, "tool_name"),
        ('{"server_name": "a", "tool_name": "x", "arguments": 5}', ToolFieldError, "arguments"),
        (
            '{"server_name": "a", "tool_name": "x", "arguments": "{bad"}',
            ToolFieldError,
            "arguments",
        ),
    ],
)
def test_a_broken_block_is_a_typed_error(body: str, error: type, field: str | None) -> None:
    [out] = parse_text_calls(f"<tool>{body}</tool>")
    assert isinstance(out, error)
    if field is not None:
        assert out.field == field  # type: ignore[attr-defined]


def test_an_unclosed_block_is_a_parse_error() -> None:
    out = parse_text_calls('<tool>{"server_name": "a", "tool_name": "x"}</tool> <tool>{"serv')
    assert isinstance(out[0], ParsedCall)
    assert isinstance(out[1], ToolParseError) and "no closing" in str(out[1])


def test_text_without_blocks_has_no_calls() -> None:
    assert parse_text_calls("I will think about tools later.") == []


@given(st.text(max_size=300))
def test_the_text_parser_never_raises(text: str) -> None:
    for item in parse_text_calls(text) + parse_text_calls(f"<tool>{text}</tool>"):
        assert isinstance(item, ParsedCall | ToolParseError | ToolFieldError)


def test_native_arguments_must_be_a_json_object() -> None:
    assert parse_arguments("") == {}
    assert parse_arguments('{"a": 1}') == {"a": 1}
    with pytest.raises(ToolParseError):
        parse_arguments("[1]")
    with pytest.raises(ToolParseError):
        parse_arguments('{"a": ')


def test_function_names_join_server_and_tool_and_stay_readable() -> None:
    assert function_name("files", "read") == "files__read"
    assert function_name("", "task_completion") == "task_completion"


@given(st.text(min_size=1, max_size=100), st.text(min_size=1, max_size=100))
def test_function_names_always_match_the_openai_charset(server: str, tool: str) -> None:
    assert FUNCTION_NAME.fullmatch(function_name(server, tool))


def test_long_names_are_hash_shortened_and_distinct() -> None:
    server, a, b = "s" * 64, "t" * 63 + "a", "t" * 63 + "b"
    na, nb = function_name(server, a), function_name(server, b)
    assert len(na) <= 64 and len(nb) <= 64 and na != nb


def test_tool_names_map_back_to_their_tools() -> None:
    specs = [
        ToolSpec(server="loop", name="task_completion"),
        ToolSpec(server="files", name="read"),
        ToolSpec(server="x" * 64, name="y" * 64),
    ]
    names = ToolNames(specs, builtin_server="loop")
    for spec in specs:
        name = names.function(spec.server, spec.name)
        assert FUNCTION_NAME.fullmatch(name)
        assert names.resolve(name) is spec
    assert names.function("loop", "task_completion") == "task_completion"
    assert names.resolve("files__write") is None
    assert names.find("", "read") is specs[1]  # the text format may omit a unique server


def test_names_that_collide_after_mapping_stay_apart() -> None:
    a, b = ToolSpec(server="a", name="b__c"), ToolSpec(server="a__b", name="c")
    names = ToolNames([a, b])
    assert names.function("a", "b__c") != names.function("a__b", "c")
    assert names.resolve(names.function("a__b", "c")) is b


# -- fuzzing: calls written among arbitrary text come back as they were -------------------

_names = st.text(min_size=1, max_size=20).filter(lambda s: s.strip() == s)
_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=6,
)
_calls = st.builds(
    ParsedCall,
    server=st.text(max_size=20),
    tool=_names,
    arguments=st.dictionaries(st.text(max_size=10), _json, max_size=4),
)
# The format cannot carry "</tool>" inside a block, nor "<tool>" in the text between.
_noise = st.text(max_size=40).filter(lambda s: "<tool>" not in s and "</tool>" not in s)


def _block(call: ParsedCall, as_string: bool, fenced: bool) -> str:
    arguments: object = call.arguments
    if as_string:
        arguments = json.dumps(call.arguments)
    body = json.dumps({"server_name": call.server, "tool_name": call.tool, "arguments": arguments})
    if fenced:
        body = "```json\n" + body + "\n```"
    return f"<tool>{body}</tool>"


@given(st.lists(st.tuples(_noise, _calls, st.booleans(), st.booleans()), max_size=4), _noise)
def test_calls_among_arbitrary_text_are_read_back_exactly(parts, tail) -> None:
    calls = [call for _, call, _, _ in parts]
    blob = "".join(n + _block(c, s, f) for n, c, s, f in parts) + tail
    if any("</tool>" in _block(c, s, f)[6:-7] for _, c, s, f in parts):
        return  # a body holding the closing tag is outside the format
    assert parse_text_calls(blob) == calls


@given(st.text(max_size=200), st.text(max_size=200))
def test_an_unclosed_block_after_any_text_is_one_parse_error(head, body) -> None:
    head = head.replace("<tool>", "")
    results = parse_text_calls(f"{head}<tool>{body.replace('</tool>', '')}")
    assert results and isinstance(results[-1], ToolParseError)
    assert all(isinstance(r, ParsedCall | ToolParseError | ToolFieldError) for r in results)
