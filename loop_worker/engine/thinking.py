"""Split a streamed reply into thinking and content as the deltas arrive.

Models that reason aloud wrap it in ``<thinking>…</thinking>`` (some write ``<think>``).
:class:`ThinkingSplitter` takes raw deltas and yields :class:`Piece` values — content
text, or thinking start / text / end — holding back only the few characters that could
be the start of a tag split across two chunks.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

PieceKind = Literal["content", "thinking_start", "thinking", "thinking_end"]

#: Opening tag -> closing tag.
TAGS = {"<thinking>": "</thinking>", "<think>": "</think>"}
#: Every tag looked for outside a thinking section: a stray closing tag (from models
#: whose chat template opens the section in the prompt) is dropped, not shown.
_OUTSIDE = (*TAGS, *TAGS.values())


class Piece(NamedTuple):
    kind: PieceKind
    text: str = ""


class ThinkingSplitter:
    """Feed deltas with :meth:`feed`, then call :meth:`close` once at the end.

    ``content`` and ``thinking`` hold everything seen so far, tags removed.
    """

    def __init__(self) -> None:
        self._buf = ""
        self._close_tag: str | None = None  # set while inside a thinking section
        self._thought: list[str] = []
        self._content: list[str] = []
        self._thinking: list[str] = []

    @property
    def content(self) -> str:
        return "".join(self._content)

    @property
    def thinking(self) -> str:
        return "\n".join(self._thinking)

    def feed(self, delta: str) -> list[Piece]:
        self._buf += delta
        out: list[Piece] = []
        while self._buf:
            tag, at = self._find_tag()
            if tag is None:
                keep = self._partial_tag_len()
                self._text(self._buf[: len(self._buf) - keep], out)
                self._buf = self._buf[len(self._buf) - keep :]
                break
            self._text(self._buf[:at], out)
            self._buf = self._buf[at + len(tag) :]
            if self._close_tag is None and tag not in TAGS:
                continue  # a stray closing tag
            if self._close_tag is None:
                self._close_tag = TAGS[tag]
                self._thought = []
                out.append(Piece("thinking_start"))
            else:
                self._end(out)
        return out

    def close(self) -> list[Piece]:
        """Flush what is held back; an unclosed thinking section ends here."""
        out: list[Piece] = []
        self._text(self._buf, out)
        self._buf = ""
        if self._close_tag is not None:
            self._end(out)
        return out

    # -- internals ---------------------------------------------------------------

    def _find_tag(self) -> tuple[str | None, int]:
        if self._close_tag is not None:
            at = self._buf.find(self._close_tag)
            return (self._close_tag, at) if at >= 0 else (None, -1)
        best: tuple[str | None, int] = (None, -1)
        for tag in _OUTSIDE:
            at = self._buf.find(tag)
            if at >= 0 and (best[1] < 0 or at < best[1]):
                best = (tag, at)
        return best

    def _partial_tag_len(self) -> int:
        """How many trailing characters could begin a tag (to hold back)."""
        tags = [self._close_tag] if self._close_tag is not None else _OUTSIDE
        start = self._buf.rfind("<")
        if start < 0:
            return 0
        tail = self._buf[start:]
        return len(tail) if any(t.startswith(tail) for t in tags) else 0

    def _text(self, text: str, out: list[Piece]) -> None:
        if not text:
            return
        if self._close_tag is None:
            self._content.append(text)
            out.append(Piece("content", text))
        else:
            self._thought.append(text)
            out.append(Piece("thinking", text))

    def _end(self, out: list[Piece]) -> None:
        thought = "".join(self._thought)
        self._thinking.append(thought)
        self._close_tag = None
        out.append(Piece("thinking_end", thought))


def split_thinking(text: str) -> tuple[str, str]:
    """``(content, thinking)`` of a whole reply."""
    splitter = ThinkingSplitter()
    splitter.feed(text)
    splitter.close()
    return splitter.content, splitter.thinking
