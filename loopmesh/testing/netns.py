"""Network partitions for tests: processes on a private switch whose links can be cut.

Each member (a NATS node, a worker) is a Linux network namespace with one veth link
to a bridge in a namespace of its own (the switch); this process reaches the switch
through a veth of its own, the host's address. Every address is on one private /24,
so nothing is routed and the machine's own network is never touched. A cut drops
packets silently, as a real partition does, with ``ip`` only (no ``tc`` qdisc, no
firewall: a minimal kernel may have neither): :meth:`Switch.isolate` takes the
member's port on the switch down (its link loses its carrier), :meth:`Switch.cut` adds a
``blackhole`` route to each peer on both sides. No connection is reset: an open one
stalls until the heal; a new one is refused at once (``EINVAL``) across a cut, and
times out across an isolation::

    async with Switch() as net:
        a = net.member("n1")                       # a.address, a.launcher
        proc = await asyncio.create_subprocess_exec(*a.launcher, "nats-server", ...)
        net.isolate(a)                             # cut from everyone, this process too
        net.heal(a)
        net.cut(a, [b, c])                         # cut from b and c only

    cluster = PartitionedCluster(tmp_path, net)     # a NatsCluster, a member per node

:func:`unavailable` says why a machine cannot (not Linux, not root, no ``ip``). Names
carry this process's id, so parallel test workers never collide; a namespace whose
process is gone (a run killed before it cleaned up) is removed by the next switch.
Deleting the switch's namespace removes every veth of the run with it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from loopmesh.cluster import NatsCluster

IP = shutil.which("ip") or "/usr/sbin/ip"
#: Runs share the private 10.77.<n>.0/24 addresses: ``n`` is each run's, taken under a lock.
NET = "10.77"
_LOCK = Path("/run/loopmesh-netns.lock")
_NAME = re.compile(r"^lm(\d+)-(\d+)-")  # lm<subnet>-<pid>-<member>


class NetnsError(Exception):
    """A namespace, link or qdisc command failed (its command and what it said)."""


def unavailable() -> str | None:
    """Why this machine cannot run partitions (``None``: it can)."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux, not {sys.platform}"
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if not os.access(IP, os.X_OK):
        return f"{IP} not found (Debian's iproute2)"
    probe = f"lm0-{os.getpid()}-probe"
    try:
        _run(IP, "netns", "add", probe)
        _run(IP, "-n", probe, "link", "add", "p0", "type", "bridge")
        _run(IP, "-n", probe, "link", "add", "p1", "type", "veth", "peer", "name", "p2")
        _run(IP, "-n", probe, "route", "add", "blackhole", "10.77.0.1/32")
    except NetnsError as exc:
        return f"network namespaces, bridges, veth or blackhole routes unavailable: {exc}"
    finally:
        subprocess.run([IP, "netns", "del", probe], capture_output=True, check=False)
    return None


@dataclass(frozen=True)
class Member:
    """A namespace on the switch: ``address`` is its IPv4 address, ``launcher`` the
    command prefix that runs a program inside it (``ip netns exec``: the program
    replaces it, so its pid is the program's)."""

    name: str
    netns: str
    address: str
    port: str  # its link's name on the switch

    @property
    def launcher(self) -> tuple[str, ...]:
        return (IP, "netns", "exec", self.netns)


class Switch:
    """One run's namespaces (see the module docstring). Blocking calls of a few ms each."""

    def __init__(self) -> None:
        self.subnet = 0
        self.prefix = ""
        self.host_link = ""
        self.members: list[Member] = []
        self._cuts: set[tuple[str, str]] = set()  # (member, peer): blackholed both ways
        self._isolated: set[str] = set()

    @property
    def host(self) -> str:
        """This process's address on the switch."""
        return f"{NET}.{self.subnet}.1"

    @property
    def sw(self) -> str:
        return f"{self.prefix}sw"

    def start(self) -> Switch:
        with _locked():
            _sweep()
            taken = {int(m.group(1)) for name in _netns() if (m := _NAME.match(name))}
            self.subnet = next(n for n in range(1, 255) if n not in taken)
            self.prefix = f"lm{self.subnet}-{os.getpid()}-"
            _run(IP, "netns", "add", self.sw)
        try:
            self.host_link = f"lm{self.subnet}h{os.getpid() % 100000}"[:15]
            _run(IP, "-n", self.sw, "link", "add", "br0", "type", "bridge")
            _run(IP, "-n", self.sw, "link", "set", "br0", "up")
            _run(IP, "link", "add", "name", self.host_link, "type", "veth",
                 "peer", "name", "host", "netns", self.sw)  # fmt: skip
            _run(IP, "-n", self.sw, "link", "set", "host", "master", "br0", "up")
            _run(IP, "addr", "add", f"{self.host}/24", "dev", self.host_link)
            _run(IP, "link", "set", self.host_link, "up")
        except BaseException:
            self.close()
            raise
        return self

    def member(self, name: str) -> Member:
        """A new namespace on the switch, its link and its loopback up."""
        k = len(self.members) + 1
        m = Member(name, f"{self.prefix}{name}", f"{NET}.{self.subnet}.{k + 1}", f"m{k}")
        _run(IP, "netns", "add", m.netns)
        self.members.append(m)
        _run(IP, "link", "add", "name", "eth0", "netns", m.netns, "type", "veth",
             "peer", "name", m.port, "netns", self.sw)  # fmt: skip
        _run(IP, "-n", self.sw, "link", "set", m.port, "master", "br0", "up")
        _run(IP, "-n", m.netns, "addr", "add", f"{m.address}/24", "dev", "eth0")
        _run(IP, "-n", m.netns, "link", "set", "eth0", "up")
        _run(IP, "-n", m.netns, "link", "set", "lo", "up")
        return m

    def cut(self, a: Member, others: Iterable[Member]) -> None:
        """Drop every packet between ``a`` and each of ``others``, both ways."""
        for b in others:
            if (a.name, b.name) not in self._cuts:
                _run(IP, "-n", a.netns, "route", "add", "blackhole", f"{b.address}/32")
                _run(IP, "-n", b.netns, "route", "add", "blackhole", f"{a.address}/32")
                self._cuts |= {(a.name, b.name), (b.name, a.name)}

    def isolate(self, a: Member) -> None:
        """Cut ``a`` from everyone: the other members and this process."""
        if a.name not in self._isolated:
            _run(IP, "-n", self.sw, "link", "set", a.port, "down")
            self._isolated.add(a.name)

    def heal(self, *members: Member) -> None:
        """Undo every cut that involves ``members`` (every cut, given none)."""
        names = {m.name for m in members} or {m.name for m in self.members}
        by_name = {m.name: m for m in self.members}
        for a, b in sorted(self._cuts):
            if a in names or b in names:
                _run(IP, "-n", by_name[a].netns, "route", "del", "blackhole",
                     f"{by_name[b].address}/32")  # fmt: skip
                self._cuts.discard((a, b))
        for name in sorted(names & self._isolated):
            _run(IP, "-n", self.sw, "link", "set", by_name[name].port, "up")
            self._isolated.discard(name)

    def close(self) -> None:
        """Remove every namespace of the run (and with the switch's, every veth).
        Idempotent."""
        for m in self.members:
            subprocess.run([IP, "netns", "del", m.netns], capture_output=True, check=False)
        self.members = []
        if self.prefix:
            subprocess.run([IP, "netns", "del", self.sw], capture_output=True, check=False)
        if self.host_link:  # gone with its peer, unless the kernel is still at it
            subprocess.run([IP, "link", "del", self.host_link], capture_output=True, check=False)
            self.host_link = ""

    def __enter__(self) -> Switch:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    async def __aenter__(self) -> Switch:
        return self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _run(*cmd: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise NetnsError(f"{' '.join(cmd)}: {(done.stderr or done.stdout).strip()}")


def _netns() -> list[str]:
    done = subprocess.run([IP, "netns", "list"], capture_output=True, text=True, check=False)
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


def _sweep() -> None:
    """Remove the namespaces of runs whose process is gone."""
    for name in _netns():
        m = _NAME.match(name)
        if m and not _alive(int(m.group(2))):
            subprocess.run([IP, "netns", "del", name], capture_output=True, check=False)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    with open(_LOCK, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class PartitionedCluster(NatsCluster):
    """A :class:`~loopmesh.cluster.NatsCluster` whose every node runs in a member of
    ``switch`` named after it, on its own address with nats-server's standard ports."""

    def __init__(self, root: str | Path, switch: Switch, **kwargs: Any) -> None:
        super().__init__(root, **kwargs)
        self.members: dict[str, Member] = {}
        for node in self.nodes:
            m = self.members[node.name] = switch.member(node.name)
            node.host, node.launcher = m.address, m.launcher

    def assign_ports(self) -> None:
        for node in self.nodes:  # each node has an address of its own
            node.port, node.monitor_port, node.route_port = 4222, 8222, 6222
