"""Every numeric setting of every service has a range, checked when the file is loaded."""

from __future__ import annotations

from typing import Any

import msgspec
import msgspec.inspect as mi
import pytest

from gateway.settings import GatewayConfig
from loop_worker.config import LoopWorkerConfig
from loopmesh.settings import RuntimeConfig
from nats_agents.settings import NatsAgentsConfig
from tool_worker.config import ToolWorkerConfig

CONFIGS = [LoopWorkerConfig, ToolWorkerConfig, RuntimeConfig, GatewayConfig, NatsAgentsConfig]


def numeric_fields(info: mi.Type, path: str = "$") -> list[tuple[str, mi.Type]]:
    """Each int or float found in a settings type, with its path."""
    match info:
        case mi.IntType() | mi.FloatType():
            return [(path, info)]
        case mi.UnionType(types=types):
            return [f for t in types for f in numeric_fields(t, path)]
        case mi.StructType(fields=fields):
            return [f for fd in fields for f in numeric_fields(fd.type, f"{path}.{fd.name}")]
        case mi.VarTupleType(item_type=item) | mi.ListType(item_type=item):
            return numeric_fields(item, f"{path}[]")
        case mi.DictType(value_type=value):
            return numeric_fields(value, f"{path}{{}}")
    return []


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.__name__)
def test_every_numeric_setting_has_a_lower_bound(config: Any) -> None:
    fields = numeric_fields(mi.type_info(config))
    unbounded = [path for path, t in fields if t.ge is None and t.gt is None]
    assert fields or config is RuntimeConfig
    assert unbounded == []


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.__name__)
def test_the_defaults_are_within_the_ranges(config: Any) -> None:
    assert msgspec.convert(msgspec.to_builtins(config()), config) == config()
