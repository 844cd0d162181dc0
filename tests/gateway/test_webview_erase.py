"""The web view's Erase: asked once, then the session is erased (``DELETE``) and leaves
the page and the list; a real headless Chromium against real servers (see
``test_webview.py``)."""

from __future__ import annotations

from typing import Any

import httpx

from loopmesh.testing.durable import stream_events
from loopmesh.testing.fake_llm import FakeLLM, tool_calls
from tests.gateway.conftest import GatewayFactory
from tests.gateway.test_webview import (  # noqa: F401 (fixtures: mesh, llm, page)
    _selected_session,
    llm,
    mesh,
    page,
    pytestmark,
)
from tests.loop_worker.durable import Mesh


async def test_erase_asks_once_then_the_session_leaves_the_page_and_the_list(
    mesh: Mesh,  # noqa: F811
    llm: FakeLLM,  # noqa: F811
    gateway_at: GatewayFactory,
    page: Any,  # noqa: F811
):
    llm.script(tool_calls(("task_completion", {"result": "done and dusted"})))
    async with gateway_at(no_auth=True) as gw:
        await page.goto(gw.url)
        assert await page.locator("#erase").is_disabled()  # no session open
        await page.locator("#new-session").click()
        session = await _selected_session(page)
        await page.locator("#input").fill("Say you are done.")
        await page.locator("#send").click()
        await page.locator(".final").wait_for()

        await page.locator("#erase:enabled").click()
        assert await page.locator("#erase").text_content() == "Erase for good?"
        assert await page.locator(".turn").count() == 1  # nothing erased yet
        await page.locator("#erase").click()
        erased = page.locator("#timeline .erased")
        await erased.wait_for()
        assert await erased.text_content() == f"Session {session} was erased."
        item = page.locator(f"#session-list li[data-session='{session}']")
        await item.wait_for(state="detached")
        assert await page.locator("#erase").is_disabled()
        async with httpx.AsyncClient(base_url=gw.url) as http:
            assert (await http.get(f"/v1/sessions/{session}")).status_code == 404
    assert await stream_events(mesh.nc, "local", session) == []
