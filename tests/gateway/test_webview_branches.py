"""Fork and rewind from the web view, in a real headless Chromium against the real gateway,
a loop worker and a tool worker (fixtures of :mod:`tests.gateway.test_webview`): "Branch
from here" on a turn opens a new session that goes on from that turn, "Rewind to here"
marks the later turns undone."""

from __future__ import annotations

from typing import Any

from loopmesh.testing.fake_llm import FakeLLM
from tests.gateway.conftest import GatewayFactory
from tests.gateway.test_webview import ARTIFACTS, llm, mesh, page, pytestmark
from tests.loop_worker.durable import Mesh

__all__ = ["llm", "mesh", "page", "pytestmark"]  # the fixtures, shared


async def send(page: Any, text: str, ended: int) -> None:
    """Type a turn and wait until ``ended`` turns of the view have ended."""
    await page.locator("#input").fill(text)
    await page.locator("#send").click()
    await page.locator(".final").nth(ended - 1).wait_for()


async def test_branch_from_a_turn_goes_on_from_there_and_rewind_marks_later_turns_undone(
    mesh: Mesh, llm: FakeLLM, page: Any, gateway_at: GatewayFactory
):
    async with gateway_at(no_auth=True) as gw:
        await page.goto(gw.url)
        await page.locator("#new-session").click()
        await page.locator("#session-list li.selected").wait_for()
        source = await page.locator("#session-list li.selected").get_attribute("data-session")
        await send(page, "remember the word heron", 1)
        asked = len(llm.requests)
        await send(page, "what was the word?", 2)
        second = llm.requests[asked]

        # branch from the first turn: the page opens the new session, which says whence
        await page.locator(".turn").first.locator("button.branch").click()
        note = page.locator(".line.forked")
        await note.wait_for()
        assert f"Branched from session {source}" in (await note.text_content() or "")
        fork = await page.locator("#session-title").text_content()
        assert fork and fork != source
        asked = len(llm.requests)
        await send(page, "spell the word backwards", 1)
        branched = llm.requests[asked]
        assert branched["messages"][:-1] == second["messages"][:-1]  # the first turn only
        assert branched["messages"][-1]["content"].endswith("spell the word backwards")

        # back in the source: rewind to the first turn; the second is shown undone
        await note.locator("button").click()
        await page.locator(".turn").nth(1).locator("button.rewind").wait_for()
        later = await page.locator(".turn").nth(1).get_attribute("data-turn")
        await page.locator(".turn").first.locator("button.rewind").click()
        await page.locator(".line.rewound").wait_for()
        undone = page.locator(".turn[data-undone=true]")
        await undone.wait_for()
        assert await undone.count() == 1
        assert await undone.get_attribute("data-turn") == later
        assert await undone.locator(".badge.undone").text_content() == "undone"
        assert await undone.locator("button.branch").count() == 0
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        await page.screenshot(path=str(ARTIFACTS / "webview-rewound.png"), full_page=True)

        asked = len(llm.requests)
        await send(page, "what was the word?", 3)  # the undone turn's answer stays shown
        assert llm.requests[asked]["messages"] == second["messages"]
