"""Tools of the example pool "text", served under the MCP-like server name ``text``.

A worker loads this module through the entry point ``text`` of the group
``loopmesh.tools`` (``[tool_worker] entry_points = ["text"]``) and serves every function
decorated with ``@tool`` here; the model sees them as ``text__word_count`` and
``text__slugify``.
"""

from __future__ import annotations

import re
import unicodedata
from typing import Annotated

import msgspec

from tool_worker import tool


@tool(server="text", timeout_s=60)
def word_count(text: str) -> dict[str, int]:
    """Count the words, distinct words (case-insensitive) and characters of a text."""
    words = re.findall(r"\w+", text)
    return {"words": len(words), "distinct": len({w.lower() for w in words}), "chars": len(text)}


@tool(server="text", timeout_s=60)
def slugify(
    text: str,
    max_length: Annotated[int, msgspec.Meta(ge=1, le=200)] = 80,
) -> str:
    """Turn a title into a URL slug: lowercase ASCII words joined by hyphens."""
    ascii_text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    slug = re.sub(r"[^a-z0-9]+", "-", ascii_text.lower()).strip("-")
    return slug[:max_length].rstrip("-")
