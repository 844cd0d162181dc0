"""Ports picked for servers that must be told theirs up front."""

import socket
from pathlib import Path

import pytest

from loopmesh import ports
from loopmesh.ports import free_port, free_ports, share_range


def test_picked_ports_are_free_different_and_below_the_ephemeral_range():
    """An outgoing connection is given a port of the ephemeral range, and holds it: a
    server restarted on such a port would find it taken."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = free_ports(30)
    assert len(set(ports)) == 30
    for port in [*ports, free_port()]:
        assert port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free


def test_a_port_in_use_is_not_picked(monkeypatch):
    busy, free = free_ports(2)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", busy))
        taken.listen()
        draws = iter([busy, busy, free])
        monkeypatch.setattr("loopmesh.ports.random.randrange", lambda a, b: next(draws))
        assert free_port() == free


def test_processes_sharing_the_range_pick_from_slices_that_do_not_overlap(monkeypatch):
    monkeypatch.setattr(ports, "_share", ports._share)  # put back after the test
    picked = []
    for index in range(3):
        share_range(index, 3)
        picked.append(set(free_ports(200)))
    low = min(min(p) for p in picked)
    assert low >= 10_000 and max(picked[0]) < min(picked[1]) and max(picked[1]) < min(picked[2])
    with pytest.raises(ValueError):
        share_range(3, 3)
