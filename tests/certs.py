"""Certificates for NATS over TLS in tests, made by trustme: a private CA, a server
certificate for loopback and a client certificate, as PEM files::

    certs = make_certs(tmp_path / "certs")
    async with NatsServer(store, tls=certs.server_tls()) as server:   # mutual TLS
        nc = await connect(certs.settings(server.url))
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import trustme

from loopmesh.server import ServerTls
from loopmesh.settings import NatsSettings, env_var

#: Where a test's server listens, and so what its certificate names.
LOOPBACK = ("127.0.0.1", "localhost")


@dataclass(frozen=True)
class Certs:
    ca: Path  # the CA's certificate: the client's tls_ca_file and the server's ca_file
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    def server_tls(self, *, verify_clients: bool = True) -> ServerTls:
        return ServerTls(self.server_cert, self.server_key, self.ca if verify_clients else None)

    def settings(self, url: str, *, client_cert: bool = True) -> NatsSettings:
        """A client's ``[nats]`` settings for ``url``, with this CA and (unless not
        ``client_cert``) the client certificate; reconnecting at once, as in other tests."""
        return NatsSettings(
            url=url,
            reconnect_wait_s=0.05,
            connect_timeout_s=5,
            tls_ca_file=str(self.ca),
            tls_cert_file=str(self.client_cert) if client_cert else None,
            tls_key_file=str(self.client_key) if client_cert else None,
        )

    def env(self, *, client_cert: bool = True) -> dict[str, str]:
        """The same files as ``LOOPMESH_NATS__TLS_*`` variables, for a process."""
        env = {env_var("nats", "tls_ca_file"): str(self.ca)}
        if client_cert:
            env[env_var("nats", "tls_cert_file")] = str(self.client_cert)
            env[env_var("nats", "tls_key_file")] = str(self.client_key)
        return env


def make_certs(directory: Path, *, server_names: tuple[str, ...] = LOOPBACK) -> Certs:
    """A new CA and the certificates it signs, written to ``directory`` (files that are
    there already are replaced: a renewal, as cert-manager makes in a Secret)."""
    directory.mkdir(parents=True, exist_ok=True)
    ca = trustme.CA(organization_name="loopmesh test CA")
    server = ca.issue_cert(*server_names)
    client = ca.issue_cert("loopmesh-client")
    certs = Certs(
        ca=directory / "ca.crt",
        server_cert=directory / "server.crt",
        server_key=directory / "server.key",
        client_cert=directory / "client.crt",
        client_key=directory / "client.key",
    )
    ca.cert_pem.write_to_path(str(certs.ca))
    server.cert_chain_pems[0].write_to_path(str(certs.server_cert))
    server.private_key_pem.write_to_path(str(certs.server_key))
    client.cert_chain_pems[0].write_to_path(str(certs.client_cert))
    client.private_key_pem.write_to_path(str(certs.client_key))
    return certs


def certificate_secret(directory: Path) -> Path:
    """The files cert-manager writes into a client Certificate's Secret, as its volume
    holds them: ``tls.crt``, ``tls.key`` and the CA's ``ca.crt``."""
    certs = make_certs(directory / ".made")
    for key, made in (
        ("tls.crt", certs.client_cert), ("tls.key", certs.client_key), ("ca.crt", certs.ca)
    ):  # fmt: skip
        (directory / key).write_bytes(made.read_bytes())
    return directory
