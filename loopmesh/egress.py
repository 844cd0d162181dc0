"""Where loopmesh connects on someone else's say: resolve a URL's host once, check every
address, pin one.

Three things connect to URLs that someone other than the operator chose: the
``http_fetch`` tool (an agent's tool calls are steered by text it reads), webhook
deliveries (a turn names its webhook) and the gateway's A2A push notifications (a
client registers the URL). Neither may become a way into the network it runs
in (a cluster's internal services, the NATS monitoring port, the cloud metadata address
169.254.169.254), so all apply this policy, each with its own allowlist setting
(``[tool_worker] http_allowlist``, ``[webhooks] allowlist``, ``[gateway]
push_allowlist``). By default only globally routable
unicast addresses are reachable: loopback, private, link-local, unique-local, shared
(CGNAT), multicast, unspecified and reserved addresses are refused, and so are the
ranges Python's ``ipaddress`` still calls global although no public host may hold them
(:data:`SPECIAL`: IPv6 site-local ``fec0::/10``, the 6bone's ``3ffe::/16``, IPv6
documentation ``3fff::/20``, the 6to4 relay anycast ``192.88.99.0/24``), also when they
hide inside an IPv6 address (IPv4-mapped ``::ffff:a.b.c.d``, NAT64 ``64:ff9b::/96``,
6to4).

The check is made on the addresses the connection will use: :meth:`Egress.check`
resolves the host once, refuses the URL if *any* address is refused, and returns the
addresses; the caller then connects to one of them (never to the name again), so DNS
rebinding cannot swap in another address after the check; :func:`send_pinned`
does that with httpx, keeping the name in the Host header and the TLS server name.

Allowlist entries::

    "docs.example.com"   this name (its addresses are pinned; private ones allowed)
    "*.example.com"      any subdomain (public addresses only)
    "10.1.2.3", "::1"    this address, even when private
    "10.1.0.0/16"        any address of this network, even when private

An empty allowlist allows any host whose addresses are public; a non-empty one allows
only the hosts it names.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
from collections.abc import Awaitable, Callable, Mapping, Sequence

import httpx

from .errors import EgressRefused, UnresolvableHost

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

#: ``resolver(host, port)`` → the host's addresses, as text, in the order to try them.
Resolver = Callable[[str, int], Awaitable[Sequence[str]]]

_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_ULA = ipaddress.IPv6Network("fc00::/7")
#: Ranges refused by name, that ``ipaddress`` counts as global.
SPECIAL: tuple[tuple[str, Network], ...] = (
    ("site-local", ipaddress.IPv6Network("fec0::/10")),  # deprecated (RFC 3879)
    ("6bone", ipaddress.IPv6Network("3ffe::/16")),  # returned (RFC 3701)
    ("documentation", ipaddress.IPv6Network("3fff::/20")),  # RFC 9637
    ("6to4 relay anycast", ipaddress.IPv4Network("192.88.99.0/24")),  # deprecated (RFC 7526)
)
_LABEL = re.compile(r"(?!-)[a-z0-9_-]{1,63}(?<!-)")


async def resolve(host: str, port: int) -> list[str]:
    """The system resolver's addresses for ``host``, without duplicates."""
    infos = await asyncio.get_running_loop().getaddrinfo(
        host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
    )
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def refusal(address: Address) -> str | None:
    """Why ``address`` is not a public unicast address (``"a loopback address"``...),
    or None when it is one."""
    embedded = _embedded_ipv4(address)
    if embedded is not None:
        reason = refusal(embedded)
        return f"{reason} ({address} carries {embedded})" if reason else None
    checks = (
        ("unspecified", address.is_unspecified),
        ("loopback", address.is_loopback),
        ("link-local", address.is_link_local),
        ("multicast", address.is_multicast),
        ("unique-local", isinstance(address, ipaddress.IPv6Address) and address in _ULA),
        *((name, address in network) for name, network in SPECIAL),
        ("private", address.is_private),
        ("reserved", address.is_reserved),
        ("non-global", not address.is_global),
    )
    for name, hit in checks:
        if hit:
            return f"a {name} address"
    return None


def _embedded_ipv4(address: Address) -> ipaddress.IPv4Address | None:
    if not isinstance(address, ipaddress.IPv6Address):
        return None
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address in _NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return address.sixtofour


class Allowlist:
    """Parsed allowlist entries; raises ``ValueError`` naming a bad entry (``setting``:
    the setting's name, for that message)."""

    def __init__(self, entries: Sequence[str] = (), *, setting: str = "http_allowlist") -> None:
        self.entries = tuple(entries)
        names: set[str] = set()
        suffixes: list[str] = []
        networks: list[Network] = []
        for raw in entries:
            entry = raw.strip().lower().rstrip(".")
            if entry.startswith("[") and entry.endswith("]"):
                entry = entry[1:-1]
            try:
                networks.append(ipaddress.ip_network(entry, strict=False))
                continue
            except ValueError:
                pass
            wildcard = entry.startswith("*.")
            name = entry[2:] if wildcard else entry
            if not name or not all(_LABEL.fullmatch(label) for label in name.split(".")):
                raise ValueError(
                    f"{setting} entry {raw!r} is not a host name, '*.domain', "
                    "an IP address or a network"
                )
            if wildcard:
                suffixes.append("." + name)
            else:
                names.add(name)
        self.names = frozenset(names)
        self.suffixes = tuple(suffixes)
        self.networks = tuple(networks)

    def admits(self, host: str) -> bool:
        """True when an empty allowlist or an entry lets a URL name ``host``."""
        if not self.entries or host in self.names or host.endswith(self.suffixes):
            return True
        address = literal(host)
        return address is not None and self.covers(address)

    def covers(self, address: Address) -> bool:
        """True when an address or network entry names ``address``."""
        return any(address in network for network in self.networks)


class Egress:
    """One egress policy: an allowlist, a resolver, and ``setting``, the allowlist's
    setting as its refusals name it (``[webhooks] allowlist (LOOPMESH_WEBHOOKS__ALLOWLIST)``)."""

    def __init__(self, allowlist: Allowlist, resolver: Resolver = resolve, *, setting: str) -> None:
        self.allowlist = allowlist
        self.resolver = resolver
        self.setting = setting

    async def check(self, host: str, port: int) -> list[Address]:
        """The addresses a request to ``host`` may connect to, resolved once; raises
        :class:`~loopmesh.errors.EgressRefused` when the host or any of its addresses is
        not allowed, :class:`~loopmesh.errors.UnresolvableHost` when it has none."""
        host = host.lower().rstrip(".")
        if not self.allowlist.admits(host):
            raise EgressRefused(
                host,
                f"host {host!r} is not in the allowlist ({', '.join(self.allowlist.entries)}); "
                f"add it to {self.setting} to allow it",
            )
        given = literal(host)
        addresses = [given] if given is not None else await self._resolve(host, port)
        explicit = host in self.allowlist.names
        for address in addresses:
            reason = refusal(address)
            if reason is None or explicit or self.allowlist.covers(address):
                continue
            what = f"{host} is {reason}" if given else f"{host} resolves to {address}, {reason}"
            raise EgressRefused(
                host,
                f"{what}: non-public addresses are refused unless named in {self.setting}",
            )
        return addresses

    async def _resolve(self, host: str, port: int) -> list[Address]:
        try:
            found = await self.resolver(host, port)
        except (OSError, UnicodeError) as exc:
            raise UnresolvableHost(host, f"cannot resolve host {host!r}: {exc}") from None
        addresses = []
        for text in found:
            try:
                addresses.append(ipaddress.ip_address(text.partition("%")[0]))
            except ValueError:
                raise UnresolvableHost(
                    host, f"resolver gave {text!r} for {host!r}, not an address"
                ) from None
        if not addresses:
            raise UnresolvableHost(host, f"cannot resolve host {host!r}: no addresses")
        return addresses


def literal(host: str) -> Address | None:
    """``host`` as an IP address, or None when it is a name."""
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


def pinned(request: httpx.Request, address: Address) -> httpx.Request:
    """``request`` sent to ``address`` instead of its URL's host: the name stays in the
    Host header and, for https, in the TLS server name (the certificate is checked
    against it)."""
    url = request.url
    host = url.raw_host.decode("ascii")
    headers = httpx.Headers(request.headers)
    headers["Host"] = url.netloc.decode("ascii")
    extensions = dict(request.extensions)
    if url.scheme == "https" and literal(host) is None:
        extensions["sni_hostname"] = host
    return httpx.Request(
        request.method,
        url.copy_with(host=str(address)),
        headers=headers,
        stream=request.stream,
        extensions=extensions,
    )


async def send_pinned(
    client: httpx.AsyncClient,
    method: str,
    url: httpx.URL,
    addresses: Sequence[Address],
    *,
    headers: Mapping[str, str] | None = None,
    content: bytes | None = None,
) -> httpx.Response:
    """Send ``method url`` to the first of ``addresses`` (from :meth:`Egress.check`) that
    accepts a connection (:func:`pinned`). The response is streamed: the caller reads
    and closes it. Give ``client`` ``follow_redirects=False`` (each hop would need the
    check) and ``trust_env=False`` (a proxy would connect by name, past the pinned
    address)."""
    request = client.build_request(method, url, headers=headers, content=content)
    for i, address in enumerate(addresses):
        try:
            return await client.send(pinned(request, address), stream=True)
        except httpx.ConnectError:
            if i == len(addresses) - 1:
                raise
    raise ValueError("send_pinned needs at least one address")


class PinnedTransport(httpx.AsyncBaseTransport):
    """An ``httpx`` transport that checks every request's host against ``egress`` and
    connects only to the addresses the check returned (the first that accepts): for a
    client whose requests a library makes (the A2A SDK's push notifications). Refusals
    raise :class:`~loopmesh.errors.EgressRefused`."""

    def __init__(self, egress: Egress, inner: httpx.AsyncBaseTransport | None = None) -> None:
        self.egress = egress
        self.inner = inner or httpx.AsyncHTTPTransport(trust_env=False)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        host = url.raw_host.decode("ascii")
        if url.scheme not in ("http", "https"):
            raise EgressRefused(host, f"only http and https URLs are reached, not {url.scheme!r}")
        port = url.port or (443 if url.scheme == "https" else 80)
        timeout = request.extensions.get("timeout", {}).get("connect")
        async with asyncio.timeout(timeout):  # resolving is part of connecting
            addresses = await self.egress.check(host, port)
        for i, address in enumerate(addresses):
            try:
                return await self.inner.handle_async_request(pinned(request, address))
            except httpx.ConnectError:
                if i == len(addresses) - 1:
                    raise
        raise AssertionError("no addresses")  # Egress.check never returns none

    async def aclose(self) -> None:
        await self.inner.aclose()
