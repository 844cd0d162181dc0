"""``[nats_agents]``: the documented example loads, and a bad value names its field."""

from __future__ import annotations

from pathlib import Path

import pytest

from loopmesh.errors import ConfigError
from loopmesh.settings import load
from nats_agents.settings import NatsAgentsConfig
from tests.test_readme_config import CONFIGURATION, example


def test_the_configuration_example_sets_the_tenant_and_the_limits(tmp_path: Path):
    settings = load(NatsAgentsConfig, example(CONFIGURATION, tmp_path), env={}).nats_agents
    assert (settings.tenant, settings.max_concurrent_prompts) == ("acme", 64)
    assert (settings.turn_timeout_s, settings.heartbeat_s, settings.drain_s) == (600, 30, 10)


def test_the_tenant_is_unset_unless_configured_and_must_be_a_token():
    assert load(NatsAgentsConfig, env={}).nats_agents.tenant is None
    env = {"LOOPMESH_NATS_AGENTS__TENANT": "ac.me"}
    with pytest.raises(ConfigError, match=r"LOOPMESH_NATS_AGENTS__TENANT.*nats_agents.tenant"):
        load(NatsAgentsConfig, env=env)


def test_no_metrics_port_unless_configured_and_a_bad_one_is_refused():
    settings = load(NatsAgentsConfig, env={}).nats_agents
    assert (settings.metrics_host, settings.metrics_port) == ("127.0.0.1", None)
    env = {"LOOPMESH_NATS_AGENTS__METRICS_PORT": "70000"}
    with pytest.raises(ConfigError, match=r"nats_agents.metrics_port"):
        load(NatsAgentsConfig, env=env)
