from pathlib import Path
from typing import Literal

import msgspec
import pytest

from loopmesh.errors import ConfigError
from loopmesh.settings import NatsSettings, env_var, load


class Loop(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    max_iterations: int = 20
    timeout_s: float = 60.0
    summarize: bool = True
    hooks: tuple[str, ...] = ()
    tool_format: Literal["native", "text"] = "native"
    model: str | None = None


class Config(msgspec.Struct, frozen=True, kw_only=True):
    nats: NatsSettings = NatsSettings()
    loop: Loop = Loop()


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "loopmesh.toml"
    path.write_text(text)
    return path


def test_without_a_file_or_variables_every_default_holds():
    assert load(Config, env={}) == Config()


def test_a_file_sets_fields_and_tables_of_other_services_are_ignored(tmp_path):
    path = write(
        tmp_path,
        """
        [nats]
        url = "nats://example:4222"
        [loop]
        max_iterations = 5
        hooks = ["a.b:c"]
        [gateway]
        port = 8080
        """,
    )
    config = load(Config, path, env={})
    assert config.nats.url == "nats://example:4222"
    assert config.loop == Loop(max_iterations=5, hooks=("a.b:c",))


def test_the_file_named_by_loopmesh_config_is_read(tmp_path):
    path = write(tmp_path, "[loop]\nmax_iterations = 7\n")
    assert load(Config, env={"LOOPMESH_CONFIG": str(path)}).loop.max_iterations == 7


def test_a_field_of_the_wrong_type_names_the_file_the_field_and_the_expected_type(tmp_path):
    path = write(tmp_path, '[loop]\nmax_iterations = "many"\n')
    with pytest.raises(ConfigError) as info:
        load(Config, path, env={})
    message = str(info.value)
    assert str(path) in message
    assert "$.loop.max_iterations" in message
    assert "Expected `int`" in message
    assert info.value.source == str(path)


def test_an_unknown_field_in_a_known_table_is_an_error(tmp_path):
    path = write(tmp_path, "[loop]\nmax_iteration = 3\n")
    with pytest.raises(ConfigError, match="max_iteration"):
        load(Config, path, env={})


def test_a_missing_file_or_invalid_toml_names_the_file(tmp_path):
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match=r"nope\.toml"):
        load(Config, missing, env={})
    broken = write(tmp_path, "[loop\n")
    with pytest.raises(ConfigError, match="not valid TOML") as info:
        load(Config, broken, env={})
    assert info.value.source == str(broken)


def test_environment_variables_override_the_file_with_converted_values(tmp_path):
    path = write(tmp_path, "[loop]\nmax_iterations = 5\nsummarize = true\n")
    env = {
        "LOOPMESH_LOOP__MAX_ITERATIONS": "9",
        "LOOPMESH_LOOP__TIMEOUT_S": "2.5",
        "LOOPMESH_LOOP__SUMMARIZE": "false",
        "LOOPMESH_LOOP__HOOKS": "a:b, c:d",
        "LOOPMESH_LOOP__TOOL_FORMAT": "text",
        "LOOPMESH_NATS__URL": "nats://other:4222",
    }
    config = load(Config, path, env=env)
    assert config.loop == Loop(
        max_iterations=9, timeout_s=2.5, summarize=False, hooks=("a:b", "c:d"), tool_format="text"
    )
    assert config.nats.url == "nats://other:4222"


def test_a_sequence_variable_may_be_a_json_list():
    config = load(Config, env={"LOOPMESH_LOOP__HOOKS": '["x:y", "a,b:c"]'})
    assert config.loop.hooks == ("x:y", "a,b:c")


def test_a_bad_variable_value_names_the_variable_and_the_expected_type():
    with pytest.raises(ConfigError) as info:
        load(Config, env={"LOOPMESH_LOOP__MAX_ITERATIONS": "lots"})
    assert info.value.source == "LOOPMESH_LOOP__MAX_ITERATIONS"
    assert "Expected `int`" in str(info.value)
    assert "loop.max_iterations" in str(info.value)


def test_a_variable_for_an_unknown_field_of_a_known_table_names_the_variable():
    with pytest.raises(ConfigError) as info:
        load(Config, env={"LOOPMESH_LOOP__MAX_ITERATION": "3"})
    assert info.value.source == "LOOPMESH_LOOP__MAX_ITERATION"
    assert "max_iterations" in str(info.value)  # the known fields are listed


def test_variables_for_tables_the_service_does_not_have_are_ignored():
    config = load(Config, env={"LOOPMESH_GATEWAY__PORT": "x", "LOOPMESH_SOMETHING": "y"})
    assert config == Config()


def test_a_service_reading_part_of_a_shared_table_ignores_the_fields_it_does_not_read():
    """The gateway reads only ``[loop] on_busy``: ``loopmesh up`` hands every service the
    same environment, so the loop worker's other ``[loop]`` variables reach it too."""
    from gateway.settings import GatewayConfig

    env = {"LOOPMESH_LOOP__MAX_ITERATIONS": "4", "LOOPMESH_LOOP__ON_BUSY": "reject"}
    assert load(GatewayConfig, env=env).loop.on_busy == "reject"
    with pytest.raises(ConfigError, match=r"loop\.on_busy.*Invalid enum value 'later'"):
        load(GatewayConfig, env={"LOOPMESH_LOOP__ON_BUSY": "later"})


def test_env_var_names_the_variable_of_a_field():
    assert env_var("llm", "base_url") == "LOOPMESH_LLM__BASE_URL"
    assert load(Config, env={env_var("loop", "model"): "m1"}).loop.model == "m1"


def test_a_nats_prefix_that_is_not_a_subject_token_is_refused(tmp_path):
    path = write(tmp_path, '[nats]\nprefix = "a.b"\n')
    with pytest.raises(ConfigError, match=r"\$\.nats\.prefix"):
        load(Config, path, env={})
    with pytest.raises(ConfigError, match="LOOPMESH_NATS__PREFIX"):
        load(Config, env={"LOOPMESH_NATS__PREFIX": "*"})


def test_tls_files_are_set_by_variables_like_the_other_fields(certs):
    config = load(Config, env=certs.env())
    assert config.nats.tls_ca_file == str(certs.ca)
    assert config.nats.tls_cert_file == str(certs.client_cert)
    assert config.nats.tls_key_file == str(certs.client_key)


def test_a_tls_file_that_cannot_be_read_is_refused_at_load_naming_the_field(tmp_path, certs):
    missing = tmp_path / "nope.crt"
    with pytest.raises(ConfigError) as info:
        load(Config, env={"LOOPMESH_NATS__TLS_CA_FILE": str(missing)})
    assert info.value.source == "environment (LOOPMESH_NATS__TLS_CA_FILE)"
    assert f"`tls_ca_file`: cannot read {missing}: No such file or directory" in str(info.value)
    path = write(tmp_path, f'[nats]\ntls_key_file = "{tmp_path}"\ntls_cert_file = "{certs.ca}"\n')
    with pytest.raises(ConfigError, match=r"`tls_key_file`: cannot read .*: Is a directory"):
        load(Config, path, env={})


@pytest.mark.parametrize("given", ["tls_cert_file", "tls_key_file"])
def test_a_client_certificate_without_its_key_or_a_key_without_its_certificate_is_refused(
    given, certs
):
    missing = {"tls_cert_file": "tls_key_file", "tls_key_file": "tls_cert_file"}[given]
    with pytest.raises(ConfigError, match=f"`{given}` is set without `{missing}`"):
        load(Config, env={env_var("nats", given): str(certs.client_cert)})


@pytest.mark.parametrize("var", ["LOOPMESH_PRICES__GPT_4O", "LOOPMESH_AGENTS__CALC"])
def test_a_variable_for_a_table_read_from_the_file_only_is_refused(var):
    """``[prices."<model>"]`` and ``[[agents]]`` have no variables: one set is an error
    naming it, not a setting silently dropped."""
    from loop_worker.config import LoopWorkerConfig

    with pytest.raises(ConfigError, match="read from the config file only") as info:
        load(LoopWorkerConfig, env={var: '{"prompt": 1.0}'})
    assert info.value.source == var
