"""Fixtures every test package shares: a real nats-server and a fake LLM per test."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import nats
import pytest
from hypothesis import HealthCheck, settings
from nats.aio.client import Client

from loopmesh.server import NatsServer
from loopmesh.testing.fake_llm import FakeLLM

# Fuzz tests without their own ``@settings`` run this many examples: modest in CI;
# ``pytest --hypothesis-profile=deep`` runs many more.
settings.register_profile(
    "ci", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("deep", max_examples=2_000, deadline=None)
settings.load_profile("ci")


@pytest.fixture
async def nats_server(tmp_path: Path) -> AsyncIterator[NatsServer]:
    """A fresh nats-server with JetStream on free ports and a temporary store."""
    async with NatsServer(tmp_path / "nats") as server:
        yield server


@pytest.fixture
async def nc(nats_server: NatsServer) -> AsyncIterator[Client]:
    """A client connected to :func:`nats_server`."""
    client = await nats.connect(nats_server.url)
    try:
        yield client
    finally:
        await client.close()


@pytest.fixture
async def fake_llm() -> AsyncIterator[FakeLLM]:
    """A fake OpenAI-compatible server on a free loopback port; script it per test."""
    async with FakeLLM() as server:
        yield server
