"""The shared runtime, the ``loopmesh`` command, and the Python client.

Settings (:mod:`loopmesh.settings`), the NATS connection (:mod:`loopmesh.nats`), stream
provisioning (:mod:`loopmesh.provision`), the embedded nats-server
(:mod:`loopmesh.server`), logging, metrics and shutdown. Import the module you need;
this package imports nothing on its own so that ``loopmesh --help`` stays quick.

``from loopmesh import Client`` is the client (:mod:`loopmesh.client`, docs/CLIENT.md),
imported when first asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .client import Client

__all__ = ["Client"]


def __getattr__(name: str) -> Any:
    if name == "Client":
        from .client import Client

        return Client
    raise AttributeError(f"module 'loopmesh' has no attribute {name!r}")
