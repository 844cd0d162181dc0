"""OpenAILLM with a rate limiter (``[llm.limits]``): a permit per attempt, settled with
the reply's usage; a 429 with ``Retry-After`` pauses the model in the limiter instead of
sleeping; and the limits' configuration, refused at load with the field named."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from loop_worker.config import LoopWorkerConfig
from loop_worker.engine.llm import OpenAILLM
from loop_worker.engine.ratelimit import PROMPT_TOKENS, TURN_TENANT, LocalLimiter
from loop_worker.engine.settings import LimitSettings, LLMSettings, ModelLimits
from loopmesh.errors import ConfigError
from loopmesh.settings import load
from loopmesh.testing.durable import wait_for
from loopmesh.testing.fake_llm import FakeLLM, error, text
from schemas import ChatMessage

HI = [ChatMessage(role="user", content="hi")]


class Recording:
    """A RateLimiter that grants at once and records what it was asked."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, str, int]] = []
        self.settled: list[tuple[int | None, bool]] = []
        self.paused: list[tuple[str, float]] = []

    async def acquire(self, model: str, tenant: str, tokens: int) -> Recording:
        self.asked.append((model, tenant, tokens))
        return self

    async def settle(self, tokens: int | None = None, *, sent: bool = True) -> None:
        self.settled.append((tokens, sent))

    async def pause(self, model: str, seconds: float) -> None:
        self.paused.append((model, seconds))


def settings(fake: FakeLLM, **more: object) -> LLMSettings:
    return LLMSettings(base_url=fake.base_url, api_key="t", model="m", **more)  # type: ignore[arg-type]


async def test_each_request_asks_for_its_estimate_and_settles_with_its_usage(fake_llm):
    fake_llm.script(text("hello"))
    limiter = Recording()
    sleeps: list[float] = []

    async def sleep(s: float) -> None:
        sleeps.append(s)

    async with OpenAILLM(settings(fake_llm, max_tokens=50), limiter=limiter, sleep=sleep) as llm:
        tenant, counted = TURN_TENANT.set("acme"), PROMPT_TOKENS.set(120)
        try:
            result = await llm.complete(HI)
        finally:
            TURN_TENANT.reset(tenant)
            PROMPT_TOKENS.reset(counted)
    assert limiter.asked == [("m", "acme", 170)]  # the loop's count and the reply's ceiling
    assert result.usage is not None
    assert limiter.settled == [(result.usage.total_tokens, True)]


async def test_a_429_with_retry_after_pauses_the_model_instead_of_sleeping(fake_llm):
    fake_llm.script(error(429, "slow down", retry_after=90), text("ok"))
    limiter = Recording()
    sleeps: list[float] = []

    async def sleep(s: float) -> None:
        sleeps.append(s)

    async with OpenAILLM(settings(fake_llm), limiter=limiter, sleep=sleep) as llm:
        result = await llm.complete(HI)
    assert result.content == "ok"
    assert limiter.paused == [("m", 60.0)]  # cut to [llm.limits] max_pause_s
    assert sleeps == []  # the next acquire waits for the pause, for every worker
    assert len(limiter.asked) == 2
    assert limiter.settled[0] == (None, True)  # the 429'd request counts as estimated


async def test_a_429_without_limiter_still_backs_off_here(fake_llm):
    fake_llm.script(error(429, "slow down", retry_after=3), text("ok"))
    sleeps: list[float] = []

    async def sleep(s: float) -> None:
        sleeps.append(s)

    async with OpenAILLM(settings(fake_llm), sleep=sleep) as llm:
        await llm.complete(HI)
    assert sleeps == [3.0]


async def test_a_request_waiting_for_a_local_limit_is_cancelled_cleanly(fake_llm):
    limits = LimitSettings(models={"m": ModelLimits(rpm=1)})
    limiter = LocalLimiter(limits)
    fake_llm.script(text("first"))
    async with OpenAILLM(settings(fake_llm), limiter=limiter) as llm:
        await llm.complete(HI)
        waiting = asyncio.create_task(llm.complete(HI))  # the minute's one request is spent
        await wait_for(lambda: limiter.book.waiting("m") == 1, what="the second to wait")
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
    assert limiter.book.waiting("m") == 0
    assert len(fake_llm.requests) == 1


# -- the configuration --------------------------------------------------------------------


def load_toml(tmp_path: Path, text: str) -> LoopWorkerConfig:
    path = tmp_path / "loopmesh.toml"
    path.write_text(text)
    return load(LoopWorkerConfig, path, env={})


def test_limits_load_from_toml(tmp_path):
    config = load_toml(
        tmp_path,
        """
[llm.limits.models."gpt-4o-mini"]
rpm = 500
tpm = 200_000
tenant_tpm = 50_000
[llm.limits.models."gpt-4o-mini".tenants.acme]
tpm = 100_000
""",
    )
    m = config.llm.limits.models["gpt-4o-mini"]
    assert (m.rpm, m.tpm, m.window_s) == (500, 200_000, 60.0)
    assert m.tenant("acme") == (0, 100_000) and m.tenant("other") == (0, 50_000)


def test_limits_load_from_an_environment_variable():
    env = {"LOOPMESH_LLM__LIMITS": '{"models": {"m": {"tpm": 1000, "window_s": 10}}}'}
    config = load(LoopWorkerConfig, env=env)
    assert config.llm.limits.models["m"].per_window(1000) == 166


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ('[llm.limits.models."gpt-4o"]\ntpm = -5', '`$.llm.limits.models["gpt-4o"].tpm`'),
        ('[llm.limits.models."gpt-4o"]\nrpn = 5', '`$.llm.limits.models["gpt-4o"]`'),
        (
            "[llm.limits.models.m]\nrpm = 5\n[llm.limits.models.m.tenants.acme]\nrpm = -1",
            '`$.llm.limits.models["m"].tenants["acme"].rpm`',
        ),
        ('[llm.limits.models.m.tenants."a.b"]\nrpm = 1', "`key` in `$.llm.limits.models"),
        ("[llm.limits.models.m]\n", "`models.m` sets no limit"),
        ("[llm.limits.models.m]\nrpm = 5\nwindow_s = 6", "`models.m.rpm` (5) allows less than one"),
        ("[llm.limits.models.m]\nrpm = 5\ntenant_rpm = 6", "`models.m.tenant_rpm` (6) is above"),
        (
            "[llm.limits.models.m]\ntpm = 5\n[llm.limits.models.m.tenants.acme]\ntpm = 6",
            "`models.m.tenants.acme.tpm` (6) is above the model's tpm (5)",
        ),
        ("[llm.limits]\nmax_pause_s = 0", "`$.llm.limits.max_pause_s`"),
    ],
)
def test_a_bad_limit_is_refused_at_load_naming_the_field(tmp_path, text, named):
    with pytest.raises(ConfigError) as info:
        load_toml(tmp_path, text)
    assert named in str(info.value)
