"""The NATS connection every service uses.

The first connection must succeed within a couple of attempts, or :func:`connect`
raises :class:`~loopmesh.errors.NatsConnectError` naming the URL (a
:class:`~loopmesh.errors.NatsTlsError` saying what to set, when TLS is why: see
:mod:`loopmesh.tls`). Once connected, the client reconnects forever, with jitter so
that a fleet of workers does not stampede a restarted server, and says so in the log::

    nc = await connect(settings.nats, name="loop-worker")
    try:
        ...
    finally:
        await nc.drain()
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
import ssl
import struct
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import nats
from nats.aio.client import Client
from nats.aio.client import Server as _Server

from .aio import unless
from .errors import NatsConnectError, NatsTlsError
from .settings import NatsSettings
from .tls import ClientTls

log = logging.getLogger("loopmesh.nats")

#: Attempts at the first connection before giving up (reconnects are unlimited).
FIRST_CONNECT_ATTEMPTS = 2

#: Where a client connects when no URL is configured: the server ``loopmesh up`` starts
#: by default (and the ``nats`` CLI's default).
DEFAULT_URL = "nats://127.0.0.1:4222"


async def connect(settings: NatsSettings, *, name: str | None = None) -> Client:
    """Connect to ``settings.url`` (or :data:`DEFAULT_URL`); then reconnect forever."""
    servers = [u.strip() for u in (settings.url or DEFAULT_URL).split(",") if u.strip()]
    url = shown(settings.url or DEFAULT_URL)  # for logs and errors: no password in them
    client_name = name or settings.name
    tls = ClientTls(settings, servers)
    connected = False
    errors: list[Exception] = []
    handshake_failed = asyncio.Event()

    async def on_error(exc: Exception) -> None:
        if not connected:
            errors.append(exc)  # reported once, by NatsConnectError
            if isinstance(exc, ssl.SSLError):
                handshake_failed.set()  # see below
            return
        told = tls.explain(url, exc)
        error = str(told) if told else repr(exc)
        log.warning("nats error url=%s name=%s error=%s", _current(nc), client_name, error)

    async def on_disconnect() -> None:
        if connected and not nc.is_closed:
            log.warning("nats disconnected url=%s name=%s", url, client_name)

    async def on_reconnect() -> None:
        log.info("nats reconnected url=%s name=%s", _current(nc), client_name)

    async def on_closed() -> None:
        if connected:
            log.info("nats connection closed url=%s name=%s", url, client_name)

    def next_server(servers: list[_Server], info: dict[str, Any]) -> tuple[_Server, float]:
        # The least-tried server, after the base wait scaled by a random factor.
        server = min(servers, key=lambda s: (s.reconnects, random.random()))
        jitter = random.uniform(0.5, 1.5) if server.reconnects else random.random()
        wait = settings.reconnect_wait_s * jitter
        if tls.context is not None:
            nc.options["tls"] = tls.refresh()  # a renewed certificate, for this attempt
        return server, wait

    nc = _Client(tls, close_timeout_s=2 * settings.connect_timeout_s)
    try:
        # After a failed TLS handshake nats-py 2.16 waits forever for the plain socket
        # under it to close (nats-io/nats.py#718): give up there; on_error has the error.
        connected_now = await unless(
            handshake_failed,
            nc.connect(
                servers=servers,
                name=client_name,
                connect_timeout=settings.connect_timeout_s,  # type: ignore[arg-type]
                reconnect_time_wait=settings.reconnect_wait_s,  # type: ignore[arg-type]
                max_reconnect_attempts=FIRST_CONNECT_ATTEMPTS - 1,
                reconnect_to_server_handler=next_server,
                user_credentials=settings.creds_file,
                tls=tls.context,  # None: nats-py's default, if the server requires TLS
                error_cb=on_error,
                disconnected_cb=on_disconnect,
                reconnected_cb=on_reconnect,
                closed_cb=on_closed,
            ),
        )
        if not connected_now:
            raise ConnectionAbortedError("given up after a failed TLS handshake")
    except Exception as exc:
        await nc.close()
        # A refusal of the credentials, if any attempt got one, is the error to report:
        # the server closes the socket after it, and a later attempt may see only a reset.
        refused = [e for e in errors if "authorization violation" in str(e).lower()]
        cause = refused[-1] if refused else errors[-1] if errors else exc
        raise tls.explain(url, cause) or NatsConnectError(url, cause) from cause
    if tls.required and not tls.checked:
        await nc.close()  # this nats-py no longer shows _Client the INFO: fail closed
        raise NatsTlsError(
            url,
            "nats-py connected without showing loopmesh the server's INFO, "
            "so it cannot tell whether TLS was used; pin nats-py to 2.16",
        )
    connected = True
    nc.options["max_reconnect_attempts"] = -1  # from now on, never give up
    log.info("nats connected url=%s name=%s", _current(nc), client_name)
    return nc


class _Client(Client):
    """nats-py's client, showing each server's INFO to :meth:`ClientTls.check` before
    the TLS handshake and the CONNECT. ``_process_info`` is nats-py's own (2.16): no
    public hook sees the INFO in time, and without one a ``tls://`` URL goes on in
    plaintext with a server that does not require TLS. Should a nats-py stop calling
    it, :func:`connect` refuses every TLS connection (tests/loopmesh/test_tls.py)."""

    def __init__(self, tls: ClientTls, close_timeout_s: float) -> None:
        super().__init__()
        self._loopmesh_tls = tls
        self._close_timeout_s = close_timeout_s

    async def _process_info(self, info: dict[str, Any], initial_connection: bool = False) -> None:
        if initial_connection:
            self._loopmesh_tls.check(info)
        await super()._process_info(info, initial_connection)

    async def close(self) -> None:
        """nats-py's close, given up after a while: after a reconnect's failed TLS
        handshake it waits forever for a socket that never reports its close
        (nats-io/nats.py#718); the socket is closed already."""
        deadline = asyncio.timeout(self._close_timeout_s)
        try:
            async with deadline:
                await super().close()
        except TimeoutError:
            if not deadline.expired():
                raise
            log.warning("nats close gave up waiting after %ss", self._close_timeout_s)


async def reset(nc: Client) -> bool:
    """Drop ``nc``'s connection at once with a TCP reset, then reconnect; whether the
    reset was made.

    What a client wrote and the kernel has not delivered yet (the server is cut off: a
    partition drops the packets, the client does not know yet) is discarded, never
    delivered once the partition heals. A plain close, nats-py's own on a reconnect,
    sends it first, however late: a worker whose lease lapsed by its own clock would
    then store what it wrote under that lease after another worker took over. nats-py
    (2.16, pinned) shows no socket: this reads ``Client._transport._io_writer``; where
    that is not there (a websocket transport, another nats-py) it reconnects with a
    plain close and says so in the log (tests/loopmesh/test_nats_reset.py). A client
    that is not connected is left to its reconnect."""
    if not nc.is_connected:  # reconnecting already: its socket is closed
        return False
    writer = getattr(getattr(nc, "_transport", None), "_io_writer", None)
    transport = getattr(writer, "transport", None)
    sock = transport.get_extra_info("socket") if transport is not None else None
    if transport is None or sock is None:
        log.warning("nats connection not reset (no socket to reset): reconnecting")
        await nc.force_reconnect()
        return False
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()  # the socket closes with a reset; nats-py reconnects
    await nc.force_reconnect()
    return True


def shown(url: str) -> str:
    """``url`` (one server or a comma-separated list) as logs and errors show it: a
    password or token in it replaced by ``***``."""
    return ",".join(_shown(u.strip()) for u in url.split(","))


def _shown(url: str) -> str:
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    userinfo, _, host = parts.netloc.rpartition("@")
    user, colon, _ = userinfo.partition(":")
    hidden = f"{user}:***" if colon else "***"  # user:password, or a token alone
    return urlunsplit(parts._replace(netloc=f"{hidden}@{host}"))


def _current(nc: Client) -> str:
    server = nc.connected_url
    return shown(server.geturl()) if server is not None else "-"


__all__ = ["Client", "connect", "nats", "reset", "shown"]
