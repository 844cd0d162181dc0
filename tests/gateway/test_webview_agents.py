"""The web view's agents and schedules in a real headless Chromium against real servers
(fixtures of :mod:`tests.gateway.test_webview`): the agents listed and the one picked
starting a session, a called agent's turn shown inside its call and approved from there,
and the schedules listed and paused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from loopmesh.agents import apply_agents
from loopmesh.testing.durable import SUBJECTS, stream_events
from loopmesh.testing.fake_llm import FakeLLM, tool_calls
from schemas import AgentSpec
from tests.gateway.conftest import GatewayFactory
from tests.gateway.test_webview import (
    _selected_session,
    llm,
    mesh,
    page,
    pytestmark,
    texts,
)
from tests.loop_worker.durable import Mesh

__all__ = ["llm", "mesh", "page", "pytestmark"]  # the fixtures, shared


async def test_the_page_lists_the_agents_and_starts_a_session_with_the_one_picked(
    mesh: Mesh, llm: FakeLLM, gateway_at: GatewayFactory, page: Any
):
    calc = AgentSpec(
        name="calc",
        description="Counts with the count tool.",
        instructions="You are a careful counter.",
        model="calc-model",
        tools=("local.count",),
    )
    await apply_agents(mesh.nc.jetstream(), SUBJECTS, [calc])
    book = mesh.running[-1].service.agents  # the loop worker's live view of them
    assert await book.wait_for(lambda b: b.get("calc") is not None, 10)
    revision = book.get("calc").revision
    llm.script(tool_calls(("task_completion", {"result": "counted to 3"})))
    async with gateway_at(no_auth=True) as gw:
        await page.goto(gw.url)
        await page.locator("#agent option[value=calc]").wait_for(state="attached")
        assert await texts(page, "#agent option") == ["default", "calc"]
        await page.locator("#agent").select_option("calc")
        assert await page.locator("#agent-about").text_content() == calc.description
        await page.locator("#new-session").click()
        session = await _selected_session(page)
        item = page.locator(f"#session-list li[data-session='{session}']")
        assert await item.get_attribute("data-agent") == "calc"
        assert (await item.locator(".session-meta").text_content() or "").startswith("calc · ")
        assert await page.locator("#session-agent").text_content() == "agent calc"

        await page.locator("#input").fill("Count to three.")
        await page.locator("#send").click()
        await page.locator(".final").wait_for()
        assert await page.locator(".turn").get_attribute("data-agent") == "calc"
        assert await page.locator("#agent-fact").text_content() == f"calc (revision {revision})"
        assert await page.locator(".final-text").text_content() == "counted to 3"
    [request] = llm.requests_for("calc-model")
    assert "You are a careful counter." in request["messages"][0]["content"]
    offered = {t["function"]["name"] for t in request["tools"]}
    assert "local__count" in offered and "local__echo" not in offered


async def test_the_page_lists_the_schedules_and_pauses_one(
    nats_url: str, gateway_at: GatewayFactory, page: Any
):
    async with gateway_at(no_auth=True) as gw:
        async with httpx.AsyncClient(base_url=gw.url) as c:
            for body in (
                {"id": "nightly", "cron": "0 2 * * *", "input": "tidy up", "session": "ops"},
                {"id": "weekly", "cron": "0 9 * * 1", "timezone": "Europe/Paris", "input": "x"},
            ):
                assert (await c.post("/v1/schedules", json=body)).status_code == 201
        await page.goto(gw.url)
        nightly = page.locator("#schedule-list li[data-schedule='nightly']")
        await nightly.wait_for()
        assert await texts(page, "#schedule-list .session-name") == ["nightly", "weekly"]
        meta = await nightly.locator(".session-meta").text_content() or ""
        assert "02:00" in meta and "(UTC) · default · next in " in meta
        weekly = page.locator("#schedule-list li[data-schedule='weekly']")
        assert "09:00 on Monday (Europe/Paris)" in (
            await weekly.locator(".session-meta").text_content() or ""
        )
        await weekly.locator("button").click()
        await weekly.locator(".badge", has_text="paused").wait_for()
        assert await weekly.locator("button").text_content() == "Resume"
        async with httpx.AsyncClient(base_url=gw.url) as c:
            assert (await c.get("/v1/schedules/weekly")).json()["paused"] is True
        await nightly.click()  # a schedule with a session opens it
        assert await page.locator("#session-title").text_content() == "ops"


async def test_a_called_agents_turn_shows_in_its_call_and_is_approved_from_there(
    mesh: Mesh, llm: FakeLLM, gateway_at: GatewayFactory, page: Any, tmp_path: Path
):
    """A parent agent calls a child agent whose tool needs a person's approval: the page
    of the parent's session shows the child's turn inside the call, with its approval,
    and the decision made there reaches the child."""
    greeting = tmp_path / "greeting.txt"
    boss = AgentSpec(name="boss", description="Delegates writing.", model="boss-model",
                     agents=("writer",))  # fmt: skip
    writer = AgentSpec(name="writer", description="Writes files.", model="writer-model",
                       tools=("local.guarded",))  # fmt: skip
    await apply_agents(mesh.nc.jetstream(), SUBJECTS, [boss, writer])
    book = mesh.running[-1].service.agents
    assert await book.wait_for(lambda b: b.get("writer") is not None, 10)
    llm.script_for("boss-model",
        tool_calls(("agents__writer", {"input": "write hello to the greeting file"})),
        tool_calls(("task_completion", {"result": "the writer wrote it"})),
    )  # fmt: skip
    llm.script_for("writer-model",
        tool_calls(("local__guarded", {"path": str(greeting), "label": "hello"})),
        tool_calls(("task_completion", {"result": "written"})),
    )  # fmt: skip
    async with gateway_at(no_auth=True) as gw:
        await page.goto(gw.url)
        await page.locator("#agent option[value=boss]").wait_for(state="attached")
        await page.locator("#agent").select_option("boss")
        await page.locator("#new-session").click()
        await _selected_session(page)
        await page.locator("#input").fill("Have the writer greet.")
        await page.locator("#send").click()

        call = page.locator("#timeline > .turn .call", has_text="agents.writer").first
        nested = call.locator(".child .call", has_text="local.guarded")
        await nested.locator("button.approve").click()  # in the parent's page
        final = page.locator("#timeline > .turn > .turn-body > .final")
        await final.wait_for()
        assert await final.locator(".final-text").text_content() == "the writer wrote it"
        child_final = call.locator(".child .final .final-text")
        assert await child_final.text_content() == "written"
        assert await nested.locator(".badge").text_content() == "done"
        assert await call.locator(".call-result").last.text_content() == "written"
        session = await _selected_session(page)
    assert greeting.read_text() == "hello\n"
    # the child's approval request was announced in the parent's session too
    stored = [e for e, _ in await stream_events(mesh.nc, "local", session)]
    [relayed] = [e for e in stored if e.type == "approval_required"]
    [agent_call] = [e for e in stored if e.type == "tool_call" and e.server == "agents"]
    assert relayed.call_session == agent_call.call_id and relayed.tool == "guarded"
