"""NATS over TLS against a real nats-server that requires client certificates (mutual
TLS), with certificates made by trustme: what connects, what is refused and how the
refusal reads, that nothing falls back to plaintext, and renewed certificates."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import httpx
import msgspec
import pytest
from nats.aio.msg import Msg

from loopmesh import nats as loopmesh_nats
from loopmesh.errors import ConfigError, NatsTlsError
from loopmesh.nats import connect
from loopmesh.ports import free_ports
from loopmesh.server import NatsServer
from loopmesh.settings import NatsSettings
from loopmesh.testing.durable import wait_for
from tests.certs import Certs, make_certs


async def _connz(server: NatsServer, state: str = "open") -> list[dict[str, object]]:
    async with httpx.AsyncClient() as http:
        r = await http.get(f"{server.monitor_url}/connz", params={"state": state})
    connections: list[dict[str, object]] = r.json()["connections"] or []
    return connections


async def test_a_client_with_its_certificate_connects_over_mutual_tls(mtls_server, certs):
    nc = await connect(certs.settings(mtls_server.url), name="tls-client")
    try:

        async def greet(msg: Msg) -> None:
            await msg.respond(b"hi " + msg.data)

        sub = await nc.subscribe("greet", cb=greet)
        assert (await nc.request("greet", b"tls", timeout=5)).data == b"hi tls"
        await sub.unsubscribe()
        (conn,) = [c for c in await _connz(mtls_server) if c["name"] == "tls-client"]
        assert str(conn["tls_version"]).startswith("1.")  # the server saw TLS
    finally:
        await nc.close()


async def test_a_client_without_a_certificate_is_refused_saying_what_to_set(mtls_server, certs):
    with pytest.raises(NatsTlsError) as info:
        await connect(certs.settings(mtls_server.url, client_cert=False))
    message = str(info.value)
    assert info.value.url == mtls_server.url
    assert "requires a client certificate" in message
    assert "tls_cert_file" in message and "LOOPMESH_NATS__TLS_KEY_FILE" in message


async def test_a_server_certificate_that_does_not_verify_is_refused_naming_the_ca_file(
    mtls_server, certs, tmp_path
):
    other = make_certs(tmp_path / "other")
    settings = msgspec.structs.replace(certs.settings(mtls_server.url), tls_ca_file=str(other.ca))
    with pytest.raises(NatsTlsError) as info:
        await connect(settings)
    message = str(info.value)
    assert f"does not verify against [nats] tls_ca_file ({other.ca})" in message
    assert "LOOPMESH_NATS__TLS_CA_FILE" in message


async def test_without_a_ca_file_the_system_cas_do_not_trust_a_private_ca(mtls_server, certs):
    settings = msgspec.structs.replace(certs.settings(mtls_server.url), tls_ca_file=None)
    with pytest.raises(NatsTlsError, match=r"the system's CAs \(\[nats\] tls_ca_file is not set"):
        await connect(settings)


async def test_a_client_certificate_the_server_does_not_trust_is_refused(
    mtls_server, certs, tmp_path
):
    other = make_certs(tmp_path / "other")
    settings = msgspec.structs.replace(
        certs.settings(mtls_server.url),
        tls_cert_file=str(other.client_cert),
        tls_key_file=str(other.client_key),
    )
    with pytest.raises(NatsTlsError) as info:
        await connect(settings)
    assert f"refused the client certificate [nats] tls_cert_file ({other.client_cert})" in str(
        info.value
    )


async def test_a_server_whose_certificate_is_for_another_host_is_refused(tmp_path):
    certs = make_certs(tmp_path / "certs", server_names=("nats.example.com",))
    async with NatsServer(tmp_path / "nats", tls=certs.server_tls()) as server:
        with pytest.raises(NatsTlsError, match="not for the host connected to"):
            await connect(certs.settings(server.url))


@pytest.mark.parametrize("asked_by", ["tls_url", "ca_file"])
async def test_tls_asked_for_never_falls_back_to_plaintext(nats_server, certs, asked_by):
    """nats-py alone goes on in plaintext with a tls:// server that does not require TLS;
    loopmesh refuses before it sends anything (no CONNECT: the server never learns the
    client's name)."""
    if asked_by == "tls_url":
        settings = NatsSettings(url=nats_server.url.replace("nats://", "tls://"))
    else:
        settings = certs.settings(nats_server.url)  # nats://, with [nats] tls_ca_file
    with pytest.raises(NatsTlsError) as info:
        await connect(settings, name="must-not-connect")
    assert "does not require TLS" in str(info.value)
    assert "never falls back to plaintext" in str(info.value)
    names = [c.get("name") for c in await _connz(nats_server, "all")]
    assert "must-not-connect" not in names


async def test_tls_is_refused_if_nats_py_stops_showing_the_server_info(
    mtls_server, certs, monkeypatch
):
    """The check rests on nats-py calling ``_process_info`` before the CONNECT; a nats-py
    that no longer does makes every TLS connection fail, never pass unchecked."""
    monkeypatch.setattr(loopmesh_nats._Client, "_process_info", loopmesh_nats.Client._process_info)
    with pytest.raises(NatsTlsError, match="cannot tell whether TLS was used"):
        await connect(certs.settings(mtls_server.url))


async def test_a_file_that_holds_no_certificate_is_an_error_naming_the_field(certs, tmp_path):
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    with pytest.raises(ConfigError, match=r"\[nats\] tls_ca_file: .*junk.pem is not a PEM CA"):
        await connect(
            msgspec.structs.replace(certs.settings("tls://127.0.0.1:1"), tls_ca_file=str(junk))
        )
    mismatched = msgspec.structs.replace(
        certs.settings("tls://127.0.0.1:1"), tls_key_file=str(certs.server_key)
    )
    with pytest.raises(ConfigError, match=r"tls_cert_file, tls_key_file.*its private key"):
        await connect(mismatched)


async def test_a_renewed_certificate_is_read_again_before_the_next_reconnect(
    tmp_path: Path, caplog
):
    """cert-manager renews a Secret's files in place. Here everything is replaced by a new
    CA's certificates and the server restarted trusting only that CA: the client gets
    back in only by reading the new files."""
    caplog.set_level(logging.INFO, logger="loopmesh.nats")
    certs = make_certs(tmp_path / "certs")
    port, monitor_port = free_ports(2)
    server = NatsServer(
        tmp_path / "nats", port=port, monitor_port=monitor_port, tls=certs.server_tls()
    )
    async with server:
        nc = await connect(certs.settings(server.url))
        try:
            await server.stop()
            renewed: Certs = make_certs(tmp_path / "certs")  # the same paths, a new CA
            assert renewed == certs
            await server.start()
            await wait_for(lambda: nc.is_connected, timeout=20, what="the reconnect")
            await nc.flush(timeout=5)
            assert any("tls files changed" in r.getMessage() for r in caplog.records)
        finally:
            await nc.close()


async def test_reconnects_refused_by_tls_are_logged_in_words_and_close_still_returns(
    tmp_path: Path, certs: Certs, caplog
):
    """The server comes back with a certificate from another CA: each reconnect is
    refused, the log says what to set, and closing the client does not hang (nats-py
    2.16 would, nats-io/nats.py#718)."""
    caplog.set_level(logging.INFO, logger="loopmesh.nats")
    port, monitor_port = free_ports(2)
    server = NatsServer(
        tmp_path / "nats", port=port, monitor_port=monitor_port, tls=certs.server_tls()
    )
    async with server:
        settings = msgspec.structs.replace(certs.settings(server.url), connect_timeout_s=1)
        nc = await connect(settings)
        try:
            await server.stop()
            server.tls = make_certs(tmp_path / "other").server_tls()
            await server.start()

            def refused() -> bool:
                return any("does not verify" in r.getMessage() for r in caplog.records)

            await wait_for(refused, what="a reconnect refused by TLS")
            assert not nc.is_connected
        finally:
            await asyncio.wait_for(nc.close(), 30)
        assert any("nats close gave up" in r.getMessage() for r in caplog.records)
