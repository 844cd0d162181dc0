"""Free TCP ports on this machine, for servers that must be told theirs up front."""

from __future__ import annotations

import random
import socket
from pathlib import Path

_LOWEST = 10_000  # above the ports services commonly listen on
_EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port(host: str = "127.0.0.1") -> int:
    """A port on ``host`` that nothing listens on now, below the kernel's ephemeral
    range: no outgoing connection and no server started on port 0 is handed it, so a
    server restarted on it finds it free again. Another process picking ports this way
    may still take it before the caller binds it: callers that can, pass port 0."""
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` different ports, each as :func:`free_port` picks one."""
    top = _ephemeral_low()
    ports: list[int] = []
    for _ in range(100 * count):
        port = random.randrange(_LOWEST, top)
        if port in ports:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue  # in use: draw again
        ports.append(port)
        if len(ports) == count:
            return ports
    raise OSError(f"no {count} free ports on {host} between {_LOWEST} and {top}")


def _ephemeral_low() -> int:
    try:
        low = int(_EPHEMERAL.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32_768  # Linux's default, and not Linux
    return max(low, _LOWEST + 1_000)
