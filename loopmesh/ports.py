"""Free TCP ports on this machine, for servers that must be told theirs up front."""

from __future__ import annotations

import random
import socket
from pathlib import Path

_LOWEST = 10_000  # above the ports services commonly listen on
_EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
_share = (0, 1)  # this process draws from slice 0 of 1: the whole range (see share_range)


def share_range(index: int, count: int) -> None:
    """Draw this process's ports from the ``index``-th of ``count`` equal slices of the
    range: processes that pick ports side by side (a test suite's parallel workers) then
    never hand out the same port before its server binds it."""
    if not 0 <= index < count:
        raise ValueError(f"slice {index} of {count}")
    global _share
    _share = (index, count)


def free_port(host: str = "127.0.0.1") -> int:
    """A port on ``host`` that nothing listens on now, below the kernel's ephemeral
    range: no outgoing connection and no server started on port 0 is handed it, so a
    server restarted on it finds it free again. Another process picking ports this way
    may still take it before the caller binds it: callers that can, pass port 0."""
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` different ports, each as :func:`free_port` picks one."""
    low, top = _range()
    ports: list[int] = []
    for _ in range(100 * count):
        port = random.randrange(low, top)
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
    raise OSError(f"no {count} free ports on {host} between {low} and {top}")


def _range() -> tuple[int, int]:
    """This process's slice of the ports from ``_LOWEST`` to the ephemeral range."""
    index, count = _share
    width = (_ephemeral_low() - _LOWEST) // count
    return _LOWEST + index * width, _LOWEST + (index + 1) * width


def _ephemeral_low() -> int:
    try:
        low = int(_EPHEMERAL.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32_768  # Linux's default, and not Linux
    return max(low, _LOWEST + 1_000)
