"""The Python client: ``from loopmesh import Client`` (docs/CLIENT.md).

One async API over NATS (:mod:`.nats`) or through the HTTP gateway (:mod:`.gateway`)::

    async with Client(gateway="http://127.0.0.1:8080", api_key=KEY) as client:
        async for event in client.run("What is 17 * 23?", session="s1"):
            ...                                  # schemas.events, ending with loop_end
        async for item in client.events("s1", since=0, follow=False):
            print(item.seq, item.event.type)      # resume with since=item.seq
        await client.approve("s1", call_id)       # deny, cancel, pause, resume
        fork = await client.fork("s1", before_turn=turn_id)  # a new session; rewind too
        agents = await client.agents()
        page = await client.sessions(labels={"team": "red"})  # .sessions, .next_cursor
        await client.delete_session("s1")         # erased everywhere, audited

Errors: :mod:`.errors`. Settings: :mod:`.config` (``[client]``, ``[nats]``).
"""

from __future__ import annotations

from .client import Client, TurnOptions
from .config import ClientConfig, ClientSettings
from .errors import (
    ClientError,
    InvalidRequest,
    NotFound,
    NotSetUp,
    RateLimited,
    TurnRefused,
    Unauthorized,
    Unavailable,
)
from .transport import Erased, Fork, MemoryItem, Rewind, SessionEvent, SessionPage, Submitted

__all__ = [
    "Client",
    "ClientConfig",
    "ClientError",
    "ClientSettings",
    "Erased",
    "Fork",
    "InvalidRequest",
    "MemoryItem",
    "NotFound",
    "NotSetUp",
    "RateLimited",
    "Rewind",
    "SessionEvent",
    "SessionPage",
    "Submitted",
    "TurnOptions",
    "TurnRefused",
    "Unauthorized",
    "Unavailable",
]
