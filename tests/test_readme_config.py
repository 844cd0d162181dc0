"""The configuration examples (docs/CONFIGURATION.md's whole one, the README's
essentials) are files every service accepts, with the values they show."""

from __future__ import annotations

import re
from pathlib import Path

from loop_worker.config import LoopWorkerConfig
from loopmesh.settings import load

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
CONFIGURATION = ROOT / "docs" / "CONFIGURATION.md"


def example(doc: Path, tmp_path: Path) -> Path:
    """The first TOML block of ``doc``'s configuration section, as a file."""
    section = doc.read_text().split("Configuration", 1)[1]
    block = re.search(r"```toml\n(.*?)```", section, re.DOTALL)
    assert block is not None
    path = tmp_path / "loopmesh.toml"
    path.write_text(block.group(1))
    return path


def readme_config(tmp_path: Path) -> LoopWorkerConfig:
    """docs/CONFIGURATION.md's example, loaded as a loop worker loads its file."""
    path = example(CONFIGURATION, tmp_path)
    return load(LoopWorkerConfig, path, env={})


def test_the_readme_essentials_load(tmp_path: Path) -> None:
    config = load(LoopWorkerConfig, example(README, tmp_path), env={})
    assert config.llm.model == "gpt-4o-mini" and config.loop.budget.turn_tokens == 200_000
    assert config.loop.approval_tools == ("local.fs_write",)


def test_the_configuration_example_loads(tmp_path: Path) -> None:
    config = readme_config(tmp_path)
    assert config.loop.reply_reserve_tokens == 1000
    assert config.loop.prefilter.enabled and config.loop.prefilter.top_k == 8
    assert config.loop.retriever is None  # shown commented out: it names no real module
    assert config.loop.prefilter.embeddings_base_url is None  # BM25
    # the orchestrator and the per-turn limits are shown, with values a service accepts
    loop = config.loop
    assert (loop.mode, loop.planner_model, loop.executor_model) == ("loop", "gpt-4o", "gpt-4o-mini")
    assert (loop.plan_max_steps, loop.step_max_iterations, loop.step_retries) == (8, 6, 1)
    assert (loop.deadline_s, loop.max_tool_calls, loop.max_parallel_tools) == (120, 30, 8)
    assert (loop.tool_failure, loop.max_iterations) == ("continue", 20)
    # the fleet's rate limits ([llm.limits], docs/ARCHITECTURE.md)
    limits = config.llm.limits.models["gpt-4o-mini"]
    assert (limits.rpm, limits.tpm, limits.tenant("acme")) == (5000, 2_000_000, (0, 500_000))
    # a named agent, as docs/AGENTS.md defines one
    (calc,) = config.agents
    assert (calc.name, calc.tools) == ("calc", ("local.calculator",))


def test_the_readme_shows_budgets_and_prices(tmp_path: Path) -> None:
    config = readme_config(tmp_path)
    assert config.loop.budget.turn_tokens == 200_000
    assert config.loop.budget.tenant_daily_cost == 50.0
    assert config.prices["gpt-4o-mini"].of(1_000_000, 1_000_000) == 0.75
    assert (config.loop.on_busy, config.loop.stream_flush_ms) == ("enqueue", 50)


def test_the_configuration_example_caps_schedules(tmp_path: Path) -> None:
    config = readme_config(tmp_path)
    assert config.scheduler.enabled and config.scheduler.max_per_tenant == 100
