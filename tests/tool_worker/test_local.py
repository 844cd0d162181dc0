"""Local tools: schemas from signatures, module loading, the built-ins, filesystem confinement."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import pytest

from tool_worker import Registry, load_module, to_tool, tool
from tool_worker.builtins import builtin_tools, evaluate, http_fetch_tool
from tool_worker.errors import (
    InvalidArguments,
    RegistryError,
    Rejected,
    ToolError,
    ToolModuleError,
    UnknownTool,
)
from tool_worker.files import fs_tools


async def test_the_schema_comes_from_the_typed_signature_and_the_docstring() -> None:
    @tool(name="search", timeout_s=3, needs_approval=True)
    def search_docs(
        query: str,
        limit: Annotated[int, msgspec.Meta(ge=1, le=50)] = 10,
        mode: Literal["fast", "deep"] = "fast",
    ) -> list[str]:
        """Search the documentation.

        Longer text that is not part of the description."""
        return [query] * limit

    t = to_tool(search_docs)
    assert (t.server, t.name, t.timeout_s, t.needs_approval) == ("local", "search", 3, True)
    assert t.description == "Search the documentation."
    assert t.input_schema["required"] == ["query"]
    assert t.input_schema["properties"]["limit"] == {
        "type": "integer", "minimum": 1, "maximum": 50, "default": 10,
    }  # fmt: skip
    assert sorted(t.input_schema["properties"]["mode"]["enum"]) == ["deep", "fast"]
    assert t.input_schema["additionalProperties"] is False
    with pytest.raises(
        InvalidArguments, match=r"51 is greater than the maximum of 50 - at `\$.limit`"
    ):
        t.validate({"query": "x", "limit": 51})
    assert await t.invoke({"query": "q", "limit": 2}) == '["q","q"]'


async def test_sync_tools_run_off_the_event_loop() -> None:
    @tool
    def which_thread() -> int:
        return threading.get_ident()

    assert await to_tool(which_thread).invoke({}) != str(threading.get_ident())


def test_signatures_that_cannot_be_schemas_are_refused() -> None:
    def variadic(*args: int) -> None: ...

    def bad_name() -> None: ...

    with pytest.raises(RegistryError, match="named parameter"):
        to_tool(variadic)
    with pytest.raises(RegistryError, match="not a subject token"):
        to_tool(tool(name="bad.name")(bad_name))


def test_modules_are_loaded_by_import_path() -> None:
    tools = {t.name for t in load_module("tests.tool_worker.sample_tools")}
    assert {"echo", "sleep", "record", "explode"} <= tools
    with pytest.raises(ToolModuleError, match="no_such_module"):
        load_module("tests.no_such_module")
    with pytest.raises(ToolModuleError, match="no functions decorated"):
        load_module("tool_worker.errors")


def test_the_registry_refuses_duplicates_and_names_what_it_serves() -> None:
    registry = Registry(builtin_tools(("calculator",)))
    with pytest.raises(RegistryError):
        registry.add(builtin_tools(("calculator",))[0])
    with pytest.raises(UnknownTool, match=r"local\.calculator"):
        registry.get("local", "nope")


@pytest.mark.parametrize(
    ("expression", "value"),
    [("1 + 2 * 3", 7), ("(1 + 2) * 3", 9), ("-2 ** 2", -4), ("7 // 2 + 7 % 2", 4),
     ("2 ** 10", 1024), ("sqrt(16) + abs(-1)", 5.0), ("round(pi, 2)", 3.14), ("10 / 4", 2.5)],
)  # fmt: skip
def test_the_calculator_does_arithmetic(expression: str, value: float) -> None:
    assert evaluate(expression) == value


@pytest.mark.parametrize(
    ("expression", "message"),
    [("__import__('os').system('true')", "Call is not allowed"),
     ("open('x')", "unknown function 'open'"), ("x + 1", "unknown name 'x'"),
     ("(1).__class__", "Attribute is not allowed"), ("9 ** 9 ** 9", "too large"),
     ("1 / 0", "division by zero"), ("'a' * 3", "Constant is not allowed"), ("1 +", "not an")],
)  # fmt: skip
def test_the_calculator_refuses_anything_else(expression: str, message: str) -> None:
    with pytest.raises(ToolError, match=message):
        evaluate(expression)


async def test_current_time_takes_an_iana_timezone() -> None:
    (current_time,) = builtin_tools(("current_time",))
    assert (await current_time.invoke({"timezone": "Asia/Kolkata"})).endswith("+05:30")
    assert (await current_time.invoke({})).endswith("+00:00")
    with pytest.raises(ToolError, match="unknown timezone 'Nowhere/City'"):
        await current_time.invoke({"timezone": "Nowhere/City"})


# -- filesystem ---------------------------------------------------------------------


@pytest.fixture
def fs(tmp_path: Path) -> dict[str, Any]:
    root = tmp_path / "root"
    (root / "docs").mkdir(parents=True)
    (root / "docs" / "a.txt").write_text("hello")
    (tmp_path / "secret.txt").write_text("top secret")
    os.symlink(tmp_path / "secret.txt", root / "link_out")
    os.symlink(tmp_path, root / "dir_out")
    os.symlink(root / "docs" / "a.txt", root / "link_in")
    return {t.name: t for t in fs_tools(root)} | {"root": root, "outside": tmp_path}


async def test_filesystem_tools_work_inside_the_root(fs: dict[str, Any]) -> None:
    assert await fs["fs_read"].invoke({"path": "docs/a.txt"}) == "hello"
    assert await fs["fs_read"].invoke({"path": "link_in"}) == "hello"
    assert "wrote 5 bytes" in await fs["fs_write"].invoke({"path": "new/b.txt", "content": "there"})
    await fs["fs_write"].invoke({"path": "new/b.txt", "content": "!", "append": True})
    assert (fs["root"] / "new" / "b.txt").read_text() == "there!"
    listing = msgspec.json.decode(await fs["fs_list"].invoke({"path": "."}))
    assert {"name": "docs", "type": "dir", "size": listing[1]["size"]} in listing


@pytest.mark.parametrize(
    ("tool_name", "arguments"),
    [("fs_read", {"path": "../secret.txt"}), ("fs_read", {"path": "docs/../../secret.txt"}),
     ("fs_read", {"path": "/etc/passwd"}), ("fs_read", {"path": "link_out"}),
     ("fs_read", {"path": "dir_out/secret.txt"}), ("fs_list", {"path": ".."}),
     ("fs_write", {"path": "../evil.txt", "content": "x"}),
     ("fs_write", {"path": "link_out", "content": "overwritten"}),
     ("fs_write", {"path": "dir_out/evil.txt", "content": "x"})],
)  # fmt: skip
async def test_filesystem_escapes_are_refused(
    fs: dict[str, Any], tool_name: str, arguments: dict[str, str]
) -> None:
    with pytest.raises(Rejected, match="outside the tool root"):
        await fs[tool_name].invoke(arguments)
    assert (fs["outside"] / "secret.txt").read_text() == "top secret"
    assert not (fs["outside"] / "evil.txt").exists()


# -- http_fetch ---------------------------------------------------------------------


@pytest.fixture
async def http_server() -> AsyncIterator[str]:
    """A loopback HTTP server: ``/small`` answers "hello", ``/big`` 100 kB."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = await reader.readuntil(b"\r\n\r\n")
        body = b"x" * 100_000 if b"/big" in request.split(b"\r\n")[0] else b"hello"
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n%s" % (len(body), body)
        )
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        yield f"http://127.0.0.1:{port}"


async def test_http_fetch_reads_within_its_limits(http_server: str) -> None:
    fetch = http_fetch_tool(max_bytes=1000, allowlist=("127.0.0.1",))
    small = msgspec.json.decode(await fetch.invoke({"url": f"{http_server}/small"}))
    assert (small["status"], small["content"], small["truncated"]) == (200, "hello", False)
    big = msgspec.json.decode(await fetch.invoke({"url": f"{http_server}/big"}))
    assert big["truncated"] and len(big["content"]) == 1000


async def test_http_fetch_refuses_other_schemes_and_hosts(http_server: str) -> None:
    fetch = http_fetch_tool(allowlist=("*.example.org",))
    with pytest.raises(Rejected, match="only http and https"):
        await fetch.invoke({"url": "file:///etc/passwd"})
    with pytest.raises(Rejected, match="not in the allowlist"):
        await fetch.invoke({"url": f"{http_server}/small"})
