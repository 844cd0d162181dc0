"""The partition tests' switch: members reach each other and this process; a cut
between two members stops their packets both ways and no one else's; an isolated
member reaches no one; a heal undoes it; closing removes every namespace."""

import subprocess
import sys

import pytest

from loopmesh.testing import netns
from loopmesh.testing.netns import IP, Switch, unavailable

WHY = unavailable()

PORT = 9000


def reaches(launcher: tuple[str, ...], address: str) -> bool:
    """Whether a connection from inside ``launcher``'s namespace to ``address`` opens."""
    code = (
        f"import socket; s = socket.socket(); s.settimeout(0.5); s.connect(({address!r}, {PORT}))"
    )
    done = subprocess.run([*launcher, sys.executable, "-c", code], capture_output=True)
    return done.returncode == 0


def namespaces() -> str:
    return subprocess.run([IP, "netns", "list"], capture_output=True, text=True).stdout


def test_a_machine_without_root_or_ip_is_told_why(monkeypatch):
    monkeypatch.setattr(netns.sys, "platform", "linux")
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    assert unavailable() == "network namespaces need root (ip netns add)"
    monkeypatch.setattr(netns.os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns, "IP", "/nonexistent/ip")
    assert unavailable() == "/nonexistent/ip not found (Debian's iproute2)"


@pytest.mark.skipif(bool(WHY), reason=f"no network namespaces here: {WHY}")
def test_cuts_isolations_and_heals_on_the_switch():
    with Switch() as net:
        a, b, c = net.member("a"), net.member("b"), net.member("c")
        host_link = net.host_link
        server = subprocess.Popen(
            [*a.launcher, sys.executable, "-c",
             f"import socket, time; s = socket.socket(); s.bind(({a.address!r}, {PORT})); "
             "s.listen(); print(flush=True); time.sleep(60)"],
            stdout=subprocess.PIPE,
        )  # fmt: skip
        try:
            assert server.stdout is not None and server.stdout.readline()  # listening
            assert reaches((), a.address) and reaches(b.launcher, a.address)
            net.cut(a, [b])
            assert not reaches(b.launcher, a.address)
            assert reaches(c.launcher, a.address) and reaches((), a.address)
            net.heal(a)
            assert reaches(b.launcher, a.address)
            net.isolate(a)
            assert not reaches((), a.address) and not reaches(c.launcher, a.address)
            net.heal()
            assert reaches((), a.address) and reaches(c.launcher, a.address)
            assert a.netns in namespaces()
        finally:
            server.kill()
            server.wait()
            server.stdout.close()  # type: ignore[union-attr]
    assert net.prefix not in namespaces()
    links = subprocess.run([IP, "-o", "link"], capture_output=True, text=True).stdout
    assert f" {host_link}@" not in links and f" {host_link}:" not in links
