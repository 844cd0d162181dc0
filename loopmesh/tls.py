"""TLS to NATS: the client's :class:`ssl.SSLContext` from ``[nats]`` ``tls_ca_file``,
``tls_cert_file`` and ``tls_key_file``, the check that a server speaks TLS when asked
to, and a failed handshake told in words a person can act on::

    tls = ClientTls(settings, servers)
    await nc.connect(servers, tls=tls.context, ...)  # None: nats-py's own (system CAs)
    ...
    raise tls.explain(url, exc) or NatsConnectError(url, exc)

TLS is *required* when any of the files is set or a URL is ``tls://``. Then each
server's INFO, seen before the handshake and the CONNECT (:meth:`ClientTls.check`),
must require TLS: nats-py itself would go on in plaintext with a ``tls://`` server that
does not, and loopmesh refuses. A server that verifies clients is refused at once when
no client certificate is set. The context verifies the server's certificate and host
name against ``tls_ca_file`` (else the system's CAs); nothing turns that off.

Files renewed on disk (cert-manager rotates them in a mounted Secret) are read again
before the next reconnect (:meth:`ClientTls.refresh`): a long-running service does not
present an expired certificate when its connection drops.
"""

from __future__ import annotations

import logging
import os
import ssl
from typing import Any

import nats.errors

from .errors import ConfigError, NatsTlsError
from .settings import NatsSettings, env_var

log = logging.getLogger("loopmesh.nats")

FILES = ("tls_ca_file", "tls_cert_file", "tls_key_file")

#: OpenSSL's names of a server's alerts that refuse the client's certificate.
_CERT_REFUSED = frozenset({
    "TLSV1_ALERT_UNKNOWN_CA",
    "SSLV3_ALERT_BAD_CERTIFICATE",
    "SSLV3_ALERT_CERTIFICATE_UNKNOWN",
    "SSLV3_ALERT_CERTIFICATE_EXPIRED",
    "SSLV3_ALERT_CERTIFICATE_REVOKED",
    "SSLV3_ALERT_UNSUPPORTED_CERTIFICATE",
    "TLSV1_ALERT_ACCESS_DENIED",
    "TLSV1_ALERT_DECRYPT_ERROR",
})  # fmt: skip
#: ... and of one that wanted a certificate and got none (TLS 1.3; 1.2 says handshake failure).
_CERT_MISSING = frozenset({"TLSV13_ALERT_CERTIFICATE_REQUIRED", "SSLV3_ALERT_HANDSHAKE_FAILURE"})
#: How a server's close in the middle of the handshake reaches the client.
_LOST = (ConnectionResetError, ConnectionAbortedError, BrokenPipeError, nats.errors.UnexpectedEOF)

_SET_CERT = (
    f"set [nats] tls_cert_file and tls_key_file ({env_var('nats', 'tls_cert_file')}, "
    f"{env_var('nats', 'tls_key_file')}) to a client certificate signed by a CA the server "
    "trusts (its tls block's ca_file), and its key"
)


class TlsRefused(nats.errors.Error):
    """Raised inside nats-py's connect, which handles it like any failed attempt (and
    keeps reconnecting); :meth:`ClientTls.explain` makes it a NatsTlsError."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail

    def __str__(self) -> str:
        return self.detail


class ClientTls:
    """The TLS a client asks for (:attr:`required`, :attr:`context`), checked against
    what each server says."""

    def __init__(self, settings: NatsSettings, servers: list[str]) -> None:
        self.settings = settings
        files = [f for f in FILES if getattr(settings, f)]
        tls_urls = any(s.lower().startswith("tls://") for s in servers)
        #: What asks for TLS, for the messages; "" when nothing does.
        self.asked_by = (
            "[nats] " + ", ".join(files) if files else "the tls:// URL" if tls_urls else ""
        )
        self.context = context(settings) if self.asked_by else None
        self._stamp = _stamp(settings)
        self.info: dict[str, Any] = {}  # the last server's INFO
        self.checked = 0  # INFOs seen by check()

    @property
    def required(self) -> bool:
        return bool(self.asked_by)

    def check(self, info: dict[str, Any]) -> None:
        """A server's INFO, before the TLS handshake and the CONNECT: raises
        :class:`TlsRefused` when TLS is required and the server does not offer it, or
        verifies clients and no certificate is set."""
        self.info = info
        self.checked += 1
        if not self.required:
            return
        if not info.get("tls_required"):
            raise TlsRefused(
                f"the server does not require TLS, and {self.asked_by} asks for it; loopmesh "
                "never falls back to plaintext. Turn TLS on in the server's configuration "
                "(a tls { cert_file, key_file } block), or point [nats] url at a server that "
                "has it"
            )
        if info.get("tls_verify") and not self.settings.tls_cert_file:
            raise TlsRefused(f"the server requires a client certificate: {_SET_CERT}")

    def refresh(self) -> ssl.SSLContext | None:
        """The context to connect with now: built again when a file has changed since
        (a renewed certificate), else the same. Files caught half-written are logged and
        read at the next call; the last good context is kept meanwhile."""
        stamp = _stamp(self.settings)
        if self.context is None or stamp == self._stamp:
            return self.context
        try:
            self.context = context(self.settings)
        except ConfigError as exc:
            log.warning("nats tls files changed but cannot be used yet: %s", exc)
            return self.context
        self._stamp = stamp
        log.info("nats tls files changed: read again for the next connection")
        return self.context

    def explain(self, url: str, exc: BaseException) -> NatsTlsError | None:
        """``exc`` told as what to set, when TLS is why a connection failed; else None."""
        settings = self.settings
        if isinstance(exc, TlsRefused):
            return NatsTlsError(url, exc.detail)
        if isinstance(exc, ssl.SSLCertVerificationError):
            reason = exc.verify_message or str(exc)
            if exc.verify_code in (62, 64):  # X509_V_ERR_HOSTNAME_MISMATCH, _IP_ADDRESS_
                return NatsTlsError(
                    url,
                    f"the server's certificate is not for the host connected to ({reason}): "
                    "connect by a name or address that the certificate lists ([nats] url)",
                )
            trust = (
                f"[nats] tls_ca_file ({settings.tls_ca_file})"
                if settings.tls_ca_file
                else "the system's CAs ([nats] tls_ca_file is not set)"
            )
            return NatsTlsError(
                url,
                f"the server's certificate does not verify against {trust}: {reason}. Set "
                f"tls_ca_file ({env_var('nats', 'tls_ca_file')}) to the CA certificate that "
                "signed the server's",
            )
        cert = f"[nats] tls_cert_file ({settings.tls_cert_file})"
        refused = (
            f"the server refused the client certificate {cert}: {{}}. Use one signed by a CA "
            "that the server trusts (its tls block's ca_file), and not expired"
        )
        if isinstance(exc, ssl.SSLError):
            if exc.reason in _CERT_MISSING and not settings.tls_cert_file:
                return NatsTlsError(url, f"the server requires a client certificate: {_SET_CERT}")
            if exc.reason in _CERT_REFUSED or exc.reason in _CERT_MISSING:
                return NatsTlsError(url, refused.format(exc.reason))
            return NatsTlsError(url, f"the TLS handshake failed: {exc}")
        if isinstance(exc, _LOST) and self.info.get("tls_verify") and settings.tls_cert_file:
            # TLS 1.3: the server checks the client's certificate after the client's side of
            # the handshake is done, so its alert can come after the close it announces.
            return NatsTlsError(url, refused.format("it closed the connection in the handshake"))
        return None


def context(settings: NatsSettings) -> ssl.SSLContext:
    """A client context that verifies the server against ``tls_ca_file`` (else the
    system's CAs) and presents ``tls_cert_file`` where set. Raises ConfigError naming
    the field for a file that holds no usable PEM."""
    try:
        ctx = ssl.create_default_context(cafile=settings.tls_ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(
            "[nats] tls_ca_file", f"{settings.tls_ca_file} is not a PEM CA certificate: {exc}"
        ) from None
    if settings.tls_cert_file:
        try:
            ctx.load_cert_chain(settings.tls_cert_file, settings.tls_key_file, _no_passphrase)
        except (OSError, ssl.SSLError, _Encrypted) as exc:
            why = "the key is encrypted (loopmesh reads unencrypted keys)" if isinstance(
                exc, _Encrypted
            ) else str(exc)  # fmt: skip
            raise ConfigError(
                "[nats] tls_cert_file, tls_key_file",
                f"{settings.tls_cert_file} and {settings.tls_key_file} are not a PEM "
                f"certificate and its private key: {why}",
            ) from None
    return ctx


class _Encrypted(Exception):
    pass


def _no_passphrase() -> bytes:
    raise _Encrypted  # else OpenSSL asks for one on the terminal


def _stamp(settings: NatsSettings) -> tuple[tuple[int, int, int] | None, ...]:
    """What tells a changed file: inode, mtime and size, through symlinks (a Kubernetes
    Secret volume swaps a symlink to its new files)."""
    stamps = []
    for field in FILES:
        path = getattr(settings, field)
        try:
            st = os.stat(path) if path else None
        except OSError:
            st = None
        stamps.append((st.st_ino, st.st_mtime_ns, st.st_size) if st else None)
    return tuple(stamps)
