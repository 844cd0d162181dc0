"""The client's settings: ``[client]`` and ``[nats]`` of the shared TOML file, or
``LOOPMESH_CLIENT__*`` and ``LOOPMESH_NATS__*`` variables (:mod:`loopmesh.settings`)::

    [client]
    gateway = "http://127.0.0.1:8080"   # unset: straight to NATS ([nats] url)
    api_key = "..."                     # the gateway's API key; better in LOOPMESH_CLIENT__API_KEY
    tenant = "local"                    # over NATS only: through a gateway the key decides

``Client.from_config()`` reads them; the ``loopmesh`` commands people type (``run``,
``events``, ``approve``, ``deny``, ``cancel``) do too.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from loopmesh.settings import NatsSettings
from schemas.ids import TOKEN_PATTERN


class ClientSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[client]``: where the client and the commands people type send turns."""

    #: The gateway's URL (unset: straight to NATS, ``[nats] url``).
    gateway: Annotated[str, msgspec.Meta(pattern=r"^https?://")] | None = None
    #: The gateway's API key (better in ``LOOPMESH_CLIENT__API_KEY`` than in a file).
    api_key: str | None = None
    #: The tenant, over NATS only: through a gateway the key decides.
    tenant: Annotated[str, msgspec.Meta(pattern=TOKEN_PATTERN)] = "local"


class ClientConfig(msgspec.Struct, frozen=True, kw_only=True):
    nats: NatsSettings = NatsSettings()
    client: ClientSettings = ClientSettings()
