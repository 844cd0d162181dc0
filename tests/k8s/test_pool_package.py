"""A user's tool pool as docs/KUBERNETES.md ships it: the example package of
``k8s/examples/text-tools`` installed with pip into a venv of its own, its tools found
through the ``loopmesh.tools`` entry point, its pool provisioned ahead of any worker and
scaled from zero, on a real nats-server.

The venv gets loopmesh (this checkout) and its dependencies (the test's environment)
through a ``.pth`` file: installing loopmesh with pip would need its build backend,
which the offline test machine does not have. The example package itself is built and
installed by pip from a copy of its source, with ``--no-index``.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from loopmesh.server import NatsServer
from loopmesh.testing.durable import ROOT, Proc, worker_env
from loopmesh.testing.fake_llm import FakeLLM
from loopmesh.testing.fake_replies import auto
from schemas import Subjects
from tests.conftest import skip_without_msg_ttl

from .test_keda_lag import keda_lags

pytestmark = pytest.mark.slow

EXAMPLE = ROOT / "k8s" / "examples" / "text-tools"
SUBJECTS = Subjects()
DEADLINE_S = 120.0


def venv_with_example(tmp_path: Path) -> Path:
    """A new venv holding the example package; returns its python."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True, timeout=60,
    ).stdout.strip()  # fmt: skip
    ours = sysconfig.get_paths()["purelib"]
    (Path(site) / "loopmesh-under-test.pth").write_text(f"{ROOT}\n{ours}\n")
    source = tmp_path / "text-tools"
    shutil.copytree(EXAMPLE, source, ignore=shutil.ignore_patterns("k8s", "Dockerfile"))
    done = subprocess.run(
        [str(python), "-m", "pip", "install", "--no-index", "--no-build-isolation",
         "--no-deps", "--disable-pip-version-check", "--quiet", str(source)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return python


def pool_env(url: str) -> dict[str, str]:
    """The example pool's ConfigMap (k8s/examples/text-tools/k8s/tools-text.env)."""
    env = {"LOOPMESH_NATS__URL": url, "LOOPMESH_TOOL_WORKER__ACK_WAIT_S": "5"}
    for line in (EXAMPLE / "k8s" / "tools-text.env").read_text().splitlines():
        key, _, value = line.partition("=")
        if key.strip():
            env[key.strip()] = value.strip()
    return env


async def test_a_pool_package_in_its_own_venv_scales_from_zero_and_serves_a_turn(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    await skip_without_msg_ttl(nats_server.url)
    python = str(venv_with_example(tmp_path))
    url = nats_server.url
    env = pool_env(url)
    started: list[Proc] = []

    async def start(proc: Proc, ready: str | None) -> Proc:
        started.append(proc)
        return await proc.start(ready, timeout=DEADLINE_S)

    async with FakeLLM(default=auto()) as llm:
        try:
            # The example's Job: the pool's consumer and its pinned tools, no worker.
            job = await start(
                Proc("-m", "loopmesh", "tool-worker", "--pool", "text", "--provision-only",
                     env=env, python=python),
                "catalog entries of pool text, pinned",
            )  # fmt: skip
            assert await job.proc.wait() == 0, job.output()  # type: ignore[union-attr]
            await start(Proc("-m", "loop_worker", env=worker_env(url, llm.base_url)), "ready")

            task = 'call text__word_count {"text": "The cat saw the other cat"}'
            run = await start(
                Proc("-m", "loopmesh", "run", "--nats-url", url, "--timeout", "120", task),
                None,
            )
            # The call waits in pool-text's backlog, as KEDA's scaler reads it.
            key = (SUBJECTS.tools_stream, SUBJECTS.pool_consumer("text"))
            async with asyncio.timeout(DEADLINE_S):
                while (await keda_lags(nats_server)).get(key) != 1:
                    assert run.proc is not None and run.proc.returncode is None, run.output()
                    await asyncio.sleep(0.1)
            offered = {t["function"]["name"] for t in llm.requests[0].get("tools", [])}
            assert {"text__word_count", "text__slugify"} <= offered, offered

            # KEDA starts a worker: the pool image's command, from the package's venv.
            worker = await start(
                Proc("-m", "loopmesh", "tool-worker", "--pool", "text", env=env, python=python),
                "serving pool=text",
            )
            assert await asyncio.wait_for(run.proc.wait(), DEADLINE_S) == 0, run.output()  # type: ignore[union-attr]
            assert '"words":6,"distinct":4,"chars":25' in run.output(), run.output()
            assert await worker.terminate() == 0, worker.output()
        finally:
            for proc in reversed(started):
                await proc.close()
