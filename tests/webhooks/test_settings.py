"""``[webhooks]``: secrets checked as they load (the message names the field, never the
secret), per-tenant secrets from the environment, and agents' webhook URLs checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loop_worker.config import LoopWorkerConfig
from loopmesh.errors import ConfigError
from loopmesh.settings import load
from loopmesh.webhook import new_secret
from schemas.streams import WEBHOOKS_ACK_WAIT_S
from webhooks.cli import WebhooksConfig
from webhooks.service import LOOKUP_MARGIN_S

from .conftest import DOCS


def test_secrets_come_from_the_environment_per_tenant() -> None:
    default, acme = new_secret(), new_secret()
    env = {
        "LOOPMESH_WEBHOOKS__SECRET": default,
        "LOOPMESH_WEBHOOKS__TENANT_SECRETS": json.dumps({"acme": acme}),
    }
    settings = load(WebhooksConfig, env=env).webhooks
    assert settings.secret_for("acme") == acme and settings.secret_for("globex") == default
    assert load(WebhooksConfig, env={}).webhooks.secret_for("acme") is None  # none: fail closed


@pytest.mark.parametrize(
    ("env", "said"),
    [
        ({"LOOPMESH_WEBHOOKS__SECRET": "hunter2hunter2hunter2hunter2"}, "`webhooks.secret`"),
        ({"LOOPMESH_WEBHOOKS__SECRET": "whsec_c2hvcnQ="}, "it holds 5 bytes"),
        (
            {"LOOPMESH_WEBHOOKS__TENANT_SECRETS": '{"acme": "whsec_!!not base64!!"}'},
            "`webhooks.tenant_secrets.acme`",
        ),
        (
            {"LOOPMESH_WEBHOOKS__TENANT_SECRETS": json.dumps({"a.b": new_secret()})},
            "'a.b' is not a tenant id",
        ),
        ({"LOOPMESH_WEBHOOKS__ALLOWLIST": "http://x"}, "`webhooks.allowlist` entry"),
    ],
)
def test_a_bad_setting_is_refused_naming_the_field_not_the_secret(
    env: dict[str, str], said: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        load(WebhooksConfig, env=env)
    assert said in str(refused.value)
    for value in env.values():
        if "whsec_" in value or "hunter2" in value:
            assert value not in str(refused.value)


def test_an_agents_webhook_url_is_checked_when_the_configuration_loads(tmp_path: Path) -> None:
    path = tmp_path / "loopmesh.toml"
    path.write_text('[[agents]]\nname = "hooked"\nwebhook = { url = "http://hooks.example/x" }\n')
    with pytest.raises(ConfigError, match=r"`agents\[0\]\.webhook\.url` must be https"):
        load(LoopWorkerConfig, path, env={})
    config = load(LoopWorkerConfig, path, env={"LOOPMESH_WEBHOOKS__ALLOW_HTTP": "true"})
    assert config.agents[0].webhook is not None
    path.write_text('[[agents]]\nname = "x"\nwebhook = { url = "https://h/x", event = [] }\n')
    with pytest.raises(ConfigError, match="unknown field `event`"):  # misspelt: refused
        load(LoopWorkerConfig, path, env={})


def test_the_documented_promises_name_the_waits_the_service_uses() -> None:
    promises = DOCS.read_text().split("## What the service promises", 1)[1].split("\n## ")[0]
    text = " ".join(promises.split())
    assert f"the consumer's AckWait ({WEBHOOKS_ACK_WAIT_S:g} s)" in text
    assert f"up to the consumer's AckWait and {LOOKUP_MARGIN_S:g} s" in text
