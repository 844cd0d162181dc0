"""Which LLM `loopmesh up` uses, and that it says so: the one configured for loopmesh
(``[llm]``, ``LOOPMESH_LLM__*``), else the embedded demo model, whatever variables of
other tools (OPENAI_API_KEY, OPENAI_BASE_URL) the shell has."""

import pytest

from loop_worker.cli import needs_embedded_llm
from loop_worker.config import LoopWorkerConfig
from loop_worker.engine.llm import OpenAILLM
from loop_worker.engine.settings import LLMSettings
from loopmesh.settings import load
from loopmesh.testing.fake_llm import FakeLLM
from loopmesh.testing.fake_replies import auto
from schemas import ChatMessage
from tests.e2e.test_up_run import stop_and_check_nothing_left, up

OPENAI_ENV = {"OPENAI_API_KEY": "sk-from-the-shell", "OPENAI_BASE_URL": "http://127.0.0.1:9/v1"}


@pytest.mark.parametrize(
    ("env", "embedded"),
    [
        ({}, True),
        (OPENAI_ENV, True),
        ({**OPENAI_ENV, "LOOPMESH_LLM__MODEL": "gpt-4.1"}, False),
        ({"LOOPMESH_LLM__BASE_URL": "http://127.0.0.1:8000/v1"}, False),
        ({"LOOPMESH_LLM__API_KEY": "sk-for-loopmesh"}, False),
    ],
)
def test_only_loopmesh_settings_choose_an_llm_over_the_demo_model(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], embedded: bool
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert needs_embedded_llm(load(LoopWorkerConfig, None)) is embedded


async def test_a_configured_llm_without_a_key_of_its_own_sends_openai_api_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What the Kubernetes manifests rely on: the Secret's key as OPENAI_API_KEY."""
    async with FakeLLM(default=auto()) as llm:
        settings = LLMSettings(base_url=llm.base_url, model="fake-model")
        monkeypatch.setenv("OPENAI_API_KEY", "sk-from-the-secret")
        async with OpenAILLM(settings) as client:
            await client.complete([ChatMessage(role="user", content="hi")])
        monkeypatch.delenv("OPENAI_API_KEY")
        async with OpenAILLM(settings) as client:
            await client.complete([ChatMessage(role="user", content="hi")])
    assert llm.keys == [
        "Bearer sk-from-the-secret",
        "Bearer not-needed",
    ]


@pytest.mark.slow
async def test_up_with_openai_variables_in_the_shell_runs_the_demo_model(tmp_path):
    proc, _ = await up(tmp_path, **OPENAI_ENV)
    try:
        line = await proc.wait_line("llm       ")
        # the demo model: starting, or not installed and saying how to install it
        assert "embedded" in line, line
        assert "127.0.0.1:9" not in proc.output() and "OpenAI" not in proc.output()
    finally:
        await stop_and_check_nothing_left(proc)


@pytest.mark.slow
async def test_up_says_which_configured_llm_it_uses(tmp_path):
    async with FakeLLM(default=auto()) as llm:
        proc, _ = await up(
            tmp_path,
            LOOPMESH_LLM__BASE_URL=llm.base_url,
            LOOPMESH_LLM__MODEL="fake-model",
            **OPENAI_ENV,
        )
        try:
            line = await proc.wait_line("llm       ")
            assert line == f"llm       {llm.base_url} · model fake-model"
        finally:
            await stop_and_check_nothing_left(proc)
