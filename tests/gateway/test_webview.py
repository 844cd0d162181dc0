"""The web view in a real headless Chromium (Debian's, driven by Playwright), against a
real nats-server, the gateway on a real port, a loop worker and a tool worker, with the
fake OpenAI server scripted to plan, call a tool that needs approval, and finish.

A screenshot of the finished turn is saved to ``$LOOPMESH_ARTIFACTS/webview.png``
(default ``tests/artifacts/``, git-ignored); ``docs/webview.png`` is a copy of one. One
of a paused turn goes to ``webview-paused.png`` beside it.
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.server import GatewayServer
from loopmesh.testing.durable import stream_events, wait_for
from loopmesh.testing.fake_llm import FakeLLM, error, text, tool_calls
from tests.gateway.conftest import ACME_KEY, GatewayFactory
from tests.gateway.proxy import Proxy
from tests.loop_worker.durable import Mesh, Watch, mesh_on

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip
ARTIFACTS = Path(
    os.environ.get("LOOPMESH_ARTIFACTS") or Path(__file__).resolve().parents[1] / "artifacts"
)
TIMEOUT_MS = 60_000  # generous: the machine may be busy

pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists(),
    reason=f"{CHROMIUM} is absent: install Debian's chromium (apt-get install chromium) "
    "to run the browser tests",
)


@pytest.fixture
async def mesh(nats_url: str) -> AsyncIterator[Mesh]:
    async with mesh_on(nats_url, provisioned=True, workers=True) as mesh:
        yield mesh


@pytest.fixture
def llm(mesh: Mesh) -> FakeLLM:
    """The mesh's fake LLM, scripted per test."""
    assert mesh.fake is not None
    return mesh.fake


@pytest.fixture
async def proxy(gateway: GatewayServer) -> AsyncIterator[Proxy]:
    """The gateway behind a proxy whose connections the test drops."""
    async with Proxy("127.0.0.1", gateway.port) as p:
        yield p


@pytest.fixture
async def page() -> AsyncIterator[Any]:
    from playwright.async_api import async_playwright

    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            context = await browser.new_context(viewport={"width": 1360, "height": 900})
            page = await context.new_page()
            page.set_default_timeout(TIMEOUT_MS)
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            yield page
            assert not errors, f"the page threw: {errors}"
        finally:
            await browser.close()


def steps(titles: list[str], *statuses: str) -> dict[str, Any]:
    """``update_plan`` arguments: the steps ``titles`` with ``statuses``."""
    return {"steps": [{"title": t, "status": s} for t, s in zip(titles, statuses, strict=True)]}


async def texts(page: Any, selector: str) -> list[str]:
    return list(await page.locator(selector).all_text_contents())


async def test_the_page_runs_a_turn_through_an_approval_and_a_dropped_stream(
    mesh: Mesh, llm: FakeLLM, proxy: Proxy, page: Any, tmp_path: Path
):
    greeting, visits = tmp_path / "greeting.txt", tmp_path / "visits.txt"
    answer = "Wrote hello to greeting.txt and counted one visit."
    titles = ["Write the greeting", "Count the visit"]
    llm.script(
        tool_calls(
            ("update_plan", steps(titles, "in_progress", "pending")),
            content="<thinking>Writing a file needs a person's approval; plan first.</thinking>"
            "I'll make a plan, then write the greeting.",
            chunk_size=2,
            delay_s=0.01,  # streamed for about a second: stored as a few coalesced deltas
        ),
        tool_calls(
            ("local__guarded", {"path": str(greeting), "label": "hello"}),
            content="Writing the greeting; this tool waits for approval.",
        ),
        tool_calls(
            ("update_plan", steps(titles, "done", "in_progress")),
            ("local__count", {"path": str(visits), "label": "visit", "seconds": 1.0}),
            content="Approved and written. Now counting the visit.",
        ),
        tool_calls(
            ("update_plan", steps(titles, "done", "done")),
            ("task_completion", {"result": answer}),
            content="Both steps are done.",
        ),
    )
    # with keys: the page asks for one, then lists the tenant's sessions
    await page.goto(proxy.url)
    await page.locator("#key").fill(ACME_KEY)
    await page.locator("#key-form button[type=submit]").click()
    await page.locator("#new-session").click()
    session = await _selected_session(page)
    async with Watch(mesh.nc, "acme", session) as watch:
        await page.locator("#input").fill("Write hello to greeting.txt, then count a visit.")
        await page.locator("#send").click()

        card = page.locator(".call", has_text="local.guarded")
        await card.locator("button.approve").wait_for()
        assert '"label": "hello"' in await card.locator(".call-args").text_content()
        assert await page.locator(".thinking-text").first.text_content() == (
            "Writing a file needs a person's approval; plan first."
        )
        await card.locator("button.approve").click()

        # the stream drops while the counting tool runs; its result arrives meanwhile
        counting = page.locator(".call", has_text="local.count")
        await counting.wait_for()
        proxy.down()
        assert proxy.dropped > 0
        await page.locator("#link[data-state=retry]").wait_for()
        call_id = await counting.get_attribute("data-call")
        await wait_for(
            lambda: any(e.call_id == call_id for e in watch.of("tool_result")),
            timeout=60,
            what="the counting tool's result",
        )
        shown_before = await _last_event_id(page)
        reconnects_from = len(proxy.requests)
        proxy.up()

        final = page.locator(".final")
        await final.wait_for()
        end = await watch.wait("loop_end")
    await page.locator("#link[data-state=live]").wait_for()
    # it resumed from the last event it had shown, by Last-Event-ID
    resumed = re.findall(
        rb"GET /v1/sessions/[^ ]+/events[^\r]*\r\n(?:[^\r]+\r\n)*?last-event-id: ([0-9]+)\r\n",
        bytes(proxy.requests[reconnects_from:]),
        re.IGNORECASE,
    )
    assert resumed and int(resumed[0]) == shown_before, (resumed, shown_before)

    # what the page shows
    assert await final.locator(".final-title").text_content() == "Final answer"
    assert await final.locator(".final-text").text_content() == answer
    assert end.iterations == 4
    assert await final.locator(".final-meta").text_content() == "4 iterations"
    assert await page.locator(".turn-iter").text_content() == "4 of 6 iterations"
    assert await card.locator(".badge").text_content() == "done"
    assert await card.locator(".call-result").text_content() == "written"
    assert "Approved" in await card.locator(".approval").text_content()
    assert await counting.locator(".call-result").text_content() == "counted visit"
    tool_worker = mesh.running[0].service.name
    facts = await counting.locator(".call-facts").text_content()
    shown_facts = rf"([0-9]+ ms|[0-9]+\.[0-9]{{2}} s) · on {re.escape(tool_worker)}"
    assert re.fullmatch(shown_facts, facts), facts
    assert facts.endswith(" s · on " + tool_worker)  # it slept a second
    facts = await card.locator(".call-facts").text_content()
    assert re.fullmatch(shown_facts, facts), facts
    assert await page.locator(".turn-meta").text_content() == "fake-model · on w1"
    assert await texts(page, "#plan .step-title") == titles
    assert [await s.get_attribute("data-status") for s in await page.locator("#plan li").all()] == [
        "done",
        "done",
    ]
    assert greeting.read_text() == "hello\n" and visits.read_text() == "visit\n"

    # nothing twice: each streamed text is exactly the model's reply, each card is once
    stored = [e for e, _ in await stream_events(mesh.nc, "acme", session)]
    replies = {e.iteration: e.content for e in stored if e.type == "llm_response"}
    shown = {
        int(await a.get_attribute("data-iteration") or 0): await a.text_content()
        for a in await page.locator(".assistant").all()
    }
    assert shown == {k: v for k, v in replies.items() if v}
    chunks = len(replies[1]) // 2  # its text streamed 2 characters a chunk
    assert len([e for e in stored if e.type == "content_delta" and e.iteration == 1]) < chunks
    assert await page.locator(".assistant").count() == len(shown)
    calls = [e.call_id for e in stored if e.type == "tool_call" and e.server != "loop"]
    assert [await c.get_attribute("data-call") for c in await page.locator(".call").all()] == calls
    assert await page.locator(".final").count() == 1
    assert await page.locator(".thinking").count() == 1
    assert await page.locator(".user").text_content() == (
        "Write hello to greeting.txt, then count a visit."
    )

    await asyncio.to_thread(ARTIFACTS.mkdir, parents=True, exist_ok=True)
    await page.screenshot(path=str(ARTIFACTS / "webview.png"), full_page=True)


async def test_deny_a_call_answer_the_question_in_the_box_then_cancel_the_next_turn(
    mesh: Mesh, llm: FakeLLM, gateway_at: GatewayFactory, page: Any, tmp_path: Path
):
    question = "I may not write there. Which file should I count in instead?"
    llm.script(
        tool_calls(("local__guarded", {"path": str(tmp_path / "no"), "label": "x"})),
        tool_calls(("ask_question", {"question": question})),
        tool_calls(
            ("local__count", {"path": str(tmp_path / "n"), "seconds": 10}),
            content="Counting, slowly.",
        ),
    )
    async with gateway_at(no_auth=True) as gw:
        await page.goto(gw.url)  # no-auth: no key asked for
        await page.locator("#new-session").click()
        await _selected_session(page)
        await page.locator("#input").fill("Write x to the file 'no'.")
        await page.locator("#send").click()

        guarded = page.locator(".call", has_text="local.guarded")
        await guarded.locator("button.deny").click()
        first = page.locator(".turn").nth(0)
        await first.locator(".final.ask_question").wait_for()
        assert await guarded.locator(".approval").text_content() == "Denied"
        assert await guarded.get_attribute("data-status") == "error"  # the loop refused it
        assert await first.locator(".final-text").text_content() == question
        assert await page.locator("#question").text_content() == f"The model asks: {question}"
        assert await page.locator("#input").get_attribute("placeholder") == "Your answer…"

        # the answer is the next turn
        await page.locator("#input").fill("Count in the file 'n'.")
        await page.locator("#send").click()
        second = page.locator(".turn").nth(1)
        counting = second.locator(".call", has_text="local.count")
        await counting.wait_for()
        assert await second.locator(".user").text_content() == "Count in the file 'n'."
        assert await page.locator("#question").is_hidden()
        await page.locator("#cancel:enabled").click()
        await second.locator(".final.cancelled").wait_for()
        assert await second.locator(".final-title").text_content() == "Cancelled"
        assert await page.locator("#cancel").is_disabled()
        assert await page.locator(".turn").count() == 2
    assert not (tmp_path / "no").exists()


async def test_a_turn_paused_from_the_page_shows_paused_then_running_once_resumed(
    mesh: Mesh, llm: FakeLLM, gateway_at: GatewayFactory, page: Any, tmp_path: Path
):
    llm.script(
        tool_calls(
            ("local__count", {"path": str(tmp_path / "n"), "label": "one", "seconds": 1.0}),
            content="Counting once.",
        ),
        tool_calls(
            ("local__count", {"path": str(tmp_path / "n"), "label": "two", "seconds": 2.0}),
            content="Counting again.",
        ),
        tool_calls(("task_completion", {"result": "counted twice"})),
    )
    async with gateway_at(no_auth=True) as gw:
        await page.goto(gw.url)
        await page.locator("#new-session").click()
        session = await _selected_session(page)
        status = page.locator("#session-status")
        await page.locator("#input").fill("Count twice.")
        await page.locator("#send").click()
        await page.locator(".call", has_text="local.count").first.wait_for()
        assert await page.locator("#resume").is_disabled()

        # the pause takes hold at the next iteration, once the first count has run
        await page.locator("#pause:enabled").click()
        turn = page.locator(".turn[data-state=paused]")
        await turn.wait_for()
        await page.locator("#session-status[data-status=paused]").wait_for()
        assert await status.text_content() == "paused"
        assert await page.locator("#pause").is_disabled()
        assert await page.locator("#cancel").is_enabled()
        stored = [e.type for e, _ in await stream_events(mesh.nc, "local", session)]
        assert stored[-1] == "paused" and stored.count("tool_call") == 1  # it waits
        assert (tmp_path / "n").read_text() == "one\n"
        await asyncio.to_thread(ARTIFACTS.mkdir, parents=True, exist_ok=True)
        await page.screenshot(path=str(ARTIFACTS / "webview-paused.png"))

        await page.locator("#resume:enabled").click()
        await page.locator(".turn[data-state=running]").wait_for()
        await page.locator(".call", has_text="local.count").nth(1).wait_for()
        assert await status.text_content() == "running"
        assert await page.locator("#pause").is_enabled()
        assert await page.locator("#resume").is_disabled()
        assert await texts(page, ".turn .note") == ["Paused", "Resumed"]

        final = page.locator(".final.task_completion")
        await final.wait_for()
        assert await final.locator(".final-text").text_content() == "counted twice"
        await page.locator("#session-status[data-status=idle]").wait_for()
        assert await page.locator("#pause").is_disabled()
        assert await page.locator("#resume").is_disabled()
    assert (tmp_path / "n").read_text() == "one\ntwo\n"


async def test_model_output_is_shown_as_text_never_as_markup(
    mesh: Mesh, llm: FakeLLM, gateway_at: GatewayFactory, page: Any
):
    hostile = '<img src=x onerror="window.__pwned=1"><script>window.__pwned=2</script>'
    llm.script(tool_calls(("task_completion", {"result": f"done {hostile}"}), content=hostile))
    async with gateway_at(no_auth=True) as gw:
        await page.goto(gw.url)
        await page.locator("#new-session").click()
        await _selected_session(page)
        await page.locator("#input").fill(f"say {hostile}")
        await page.locator("#input").press("Control+Enter")
        await page.locator(".final").wait_for()
        assert await page.locator(".final-text").text_content() == f"done {hostile}"
        assert await page.locator(".assistant").text_content() == hostile
        assert await page.locator(".user").text_content() == f"say {hostile}"

        # an error the model's server sends back is text too, and says why the turn stopped
        llm.script(error(500, f"upstream broke {hostile}"))
        await page.locator("#input").fill("again")
        await page.locator("#send").click()
        failed = page.locator(".turn").nth(1).locator(".final.llm_failed")
        await failed.wait_for()
        title = "Stopped: the model could not be reached"
        assert await failed.locator(".final-title").text_content() == title
        assert hostile in await failed.locator(".final-error").text_content()

        # reloaded, the page replays the session's history: the same, once
        shown = await page.locator("#timeline").inner_text()
        await page.reload()
        await page.locator(".turn:nth-child(2) .final").wait_for()
        assert await page.locator("#timeline").inner_text() == shown
        assert await page.locator(".final").count() == 2
        assert await page.locator("img").count() == 0
        assert await page.locator(".timeline script").count() == 0
        assert await page.evaluate("window.__pwned") is None
        # and a second wall: the page forbids inline script
        async with httpx.AsyncClient(base_url=gw.url) as client:
            r = await client.get("/")
        assert "script-src 'self'" in r.headers["content-security-policy"]


async def test_text_taken_back_is_dropped_and_a_reloaded_page_shows_what_was_asked(
    mesh: Mesh, llm: FakeLLM, gateway_at: GatewayFactory, page: Any
):
    llm.script(
        text("Here is a draft that calls no tool"),  # nudged: the loop asks again
        tool_calls(("task_completion", {"result": "the real answer"})),
    )
    async with gateway_at(no_auth=True) as gw:
        await page.goto(gw.url)
        await page.locator("#new-session").click()
        await _selected_session(page)
        await page.locator("#input").fill("draft something")
        await page.locator("#input").press("Control+Enter")
        await page.locator(".final").wait_for()
        await page.locator(".line.retracted").wait_for()
        assert "draft that calls no tool" not in await page.locator("#timeline").inner_text()

        # a fresh page knows the input only from the events (turn_accepted)
        await page.reload()
        await page.locator(".final").wait_for()
        assert await page.locator(".user").text_content() == "draft something"
        assert await page.locator(".line.retracted").count() == 1
        assert "draft that calls no tool" not in await page.locator("#timeline").inner_text()


async def test_the_page_and_its_assets_are_served_with_a_strict_policy(
    gateway: GatewayServer,
):
    async with httpx.AsyncClient(base_url=gateway.url) as client:
        page = await client.get("/")
        script = await client.get("/static/app.js")
        missing = await client.get("/static/nope.js")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<script type="module" src="/static/app.js">' in page.text
    policy = page.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "'unsafe-inline'" not in policy
    assert script.status_code == 200 and "javascript" in script.headers["content-type"]
    assert script.headers["x-content-type-options"] == "nosniff"
    assert missing.status_code == 404


async def _last_event_id(page: Any) -> int:
    """The id of the last event the page applied (it keeps it on the timeline)."""
    return int(await page.locator("#timeline").get_attribute("data-last-id") or 0)


async def _selected_session(page: Any) -> str:
    selected = page.locator("#session-list li.selected")
    await selected.wait_for()
    name = await selected.get_attribute("data-session")
    assert name
    return name
