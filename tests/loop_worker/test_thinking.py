"""The streaming <thinking> splitter."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from loop_worker.engine.thinking import Piece, ThinkingSplitter, split_thinking


def run(*deltas: str) -> list[Piece]:
    splitter = ThinkingSplitter()
    out = [p for d in deltas for p in splitter.feed(d)]
    return out + splitter.close()


def merged(pieces: list[Piece]) -> list[Piece]:
    """Adjacent text pieces of one kind joined (chunking is not meaningful)."""
    out: list[Piece] = []
    for p in pieces:
        if out and p.kind == out[-1].kind and p.kind in ("content", "thinking"):
            out[-1] = Piece(p.kind, out[-1].text + p.text)
        else:
            out.append(p)
    return out


EXPECTED = [
    Piece("content", "Hi "),
    Piece("thinking_start"),
    Piece("thinking", "plan it"),
    Piece("thinking_end", "plan it"),
    Piece("content", " done"),
]


def test_a_thinking_section_splits_from_the_content() -> None:
    assert merged(run("Hi <thinking>plan it</thinking> done")) == EXPECTED


def test_tags_split_across_chunks_are_recognised() -> None:
    assert merged(run("Hi <thi", "nking>plan", " it</thin", "king> done")) == EXPECTED


@given(st.lists(st.integers(min_value=0, max_value=40), max_size=8))
def test_any_chunking_gives_the_same_pieces(cuts: list[int]) -> None:
    text = "Hi <thinking>plan it</thinking> done"
    points = sorted({min(c, len(text)) for c in cuts})
    chunks = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    assert merged(run(*chunks)) == EXPECTED


def test_short_think_tags_work_too() -> None:
    assert split_thinking("<think>x</think>answer") == ("answer", "x")


def test_an_unclosed_section_ends_when_the_stream_does() -> None:
    pieces = merged(run("<thinking>still going"))
    assert pieces[-1] == Piece("thinking_end", "still going")


def test_a_lone_angle_bracket_is_content_and_not_held_forever() -> None:
    splitter = ThinkingSplitter()
    assert splitter.feed("a < b") == [Piece("content", "a < b")]
    assert splitter.feed("x <th") == [Piece("content", "x ")]
    assert splitter.feed("e end") == [Piece("content", "<the end")]


@given(st.text(max_size=200))
def test_content_and_thinking_together_keep_every_character_but_the_tags(text: str) -> None:
    content, thinking = split_thinking(text)
    stripped = text
    for tag in ("<thinking>", "</thinking>", "<think>", "</think>"):
        stripped = stripped.replace(tag, "")
    assert len(content) + len(thinking.replace("\n", "")) <= len(stripped)
    if "<" not in text:
        assert (content, thinking) == (text, "")


def test_a_stray_closing_tag_is_dropped_from_the_content() -> None:
    # Models whose chat template opens <think> in the prompt only ever write the close.
    assert split_thinking("</thinking>") == ("", "")
    assert split_thinking("reasoning</think>The answer is 4.") == ("reasoningThe answer is 4.", "")
