"""docs/CONFIGURATION.md lists every setting as the code defines it: the reference is
what ``python -m docs.settings_doc`` writes, every key has a description, every command's
configuration is in it, and the example names tools that exist."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import msgspec

from docs import settings_doc
from loop_worker.config import LoopWorkerConfig
from loopmesh.settings import NatsSettings, load
from tests.test_readme_config import CONFIGURATION, ROOT, example
from tool_worker.cli import build
from tool_worker.config import ToolWorkerConfig, ToolWorkerSettings

SOURCES = ("loopmesh", "loop_worker", "tool_worker", "gateway", "webhooks", "nats_agents")
#: A command's configuration: what ``config_from_args`` or ``load`` is given.
_READ = re.compile(r"\b(?:config_from_args|load)\(\s*([A-Z]\w*Config)\b")


def test_the_reference_is_what_the_generator_writes() -> None:
    text = CONFIGURATION.read_text()
    assert settings_doc.render(text) == text, (
        f"docs/CONFIGURATION.md is stale: run `{settings_doc.COMMAND}`"
    )


def test_every_setting_has_a_description() -> None:
    assert settings_doc.missing() == [], (
        f"write a `#:` comment above each of these fields, then run `{settings_doc.COMMAND}`"
    )


def test_every_command_configuration_is_documented() -> None:
    read = {
        name
        for package in SOURCES
        for path in (ROOT / package).rglob("*.py")
        for name in _READ.findall(path.read_text())
    }
    listed = {config.__name__ for config, _ in settings_doc.CONFIGS}
    assert read and read <= listed, f"add to settings_doc.CONFIGS: {sorted(read - listed)}"


def test_every_key_of_every_table_is_a_row() -> None:
    """Each Struct field is a row of its table, or a table of its own: none is left out."""
    sections = settings_doc.walk(settings_doc.sections())
    for section in sections:
        fields = {f.encode_name for f in msgspec.structs.fields(section.struct)}
        rows = {row.key for row in settings_doc.rows(section)}
        assert rows | section.tables == fields, section.header
    text = CONFIGURATION.read_text()
    reference = text[text.index(settings_doc.BEGIN) : text.index(settings_doc.END)]
    documented = sum(len(settings_doc.rows(s)) for s in sections)
    assert reference.count("\n| `") == documented > 200


def test_a_documented_variable_sets_its_key() -> None:
    variables = {
        "LOOPMESH_LOOP__TOOL_TIMEOUT_S": "12",
        "LOOPMESH_LLM__MAX_RETRIES": "1",
        "LOOPMESH_LOOP_WORKER__LEASE_TTL_S": "7",
        "LOOPMESH_LOOP__BUDGET": '{"turn_tokens": 5}',
    }
    config = load(LoopWorkerConfig, env=variables)
    assert (config.loop.tool_timeout_s, config.llm.max_retries) == (12, 1)
    assert (config.loop_worker.lease_ttl_s, config.loop.budget.turn_tokens) == (7, 5)
    text = CONFIGURATION.read_text()
    assert all(f"`{var}`" in text for var in variables)


def test_a_type_shows_its_range_and_a_default_its_toml() -> None:
    def field(struct: type, name: str) -> settings_doc.mi.Field:
        (found,) = [f for f in settings_doc.fields_of(struct) if f.name == name]
        return found

    concurrency = field(ToolWorkerSettings, "concurrency").type
    assert settings_doc.type_name(concurrency) == "int ≥ 1, ≤ 100000"
    assert settings_doc.type_name(field(NatsSettings, "connect_timeout_s").type) == "float > 0"
    assert settings_doc.default(field(ToolWorkerSettings, "builtins")) == (
        '`["calculator", "current_time", "http_fetch"]`'
    )
    assert settings_doc.default(field(NatsSettings, "url")) == "unset"


def test_the_example_names_tools_that_exist(tmp_path: Path) -> None:
    """Every ``local.<tool>`` (or ``local__<tool>``) the page names, in its example or
    its prose, commented out or not, is a tool the example's tool worker serves."""
    config = load(ToolWorkerConfig, example(CONFIGURATION, tmp_path), env={})
    fs_root = tmp_path / "files"
    fs_root.mkdir()
    settings = msgspec.structs.replace(config.tool_worker, fs_root=str(fs_root))
    registry, _ = build(settings)
    served = {f"{t.server}.{t.name}" for t in registry}
    text = CONFIGURATION.read_text()
    named = {f"local.{n}" for n in re.findall(r"\blocal(?:\.|__)([A-Za-z0-9_-]+)", text)}
    assert named and named <= served, sorted(named - served)


def test_the_example_uncommented_still_loads(tmp_path: Path) -> None:
    """The keys shown commented out in the example are keys the services know."""
    block = example(CONFIGURATION, tmp_path).read_text()
    # (not the TLS files: a service refuses a file it cannot read)
    lines = [re.sub(r"^# (?!tls_)(\w+ = )", r"\1", line) for line in block.splitlines()]
    data = tomllib.loads("\n".join(lines))
    assert data["loop"]["tools"] == ["local.fs_read", "local.current_time"]
    path = tmp_path / "uncommented.toml"
    path.write_text("\n".join(lines))
    assert load(LoopWorkerConfig, path, env={}).loop.retriever == "mysearch.kb:search"
