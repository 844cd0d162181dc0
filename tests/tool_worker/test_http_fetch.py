"""``http_fetch`` fails closed: non-public addresses are refused unless the allowlist names
them, after resolution, with the checked address pinned.

No test here sends a packet to a non-loopback address: names are answered by a scripted
resolver, and every connection goes through a transport that fails the test when it is
asked for anything but loopback (or, for refused targets, when it is asked at all).
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import ssl
from collections.abc import AsyncIterator, Sequence

import httpx
import msgspec
import pytest
import trustme
from nats.aio.client import Client
from nats.js import JetStreamContext

from loopmesh.egress import Allowlist, refusal
from loopmesh.server import NatsServer
from tool_worker import Registry
from tool_worker.builtins import http_fetch_tool
from tool_worker.errors import Rejected, ToolError

from .harness import Requester, WorkerProcess, running


class Resolver:
    """Answers from a table, records the names asked; a name not in the table fails the test."""

    def __init__(self, answers: dict[str, Sequence[Sequence[str]]]) -> None:
        self.answers = {name: list(replies) for name, replies in answers.items()}
        self.asked: list[str] = []

    async def __call__(self, host: str, port: int) -> Sequence[str]:
        self.asked.append(host)
        assert host in self.answers, f"the test did not expect {host!r} to be resolved"
        replies = self.answers[host]
        return replies.pop(0) if len(replies) > 1 else replies[0]


class Tripwire(httpx.AsyncBaseTransport):
    """A transport that records what it is asked and connects nowhere."""

    def __init__(self) -> None:
        self.requests: list[httpx.Request] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        raise httpx.ConnectError("tripwire: no connection", request=request)


class LoopbackOnly(httpx.AsyncBaseTransport):
    """A real transport that fails the test if asked to connect beyond loopback."""

    def __init__(self, verify: ssl.SSLContext | bool = True) -> None:
        self.real = httpx.AsyncHTTPTransport(verify=verify)
        self.requests: list[httpx.Request] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        address = ipaddress.ip_address(request.url.host)
        assert address.is_loopback, f"a connection to {address} was attempted"
        self.requests.append(request)
        return await self.real.handle_async_request(request)

    async def aclose(self) -> None:
        await self.real.aclose()


class Site:
    """A loopback HTTP server that records the Host header of each request."""

    def __init__(self) -> None:
        self.hosts: list[str] = []
        self.port = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        for line in head.decode("latin-1").split("\r\n"):
            if line.lower().startswith("host:"):
                self.hosts.append(line.partition(":")[2].strip())
        if head.startswith(b"GET /redirect "):
            writer.write(
                b"HTTP/1.1 302 Found\r\nlocation: http://169.254.169.254/latest/\r\n"
                b"content-length: 0\r\nconnection: close\r\n\r\n"
            )
        else:
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 6\r\n"
                b"connection: close\r\n\r\ninside"
            )
        await writer.drain()
        writer.close()


@pytest.fixture
async def site() -> AsyncIterator[Site]:
    site = Site()
    server = await asyncio.start_server(site.handle, "127.0.0.1", 0)
    site.port = server.sockets[0].getsockname()[1]
    async with server:
        yield site


@pytest.fixture
def ca() -> trustme.CA:
    return trustme.CA()


async def tls_site(ca: trustme.CA, name: str) -> tuple[Site, asyncio.Server]:
    """A loopback HTTPS server whose certificate names only ``name``."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert(name).configure_cert(context)
    site = Site()
    server = await asyncio.start_server(site.handle, "127.0.0.1", 0, ssl=context)
    site.port = server.sockets[0].getsockname()[1]
    return site, server


REFUSED = [
    ("http://127.0.0.1/", "loopback"),
    ("http://10.0.0.1/", "private"),
    ("http://169.254.169.254/latest/meta-data/", "link-local"),
    ("http://[::1]:8222/varz", "loopback"),
    ("http://[fd00:ec2::254]/", "unique-local"),
    ("http://[::ffff:127.0.0.1]/", "loopback"),
    ("http://[64:ff9b::a9fe:a9fe]/", "link-local"),
    ("http://0.0.0.0:4222/", "unspecified"),
    ("http://224.0.0.1/", "multicast"),
    ("http://100.64.0.1/", "non-global"),
    ("https://192.168.1.1/", "private"),
]


@pytest.mark.parametrize(("url", "kind"), REFUSED)
async def test_non_public_addresses_are_refused_by_default_before_any_connection(
    url: str, kind: str
) -> None:
    resolver, wire = Resolver({}), Tripwire()
    fetch = http_fetch_tool(resolver=resolver, transport=wire)
    with pytest.raises(Rejected, match=f"a {kind} address") as refused:
        await fetch.invoke({"url": url})
    assert "http_allowlist" in str(refused.value)
    assert "LOOPMESH_TOOL_WORKER__HTTP_ALLOWLIST" in str(refused.value)
    assert wire.requests == [] and resolver.asked == []


async def test_a_name_that_resolves_to_loopback_is_refused_before_any_connection() -> None:
    resolver = Resolver(
        {"localtest.me": [["127.0.0.1"]], "mixed.example": [["93.184.215.14", "10.0.0.1"]]}
    )
    wire = Tripwire()
    fetch = http_fetch_tool(resolver=resolver, transport=wire)
    with pytest.raises(Rejected, match=re.escape("localtest.me resolves to 127.0.0.1, a loopback")):
        await fetch.invoke({"url": "http://localtest.me:4222/"})
    with pytest.raises(Rejected, match=re.escape("mixed.example resolves to 10.0.0.1, a private")):
        await fetch.invoke({"url": "https://mixed.example/"})
    assert wire.requests == []
    assert resolver.asked == ["localtest.me", "mixed.example"]


async def test_a_public_name_is_fetched_from_its_checked_address_with_its_name_kept() -> None:
    resolver, wire = Resolver({"example.org": [["93.184.215.14"]]}), Tripwire()
    fetch = http_fetch_tool(resolver=resolver, transport=wire)
    with pytest.raises(ToolError, match="tripwire"):
        await fetch.invoke({"url": "https://Example.org:8443/a?b=1"})
    (request,) = wire.requests
    assert str(request.url) == "https://93.184.215.14:8443/a?b=1"
    assert request.headers["host"] == "example.org:8443"
    assert request.extensions["sni_hostname"] == "example.org"


async def test_a_loopback_server_named_in_the_allowlist_is_fetched(site: Site) -> None:
    wire = LoopbackOnly()
    fetch = http_fetch_tool(allowlist=("127.0.0.1",), resolver=Resolver({}), transport=wire)
    result = msgspec.json.decode(await fetch.invoke({"url": f"http://127.0.0.1:{site.port}/"}))
    assert (result["status"], result["content"]) == (200, "inside")
    assert site.hosts == [f"127.0.0.1:{site.port}"]
    # the allowlist names only that address: other private ones stay refused
    with pytest.raises(Rejected, match="not in the allowlist"):
        await fetch.invoke({"url": "http://10.0.0.1/"})
    with pytest.raises(Rejected, match="not in the allowlist"):
        await fetch.invoke({"url": f"http://[::1]:{site.port}/"})


async def test_a_redirect_is_returned_not_followed(site: Site) -> None:
    wire = LoopbackOnly()
    fetch = http_fetch_tool(allowlist=("127.0.0.1",), resolver=Resolver({}), transport=wire)
    url = f"http://127.0.0.1:{site.port}/redirect"
    result = msgspec.json.decode(await fetch.invoke({"url": url}))
    assert result["status"] == 302
    assert [str(r.url) for r in wire.requests] == [url]


async def test_an_allowlisted_name_is_pinned_to_the_address_it_resolved_to(site: Site) -> None:
    # A rebinding resolver: loopback at the check, then an address of the cloud provider.
    resolver = Resolver({"svc.internal": [["127.0.0.1"], ["169.254.169.254"]]})
    wire = LoopbackOnly()
    fetch = http_fetch_tool(allowlist=("svc.internal",), resolver=resolver, transport=wire)
    result = msgspec.json.decode(await fetch.invoke({"url": f"http://svc.internal:{site.port}/x"}))
    assert (result["status"], result["url"]) == (200, f"http://svc.internal:{site.port}/x")
    assert resolver.asked == ["svc.internal"]  # resolved once, connected to what was checked
    assert site.hosts == [f"svc.internal:{site.port}"]
    assert [str(r.url.host) for r in wire.requests] == ["127.0.0.1"]


async def test_https_to_a_pinned_address_checks_the_certificate_against_the_name(
    ca: trustme.CA,
) -> None:
    client_context = ssl.create_default_context()
    ca.configure_trust(client_context)
    resolver = Resolver({"svc.internal": [["127.0.0.1"]]})
    site, server = await tls_site(ca, "svc.internal")
    async with server:
        wire = LoopbackOnly(verify=client_context)
        fetch = http_fetch_tool(allowlist=("svc.internal",), resolver=resolver, transport=wire)
        url = f"https://svc.internal:{site.port}/"
        result = msgspec.json.decode(await fetch.invoke({"url": url}))
        assert (result["status"], result["content"]) == (200, "inside")
        assert site.hosts == [f"svc.internal:{site.port}"]


async def test_https_refuses_a_certificate_for_another_name(ca: trustme.CA) -> None:
    client_context = ssl.create_default_context()
    ca.configure_trust(client_context)
    resolver = Resolver({"svc.internal": [["127.0.0.1"]]})
    site, server = await tls_site(ca, "other.internal")
    async with server:
        wire = LoopbackOnly(verify=client_context)
        fetch = http_fetch_tool(allowlist=("svc.internal",), resolver=resolver, transport=wire)
        with pytest.raises(ToolError, match="CERTIFICATE_VERIFY_FAILED"):
            await fetch.invoke({"url": f"https://svc.internal:{site.port}/"})
        assert site.hosts == []


async def test_a_wildcard_entry_does_not_open_private_addresses() -> None:
    resolver = Resolver({"db.corp.example": [["10.1.2.3"]]})
    wire = Tripwire()
    fetch = http_fetch_tool(allowlist=("*.corp.example",), resolver=resolver, transport=wire)
    with pytest.raises(Rejected, match=re.escape("resolves to 10.1.2.3, a private address")):
        await fetch.invoke({"url": "http://db.corp.example/"})
    assert wire.requests == []


async def test_a_network_entry_allows_its_addresses_and_no_others() -> None:
    wire = Tripwire()
    fetch = http_fetch_tool(allowlist=("10.1.0.0/16",), resolver=Resolver({}), transport=wire)
    with pytest.raises(ToolError, match="tripwire"):
        await fetch.invoke({"url": "http://10.1.2.3/"})
    with pytest.raises(Rejected, match="not in the allowlist"):
        await fetch.invoke({"url": "http://10.2.0.1/"})
    assert [r.url.host for r in wire.requests] == ["10.1.2.3"]


def test_a_bad_allowlist_entry_is_an_error_at_start() -> None:
    with pytest.raises(ValueError, match="'http://x' is not a host name"):
        Allowlist(["http://x"])


def test_public_addresses_are_not_refused() -> None:
    for text in ("93.184.215.14", "2606:4700::1111", "::ffff:8.8.8.8", "2002:808:808::1"):
        assert refusal(ipaddress.ip_address(text)) is None, text
    assert refusal(ipaddress.ip_address("2002:a00:1::1")) is not None  # 6to4 of 10.0.0.1


# -- through a tool worker on NATS ----------------------------------------------------


async def test_a_tool_worker_answers_a_refused_fetch_with_a_rejected_error(
    nc: Client, js: JetStreamContext, requester: Requester
) -> None:
    resolver, wire = Resolver({"metadata.google.internal": [["169.254.169.254"]]}), Tripwire()
    registry = Registry([http_fetch_tool(resolver=resolver, transport=wire)])
    async with running(nc, registry):
        for url in ("http://169.254.169.254/latest/", "http://metadata.google.internal/"):
            result = await requester.call("local", "http_fetch", {"url": url})
            assert result.status == "error"
            assert result.error is not None and result.error.code == "rejected"
            assert "a link-local address" in result.error.message
            assert "http_allowlist" in result.error.message
    assert wire.requests == []


@pytest.mark.slow
async def test_a_worker_process_refuses_loopback_until_the_allowlist_names_it(
    nats_server: NatsServer, js: JetStreamContext, requester: Requester, site: Site
) -> None:
    url = f"http://127.0.0.1:{site.port}/"
    env = {"LOOPMESH_TOOL_WORKER__BUILTINS": "http_fetch"}
    for allowlist, expected in (("", "rejected"), ("127.0.0.1", "ok")):
        worker = WorkerProcess(
            nats_server.url,
            "--no-provision",
            env={**env, "LOOPMESH_TOOL_WORKER__HTTP_ALLOWLIST": allowlist},
        )
        await worker.start()
        try:
            await worker.ready()
            result = await requester.call("local", "http_fetch", {"url": url}, timeout=30)
        finally:
            worker.terminate()
            assert await worker.wait() == 0
        if expected == "rejected":
            assert result.error is not None and result.error.code == "rejected"
            assert site.hosts == []  # refused before connecting
        else:
            assert result.status == "ok", result.error
            assert msgspec.json.decode(result.content)["content"] == "inside"
            assert site.hosts == [f"127.0.0.1:{site.port}"]
