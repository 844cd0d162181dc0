"""Free TCP ports on this machine, for servers that must be told theirs up front."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port on ``host`` that nothing listens on now (another process may take it
    before the caller binds it: callers that can, pass port 0 instead)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
