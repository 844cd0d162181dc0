"""Retrieved context: the passages a turn carries (``Turn.context``) and those a
deployment's retriever finds (``[loop] retriever``, or a hook's ``retrieve``), for the
prompt's retrieved-context section.

A retriever is called with the turn and may return a string, a :class:`Passage`, a
``{"text": ..., "source": ...}`` mapping, or a list of them; :func:`passages` checks
that. What retrievers return is bounded to ``[loop] retrieved_max_tokens`` tokens
(:func:`bound`: passages in order, the one that crosses the bound cut short, the rest
dropped); the client's own passages are bounded by the schema (count and size). Both
are part of the prompt, so the budget gate counts them like everything else.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from schemas import Passage
from schemas.wire import MAX_PASSAGE_CHARS

#: The smallest remainder of the bound worth a cut passage.
MIN_CUT_TOKENS = 16


def passage_text(p: Passage) -> str:
    """How a passage reads in the prompt."""
    text = p.text.strip()
    return f"[{p.source}]\n{text}" if p.source else text


def passages(value: Any) -> list[Passage]:
    """A retriever's result as passages; raises ``TypeError`` / ``ValueError`` (a
    ``msgspec.ValidationError``) naming what is wrong."""
    if value is None:
        return []
    if isinstance(value, str | Passage | dict):
        value = [value]
    if not isinstance(value, list | tuple):
        raise TypeError(
            f"a retriever returned {type(value).__name__}; expected a string, a passage "
            "({'text': ..., 'source': ...}) or a list of them"
        )
    out = []
    for item in value:
        if isinstance(item, Passage):
            out.append(item)
        elif isinstance(item, str):
            if item.strip():
                out.append(Passage(text=item[:MAX_PASSAGE_CHARS]))
        else:
            out.append(msgspec.convert(item, Passage))
    return out


def bound(items: Sequence[Passage], max_tokens: int, count: Callable[[str], int]) -> list[Passage]:
    """The passages that fit in ``max_tokens`` (``count``: tokens of a text)."""
    kept: list[Passage] = []
    used = 0
    for p in items:
        n = count(passage_text(p))
        if used + n <= max_tokens:
            kept.append(p)
            used += n
            continue
        room = max_tokens - used
        if room >= MIN_CUT_TOKENS:
            text = p.text[: max(1, len(p.text) * room // max(n, 1))]
            while text:
                cut = msgspec.structs.replace(p, text=text.rstrip() + " …")
                if count(passage_text(cut)) <= room:
                    kept.append(cut)
                    break
                text = text[: len(text) * 4 // 5]
        break
    return kept
