"""The k8s/ manifests, rendered by kustomize and checked offline: every document valid
(``checks.validate``), the services' probes, ports, grace periods, secrets and hardening
against loopmesh's own settings types, the agents' ConfigMap and the Grafana dashboards.
Autoscaling is in ``test_autoscaling.py``, the NATS chart values and TLS in
``test_nats_values.py``."""

from __future__ import annotations

import copy
import json
import re
import tomllib
from pathlib import Path

import msgspec
import pytest

from gateway.server import check_settings
from gateway.settings import GatewayConfig
from loopmesh.errors import ConfigError
from loopmesh.settings import load
from nats_agents.host import CUT_S
from nats_agents.service import tenant_of

from .checks import egress_ports, named_port, scrapes_allowed, validate
from .render import (
    K8S,
    ROOT,
    SERVICES,
    TARGETS,
    Doc,
    container_config,
    load_yaml,
    of_kind,
    pod_labels,
    render,
    selects,
    service_of,
)

#: Seconds a pod needs beyond its drain deadline: the NATS drain and process exit.
DRAIN_MARGIN_S = 5


# -- schemas -------------------------------------------------------------------------


@pytest.mark.parametrize("target", TARGETS)
def test_every_document_is_valid(target: str) -> None:
    docs = render(target)
    assert of_kind(docs, "Deployment"), f"k8s/{target} renders no Deployment"
    for doc in docs:
        validate(doc)
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == "loopmesh", doc["metadata"]["name"]


def test_the_validation_refuses_a_misspelt_field() -> None:
    """The checks above can fail: a typo in a ScaledObject and in a Deployment."""
    docs = render("overlays/keda")
    scaled = copy.deepcopy(of_kind(docs, "ScaledObject")[0])
    scaled["spec"]["maxReplicas"] = scaled["spec"].pop("maxReplicaCount")
    with pytest.raises(pytest.fail.Exception, match="maxReplicas"):
        validate(scaled)
    deployment = copy.deepcopy(of_kind(docs, "Deployment")[0])
    deployment["spec"]["template"]["spec"]["terminationGracePeriod"] = 30
    with pytest.raises(pytest.fail.Exception, match="terminationGracePeriod"):
        validate(deployment)
    certificate = copy.deepcopy(of_kind(render("overlays/prod"), "Certificate")[0])
    certificate["spec"]["dnsName"] = ["nats"]
    with pytest.raises(pytest.fail.Exception, match="dnsName"):
        validate(certificate)


# -- the services ----------------------------------------------------------------------


@pytest.mark.parametrize("target", TARGETS)
def test_deployments_match_their_settings(target: str, tmp_path: Path) -> None:
    """Probes and ports are where the service really listens, on an address a kubelet
    reaches, and the grace period covers the service's drain deadline."""
    docs = render(target)
    for deployment in of_kind(docs, "Deployment"):
        name = deployment["metadata"]["name"]
        pod = deployment["spec"]["template"]["spec"]
        container = pod["containers"][0]
        config = container_config(docs, deployment, tmp_path)
        service = service_of(deployment)
        grace = pod["terminationGracePeriodSeconds"]
        if service == "gateway":
            listen, host, paths = config.gateway.port, config.gateway.host, ("/healthz", "/readyz")
            _gateway_starts_with_its_secret(docs, deployment, tmp_path)
            # No drain setting: uvicorn's graceful shutdown (2 s) after the preStop pause.
            pause = int(container["lifecycle"]["preStop"]["exec"]["command"][-1])
            assert grace >= pause + 2 + DRAIN_MARGIN_S, name
        elif service == "exporter":
            listen, host, paths = (
                config.exporter.metrics_port,
                config.exporter.metrics_host,
                ("/healthz",),
            )
            assert deployment["spec"]["replicas"] == 1, f"{name}: one exporter owns its consumer"
            assert deployment["spec"]["strategy"]["type"] == "Recreate", name
            assert grace >= 1 + DRAIN_MARGIN_S, name  # a fetch times out within 1 s
        elif service == "webhooks":
            settings = config.webhooks
            listen, host, paths = settings.metrics_port, settings.metrics_host, ("/healthz",)
            assert grace >= settings.drain_timeout_s + DRAIN_MARGIN_S, (name, grace)
            _webhooks_secret_from_a_secret(container)
        elif service == "nats-agents":
            settings = config.nats_agents
            listen, host, paths = settings.metrics_port, settings.metrics_host, ("/healthz",)
            # drain_s for the prompts in flight, then CUT_S for the errors of the rest
            assert grace >= settings.drain_s + CUT_S + DRAIN_MARGIN_S, (name, grace)
            assert tenant_of(config), name  # it refuses to start without a tenant
            assert egress_ports(docs, pod_labels(deployment)) == {53, 4222}, name  # NATS only
        else:
            settings = config.loop_worker if service == "loop-worker" else config.tool_worker
            listen, host, paths = settings.metrics_port, settings.metrics_host, ("/healthz",)
            assert grace >= settings.drain_timeout_s + DRAIN_MARGIN_S, (name, grace)
            assert grace <= settings.drain_timeout_s + 30, f"{name}: grace far past the drain"
        assert host == "0.0.0.0", f"{name} listens on {host}: probes and scrapes cannot reach"
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            get = container[probe]["httpGet"]
            assert named_port(container, get["port"]) == listen, (name, probe)
            assert get["path"] in paths, (name, probe, get["path"])
        assert container["readinessProbe"]["httpGet"]["path"] == paths[-1], name
        assert config.nats.url and config.nats.replicas == 3, name
        if service == "tool-worker":
            pool = container["args"][container["args"].index("--pool") + 1]
            assert pod_labels(deployment)["loopmesh.dev/pool"] == pool
            assert name == f"tool-worker-{pool}"


def _webhooks_secret_from_a_secret(container: Doc) -> None:
    """The signing secret comes from the Secret loopmesh-webhooks, never the ConfigMap;
    without the Secret the service runs and refuses every delivery (fail closed)."""
    (secret,) = [e for e in container["env"] if e["name"] == "LOOPMESH_WEBHOOKS__SECRET"]
    ref = secret["valueFrom"]["secretKeyRef"]
    assert (ref["name"], ref["key"], ref["optional"]) == ("loopmesh-webhooks", "secret", True)


def _gateway_starts_with_its_secret(docs: list[Doc], deployment: Doc, tmp_path: Path) -> None:
    """The gateway's API keys come from a Secret, as JSON (docs/KUBERNETES.md): with an
    entry in that shape its settings pass the checks it makes before listening, and
    without one they fail closed."""
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    (keys,) = [e for e in container["env"] if e["name"] == "LOOPMESH_GATEWAY__API_KEYS"]
    assert keys["valueFrom"]["secretKeyRef"] == {"name": "loopmesh-gateway-keys", "key": "api-keys"}
    without = container_config(docs, deployment, tmp_path).gateway
    with pytest.raises(ConfigError, match="no api_keys"):
        check_settings(without)
    entry = json.dumps([{"sha256": "0" * 64, "tenant": "acme", "name": "ci"}])
    with_keys = msgspec.structs.replace(
        without, api_keys=load(GatewayConfig, env={keys["name"]: entry}).gateway.api_keys
    )
    check_settings(with_keys)
    assert with_keys.api_keys[0].tenant == "acme"


def test_the_image_holds_every_package() -> None:
    """The Dockerfile copies, and .dockerignore lets through, every package of the wheel."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = pyproject["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"]
    dockerfile = (ROOT / "Dockerfile").read_text()
    allowed = (ROOT / ".dockerignore").read_text().split()
    for package in packages:
        assert re.search(rf"^COPY {package} \./{package}$", dockerfile, re.MULTILINE), package
        assert f"!{package}/" in allowed, package
    assert re.search(r'^ENTRYPOINT \["loopmesh"\]$', dockerfile, re.MULTILINE)


def _dockerfile_user() -> int:
    users = re.findall(r"^USER\s+(\d+)", (ROOT / "Dockerfile").read_text(), re.MULTILINE)
    assert users, "the Dockerfile sets no numeric USER"
    return int(users[-1].split(":")[0])


@pytest.mark.parametrize("target", TARGETS)
def test_deployments_are_hardened(target: str) -> None:
    docs = render(target)
    uid = _dockerfile_user()
    assert uid != 0
    policies = of_kind(docs, "NetworkPolicy")
    assert any(
        p["spec"]["podSelector"] == {} and set(p["spec"]["policyTypes"]) == {"Ingress", "Egress"}
        and not p["spec"].get("ingress") and not p["spec"].get("egress")
        for p in policies
    ), "no default-deny NetworkPolicy"  # fmt: skip
    for deployment in of_kind(docs, "Deployment"):
        name = deployment["metadata"]["name"]
        labels = pod_labels(deployment)
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["runAsUser"] == uid, name
        assert pod["automountServiceAccountToken"] is False, name
        volumes = {v["name"]: v for v in pod["volumes"]}
        for container in pod["containers"]:
            # the loopmesh image, or a pool image built from it (k8s/examples)
            assert re.match(r"ghcr\.io/loopmesh/loopmesh(-[a-z0-9-]+)?:", container["image"]), name
            security = container["securityContext"]
            assert security["readOnlyRootFilesystem"] is True, name
            assert security["allowPrivilegeEscalation"] is False, name
            assert security["capabilities"]["drop"] == ["ALL"], name
            assert {"cpu", "memory"} <= set(container["resources"]["requests"]), name
            tmp = [m for m in container["volumeMounts"] if m["mountPath"] == "/tmp"]
            assert tmp and "emptyDir" in volumes[tmp[0]["name"]], f"{name}: no writable /tmp"
        budgets = [
            b
            for b in of_kind(docs, "PodDisruptionBudget")
            if selects(b["spec"]["selector"], labels)
        ]
        assert len(budgets) == 1, f"{name}: {len(budgets)} PodDisruptionBudgets"
        assert any(
            p["spec"]["podSelector"] and selects(p["spec"]["podSelector"], labels) for p in policies
        ), f"{name}: no NetworkPolicy of its own"
        ports = {p["name"] for c in pod["containers"] for p in c["ports"]}
        scraped = [
            m["spec"]["podMetricsEndpoints"][0]["port"]
            for m in of_kind(docs, "PodMonitor")
            if selects(m["spec"]["selector"], labels)
        ]
        for monitor in of_kind(docs, "ServiceMonitor"):
            for service in of_kind(docs, "Service"):
                if selects(monitor["spec"]["selector"], service["metadata"]["labels"]) and selects(
                    {"matchLabels": service["spec"]["selector"]}, labels
                ):
                    (port,) = [
                        p for p in service["spec"]["ports"]
                        if p["name"] == monitor["spec"]["endpoints"][0]["port"]
                    ]  # fmt: skip
                    scraped.append(port["targetPort"])
        assert len(scraped) == 1 and scraped[0] in ports, f"{name}: scraped on {scraped}"
        (number,) = [p["containerPort"] for c in pod["containers"] for p in c["ports"]
                     if p["name"] == scraped[0]]  # fmt: skip
        assert scrapes_allowed(docs, labels, number), f"{name}: Prometheus may not reach {number}"


# -- agents ---------------------------------------------------------------------------------


@pytest.mark.parametrize("target", TARGETS)
def test_the_agents_live_in_the_config_map_the_loop_workers_provision_from(
    target: str, tmp_path: Path
) -> None:
    """The loop workers read the named agents from the mounted ConfigMap (checked as the
    service checks them at start) and provision them; the tools they allow are served
    by the default pool."""
    docs = render(target)
    (worker,) = [d for d in of_kind(docs, "Deployment") if service_of(d) == "loop-worker"]
    config = container_config(docs, worker, tmp_path)
    assert [a.name for a in config.agents] == ["calc", "clock"]
    assert config.loop_worker.provision  # it writes them to the agents bucket at start
    (pool,) = [c for c in of_kind(docs, "ConfigMap") if "tools-default" in c["metadata"]["name"]]
    served = {f"local.{name}" for name in pool["data"]["LOOPMESH_TOOL_WORKER__BUILTINS"].split(",")}
    for agent in config.agents:
        assert agent.tools and set(agent.tools) <= served, (agent.name, agent.tools, served)


# -- Grafana ------------------------------------------------------------------------


def test_grafana_dashboards_are_generated_with_the_sidecar_label() -> None:
    """Every k8s/grafana/*.json becomes a key of the dashboards ConfigMap, and nothing else."""
    on_disk = sorted(p.name for p in (K8S / "grafana").glob("*.json"))
    kustomization = load_yaml(K8S / "grafana" / "kustomization.yaml")
    (generator,) = kustomization["configMapGenerator"]
    assert sorted(generator["files"]) == on_disk, "list every dashboard in k8s/grafana"
    (dashboards,) = [
        c for c in of_kind(render("base"), "ConfigMap")
        if c["metadata"]["name"].startswith("loopmesh-dashboards")
    ]  # fmt: skip
    assert dashboards["metadata"]["labels"]["grafana_dashboard"] == "1"
    data = dashboards.get("data", {})
    assert sorted(data) == on_disk
    for name, text in data.items():
        assert "panels" in json.loads(text), name


@pytest.mark.parametrize("target", TARGETS)
def test_every_secret_reaches_a_setting_its_service_reads(target: str) -> None:
    """A variable filled from a Secret names a field of the service's own settings
    (``LOOPMESH_<TABLE>__<FIELD>``): a key passed under a name nothing reads (a library's
    ``OPENAI_API_KEY``, which the loop worker does not look at) would leave it unset."""
    for deployment in of_kind(render(target), "Deployment"):
        settings = SERVICES[service_of(deployment)]
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            for var in container.get("env", []):
                if "secretKeyRef" not in var.get("valueFrom", {}):
                    continue
                name = var["name"]
                table, _, field = name.removeprefix("LOOPMESH_").lower().partition("__")
                tables = {f.encode_name: f.type for f in msgspec.structs.fields(settings)}
                assert name.startswith("LOOPMESH_") and table in tables, (target, name)
                fields = {f.encode_name for f in msgspec.structs.fields(tables[table])}
                assert field in fields, (target, name)
