import logging

import httpx
import pytest

from loopmesh import nats as loopmesh_nats
from loopmesh.errors import NatsConnectError
from loopmesh.nats import connect
from loopmesh.server import NatsServer
from loopmesh.settings import NatsSettings
from loopmesh.testing.durable import wait_for


async def test_connect_uses_the_configured_url_and_client_name(nats_server):
    nc = await connect(NatsSettings(url=nats_server.url), name="loop-worker-1")
    try:
        assert nc.is_connected
        async with httpx.AsyncClient() as http:
            connz = (await http.get(f"{nats_server.monitor_url}/connz")).json()
        assert [c["name"] for c in connz["connections"]] == ["loop-worker-1"]
    finally:
        await nc.close()


async def test_a_first_connection_that_fails_raises_an_error_naming_the_url(nats_server):
    url = nats_server.url
    await nats_server.stop()
    with pytest.raises(NatsConnectError) as info:
        await connect(NatsSettings(url=url, connect_timeout_s=1, reconnect_wait_s=0.05))
    assert info.value.url == url
    assert url in str(info.value)


async def test_refused_credentials_are_the_error_and_the_password_is_not_shown(tmp_path):
    """The server answers a wrong password and closes the socket, so a second attempt may
    see only a reset: the refusal is still what the error says, and never the password."""
    async with NatsServer(tmp_path / "nats", extra_args=("--user", "u", "--pass", "right")) as s:
        wrong = s.url.replace("nats://", "nats://u:s3cret@")
        for _ in range(3):
            with pytest.raises(NatsConnectError) as info:
                await connect(NatsSettings(url=wrong, connect_timeout_s=2, reconnect_wait_s=0))
            assert "authorization violation" in str(info.value).lower()
            assert "s3cret" not in str(info.value) and "u:***@" in info.value.url


def test_shown_hides_passwords_and_tokens_in_every_url_of_a_list():
    shown = loopmesh_nats.shown
    assert shown("nats://a:pw@h1:4222, tls://tok@h2:4222,nats://h3") == (
        "nats://a:***@h1:4222,tls://***@h2:4222,nats://h3"
    )


async def test_connect_without_a_url_uses_the_local_default_that_up_serves(
    nats_server, monkeypatch
):
    monkeypatch.setattr(loopmesh_nats, "DEFAULT_URL", nats_server.url)
    nc = await connect(NatsSettings())
    try:
        assert nc.connected_url is not None
        assert nc.connected_url.port == nats_server.port
    finally:
        await nc.close()


async def test_the_client_keeps_reconnecting_until_the_server_is_back(nats_server, caplog):
    caplog.set_level(logging.INFO, logger="loopmesh.nats")
    nc = await connect(NatsSettings(url=nats_server.url, reconnect_wait_s=0.02))
    try:
        await nats_server.stop()
        await wait_for(lambda: not nc.is_connected, what="the disconnect")

        def failed_attempts() -> int:
            return sum("nats error" in r.getMessage() for r in caplog.records)

        # More failed attempts than a first connection is allowed: it did not give up.
        await wait_for(lambda: failed_attempts() >= 5, what="five failed reconnects")
        assert not nc.is_closed
        await nats_server.start()
        await wait_for(lambda: nc.is_connected, what="the reconnect")
        messages = [r.getMessage() for r in caplog.records]
        assert any(m.startswith("nats disconnected") for m in messages)
        await wait_for(
            lambda: any(r.getMessage().startswith("nats reconnected") for r in caplog.records),
            what="the reconnect log line",
        )
        await nc.flush(timeout=5)
    finally:
        await nc.close()
