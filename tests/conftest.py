"""Fixtures every test package shares: a real nats-server and a fake LLM per test."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client

from loopmesh.server import NatsServer
from loopmesh.testing.fake_llm import FakeLLM


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
