"""Budgets ([loop.budget]): a turn whose next LLM call would pass a ceiling ends with
reason ``budget``, and a ``budget_reached`` event says which ceiling and by how much."""

from __future__ import annotations

import pytest

from loop_worker.engine.budget import BudgetExceeded, Meter
from loop_worker.engine.settings import BudgetSettings
from loopmesh.settings import Price
from schemas.events import BudgetReached, LLMRequest, Usage
from tests.loop_worker.scripted import Rig, ScriptedLLM, call, done


def used(completion, prompt: int, completion_tokens: int):
    import msgspec

    usage = Usage(
        prompt_tokens=prompt,
        completion_tokens=completion_tokens,
        total_tokens=prompt + completion_tokens,
    )
    return msgspec.structs.replace(completion, usage=usage)


async def test_a_turn_stops_before_the_call_that_would_pass_its_token_ceiling() -> None:
    llm = ScriptedLLM()
    llm.script(
        used(call(("local__echo", {"text": "a"})), 3_000, 500),
        used(call(("local__echo", {"text": "b"})), 3_500, 500),
        used(done(), 4_000, 100),
    )
    async with Rig(llm, budget=BudgetSettings(turn_tokens=5_000)) as rig:
        end = await rig.run()
    assert end.reason == "budget"
    reached = rig.one(BudgetReached)
    assert (reached.ceiling, reached.limit, reached.spent) == ("turn_tokens", 5_000, 7_500)
    assert reached.over == reached.spent + reached.needed - 5_000 > 0
    assert "turn_tokens ceiling (5,000) would be passed" in reached.message
    assert end.error == reached.message
    # two calls were made; the third (the budget was spent by then) was not
    assert len(rig.of(LLMRequest)) == 2 and len(llm.requests) == 2
    assert rig.types.index("budget_reached") < rig.types.index("loop_end")


async def test_a_turn_within_its_ceilings_ends_as_it_would() -> None:
    llm = ScriptedLLM()
    llm.script(used(done(), 100, 10))
    prices = {"m": Price(input=1.0, output=2.0)}
    async with Rig(llm, model="m", budget=BudgetSettings(turn_tokens=1_000, turn_cost=1.0)) as rig:
        rig.engine.prices = prices
        end = await rig.run()
    assert end.reason == "task_completion"
    snapshot = await rig.store.load("acme", "s1")
    assert snapshot is not None
    assert snapshot.turn_tokens == 110
    assert snapshot.turn_cost == pytest.approx((100 * 1.0 + 10 * 2.0) / 1e6)


async def test_a_cost_ceiling_with_a_model_that_has_no_price_fails_closed() -> None:
    llm = ScriptedLLM()
    llm.script(used(done(), 100, 10))
    async with Rig(llm, model="unpriced", budget=BudgetSettings(turn_cost=0.01)) as rig:
        end = await rig.run()
    assert end.reason == "budget" and llm.requests == []
    assert "model 'unpriced' has no price in [prices]" in rig.one(BudgetReached).message


class Today:
    def __init__(self, tokens: int, cost: float = 0.0) -> None:
        self.tokens, self.cost = tokens, cost
        self.asked: list[str] = []

    async def spent_today(self, tenant: str) -> tuple[int, float]:
        self.asked.append(tenant)
        return self.tokens, self.cost


async def test_a_tenant_over_its_daily_ceiling_gets_no_more_calls() -> None:
    meter = Meter(BudgetSettings(tenant_daily_tokens=10_000), {}, "acme", Today(9_900))
    with pytest.raises(BudgetExceeded) as caught:
        await meter.before("m", 200)
    exc = caught.value
    assert (exc.ceiling, exc.spent, exc.needed, exc.over) == (
        "tenant_daily_tokens",
        9_900,
        200,
        100,
    )
    await Meter(BudgetSettings(tenant_daily_tokens=10_000), {}, "acme", Today(9_000)).before(
        "m", 200
    )


async def test_no_ceiling_reads_nothing() -> None:
    today = Today(10**9)
    await Meter(BudgetSettings(), {}, "acme", today).before("m", 10**6)
    assert today.asked == []
