"""Filesystem tools confined to one root directory: ``fs_list``, ``fs_read``, ``fs_write``.

Every path is resolved (symlinks followed) before use and refused unless the result is
inside the root, so ``../x``, ``/etc/passwd`` and a symlink pointing out of the root
all fail with code ``rejected``. The check and the use are not atomic: a process that
can create symlinks inside the root while a call runs could still race it, so give
the root to the tool worker alone.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from .errors import Rejected, ToolError
from .local import to_tool, tool
from .registry import Tool


class Entry(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    type: Literal["file", "dir", "other"]
    size: int


class Root:
    """A directory that paths are confined to."""

    def __init__(self, root: str | Path) -> None:
        self.path = Path(root).resolve(strict=True)
        if not self.path.is_dir():
            raise NotADirectoryError(f"filesystem root {self.path} is not a directory")

    def resolve(self, relative: str) -> Path:
        """``relative`` inside the root, with symlinks resolved; refuse escapes."""
        if "\x00" in relative:
            raise Rejected("path contains a NUL byte")
        candidate = self.path / relative  # an absolute `relative` replaces the root
        resolved = candidate.resolve(strict=False)
        if not resolved.is_relative_to(self.path):
            raise Rejected(f"path {relative!r} is outside the tool root")
        return resolved


def fs_tools(
    root: str | Path, *, max_read_bytes: int = 1_000_000, max_write_bytes: int = 1_000_000
) -> list[Tool]:
    base = Root(root)

    @tool(timeout_s=10)
    def fs_list(path: str = ".") -> list[Entry]:
        """List a directory under the tool root."""
        target = base.resolve(path)
        if not target.is_dir():
            raise ToolError(f"{path!r} is not a directory")
        entries = []
        for child in sorted(target.iterdir()):
            st = child.lstat()
            kind: Literal["file", "dir", "other"] = (
                "dir" if child.is_dir() else "file" if child.is_file() else "other"
            )
            entries.append(Entry(name=child.name, type=kind, size=st.st_size))
        return entries

    @tool(timeout_s=10)
    def fs_read(path: str, max_bytes: Annotated[int, msgspec.Meta(ge=1)] | None = None) -> str:
        """Read a text file under the tool root."""
        target = base.resolve(path)
        if not target.is_file():
            raise ToolError(f"{path!r} is not a file")
        limit = min(max_bytes or max_read_bytes, max_read_bytes)
        with open(target, "rb") as f:
            data = f.read(limit + 1)
        text = data[:limit].decode("utf-8", errors="replace")
        if len(data) > limit:
            text += f"\n[truncated at {limit} bytes]"
        return text

    @tool(timeout_s=10)
    def fs_write(path: str, content: str, append: bool = False) -> str:
        """Write (or append to) a text file under the tool root, creating directories."""
        target = base.resolve(path)
        data = content.encode()
        if len(data) > max_write_bytes:
            raise Rejected(f"content is {len(data)} bytes; the limit is {max_write_bytes}")
        if target == base.path or target.is_dir():
            raise ToolError(f"{path!r} is a directory")
        target.parent.mkdir(parents=True, exist_ok=True)
        flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_APPEND if append else os.O_TRUNC)
        fd = os.open(target, flags, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return f"wrote {len(data)} bytes to {target.relative_to(base.path)}"

    return [to_tool(fs_list), to_tool(fs_read), to_tool(fs_write)]
