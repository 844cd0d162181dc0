"""The k8s/ manifests, rendered by kustomize and checked offline: core kinds against
Kubernetes' schemas (kubernetes-validate), KEDA and prometheus-operator kinds against
their CRDs' openAPIV3Schema, the settings against loopmesh's own settings types, and
the NATS chart values against the chart's values."""

from __future__ import annotations

import copy
import json
import re
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import kubernetes_validate
import msgspec
import pytest

from gateway.server import check_settings
from gateway.settings import GatewayConfig
from loopmesh.errors import ConfigError
from loopmesh.settings import NatsSettings, load
from nats_agents.host import CUT_S
from nats_agents.service import tenant_of

from .cert_manager import SCHEMAS as CERT_MANAGER
from .render import (
    K8S,
    REFERENCE,
    ROOT,
    SERVICES,
    TARGETS,
    Doc,
    container_config,
    load_yaml,
    named,
    of_kind,
    pod_labels,
    render,
    selects,
    service_of,
)

KUBERNETES_VERSION = "1.32.0"
CRDS = {
    ("keda.sh", "ScaledObject"): "keda.sh_scaledobjects.yaml",
    ("keda.sh", "TriggerAuthentication"): "keda.sh_triggerauthentications.yaml",
    ("monitoring.coreos.com", "PodMonitor"): "monitoring.coreos.com_podmonitors.yaml",
    ("monitoring.coreos.com", "ServiceMonitor"): "monitoring.coreos.com_servicemonitors.yaml",
}
#: Seconds a pod needs beyond its drain deadline: the NATS drain and process exit.
DRAIN_MARGIN_S = 5


# -- schemas -------------------------------------------------------------------------


def _crd_validator(group: str, kind: str, version: str) -> jsonschema.protocols.Validator:
    crd = load_yaml(REFERENCE / CRDS[(group, kind)])
    assert crd["spec"]["group"] == group and crd["spec"]["names"]["kind"] == kind
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            schema = _closed(copy.deepcopy(v["schema"]["openAPIV3Schema"]))
            return jsonschema.Draft202012Validator(schema)
    raise AssertionError(f"the {kind} CRD has no version {version}")


def _closed(schema: Any) -> Any:
    """The schema with unknown fields refused where the API server would prune them
    (an object with properties, and neither additionalProperties nor
    x-kubernetes-preserve-unknown-fields): a misspelt field fails here, not silently."""
    if isinstance(schema, dict):
        for value in schema.values():
            _closed(value)
        if (
            "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        for item in schema:
            _closed(item)
    return schema


def _validate(doc: Doc) -> None:
    group, _, version = doc["apiVersion"].rpartition("/")
    if group == "cert-manager.io":
        assert doc["kind"] in CERT_MANAGER, f"{doc['kind']}: no schema to validate it with"
        errors = list(jsonschema.Draft202012Validator(CERT_MANAGER[doc["kind"]]).iter_errors(doc))
        if errors:
            pytest.fail(
                f"{doc['kind']} {doc['metadata']['name']}: "
                + "; ".join(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors)
            )
        return
    if (group, doc["kind"]) in CRDS:
        errors = list(_crd_validator(group, doc["kind"], version).iter_errors(doc))
        if errors:
            pytest.fail(
                f"{doc['kind']} {doc['metadata']['name']}: "
                + "; ".join(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors)
            )
        return
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"{doc['kind']} {doc['metadata']['name']}: {exc.message} at {exc.path}")
    except kubernetes_validate.SchemaNotFoundError:
        pytest.fail(f"{doc['apiVersion']} {doc['kind']}: no schema to validate it with")


@pytest.mark.parametrize("target", TARGETS)
def test_every_document_is_valid(target: str) -> None:
    docs = render(target)
    assert of_kind(docs, "Deployment"), f"k8s/{target} renders no Deployment"
    for doc in docs:
        _validate(doc)
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == "loopmesh", doc["metadata"]["name"]


def test_the_validation_refuses_a_misspelt_field() -> None:
    """The checks above can fail: a typo in a ScaledObject and in a Deployment."""
    docs = render("overlays/keda")
    scaled = copy.deepcopy(of_kind(docs, "ScaledObject")[0])
    scaled["spec"]["maxReplicas"] = scaled["spec"].pop("maxReplicaCount")
    with pytest.raises(pytest.fail.Exception, match="maxReplicas"):
        _validate(scaled)
    deployment = copy.deepcopy(of_kind(docs, "Deployment")[0])
    deployment["spec"]["template"]["spec"]["terminationGracePeriod"] = 30
    with pytest.raises(pytest.fail.Exception, match="terminationGracePeriod"):
        _validate(deployment)
    certificate = copy.deepcopy(of_kind(render("overlays/prod"), "Certificate")[0])
    certificate["spec"]["dnsName"] = ["nats"]
    with pytest.raises(pytest.fail.Exception, match="dnsName"):
        _validate(certificate)


# -- the services ----------------------------------------------------------------------


def _port(container: Doc, port: int | str) -> int:
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in container["ports"] if p["name"] == port]
    return int(number)


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
            assert _egress_ports(docs, pod_labels(deployment)) == {53, 4222}, name  # NATS only
        else:
            settings = config.loop_worker if service == "loop-worker" else config.tool_worker
            listen, host, paths = settings.metrics_port, settings.metrics_host, ("/healthz",)
            assert grace >= settings.drain_timeout_s + DRAIN_MARGIN_S, (name, grace)
            assert grace <= settings.drain_timeout_s + 30, f"{name}: grace far past the drain"
        assert host == "0.0.0.0", f"{name} listens on {host}: probes and scrapes cannot reach"
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            get = container[probe]["httpGet"]
            assert _port(container, get["port"]) == listen, (name, probe)
            assert get["path"] in paths, (name, probe, get["path"])
        assert container["readinessProbe"]["httpGet"]["path"] == paths[-1], name
        assert config.nats.url and config.nats.replicas == 3, name
        if service == "tool-worker":
            pool = container["args"][container["args"].index("--pool") + 1]
            assert pod_labels(deployment)["loopmesh.dev/pool"] == pool
            assert name == f"tool-worker-{pool}"


def _egress_ports(docs: list[Doc], labels: dict[str, str]) -> set[int | str]:
    """Every port the NetworkPolicies let pods with ``labels`` connect to (``any``: a
    rule that names no port)."""
    return {
        port["port"]
        for policy in of_kind(docs, "NetworkPolicy")
        if selects(policy["spec"]["podSelector"], labels)
        for rule in policy["spec"].get("egress", [])
        for port in rule.get("ports") or [{"port": "any"}]
    }


def _scrapes_allowed(
    docs: list[Doc], labels: dict[str, str], port: int, namespace: str = "monitoring"
) -> bool:
    """Whether a NetworkPolicy lets ``namespace`` (Prometheus') reach ``port`` of pods
    with ``labels``."""
    return any(
        source.get("namespaceSelector", {}).get("matchLabels")
        == {"kubernetes.io/metadata.name": namespace}
        and port in {p["port"] for p in rule.get("ports", [])}
        for policy in of_kind(docs, "NetworkPolicy")
        if policy["spec"]["podSelector"] and selects(policy["spec"]["podSelector"], labels)
        for rule in policy["spec"].get("ingress", [])
        for source in rule.get("from", [])
    )


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
        assert _scrapes_allowed(docs, labels, number), f"{name}: Prometheus may not reach {number}"


# -- autoscaling -------------------------------------------------------------------------


def _expected_consumer(docs: list[Doc], deployment: Doc, tmp_path: Path) -> tuple[str, str]:
    """The stream and durable consumer a tool pool's workers pull from, by the code."""
    config = container_config(docs, deployment, tmp_path)
    subjects = config.nats.subjects
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    pool = args[args.index("--pool") + 1] if "--pool" in args else config.tool_worker.pool
    return subjects.tools_stream, subjects.pool_consumer(pool)


def _reads_the_exporter(docs: list[Doc], trigger: Doc, tmp_path: Path) -> None:
    """The loop workers' trigger: the turns backlog over every tenant, from the exporter's
    /metrics through its Service (KEDA's metrics-api scaler, Prometheus text), which a
    NetworkPolicy lets KEDA's operator reach."""
    meta = trigger["metadata"]
    assert trigger["type"] == "metrics-api" and "authenticationRef" not in trigger
    assert meta["format"] == "prometheus"
    assert meta["valueLocation"] == "loopmesh_turns_backlog_total"
    assert float(meta["targetValue"]) > 0 and float(meta["activationTargetValue"]) >= 0
    url = urlsplit(meta["url"])
    service_name, namespace, rest = url.hostname.split(".", 2)  # type: ignore[union-attr]
    assert (url.scheme, namespace, rest, url.path) == (
        "http", "loopmesh", "svc.cluster.local", "/metrics"
    )  # fmt: skip
    service = named(docs, "Service", service_name)
    (exporter,) = [d for d in of_kind(docs, "Deployment") if service_of(d) == "exporter"]
    labels = pod_labels(exporter)
    assert selects({"matchLabels": service["spec"]["selector"]}, labels)
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == url.port]
    container = exporter["spec"]["template"]["spec"]["containers"][0]
    listens = container_config(docs, exporter, tmp_path).exporter.metrics_port
    assert _port(container, port["targetPort"]) == listens
    assert _scrapes_allowed(docs, labels, listens, namespace="keda"), (
        "no NetworkPolicy lets KEDA (namespace keda) read the exporter"
    )


def _workers(docs: list[Doc]) -> list[Doc]:
    return [
        d for d in of_kind(docs, "Deployment") if service_of(d) in ("loop-worker", "tool-worker")
    ]


@pytest.mark.parametrize(
    "target", [t for t in TARGETS if t in ("overlays/keda", "overlays/prod") or "examples/" in t]
)
def test_scaled_objects_follow_the_consumers(target: str, tmp_path: Path) -> None:
    docs = render(target)
    scaled = {s["spec"]["scaleTargetRef"]["name"]: s for s in of_kind(docs, "ScaledObject")}
    workers = _workers(docs)
    assert set(scaled) == {d["metadata"]["name"] for d in workers}
    authentications = {a["metadata"]["name"]: a for a in of_kind(docs, "TriggerAuthentication")}
    for deployment in workers:
        name = deployment["metadata"]["name"]
        spec = scaled[name]["spec"]
        assert "replicas" not in deployment["spec"], f"{name}: replicas fight KEDA"
        if spec["minReplicaCount"] == 0:
            _provisioned_ahead(docs, deployment, tmp_path)
        else:
            assert spec["minReplicaCount"] >= 1, name
        assert spec["minReplicaCount"] < spec["maxReplicaCount"] <= 100, name
        fallback = spec["fallback"]["replicas"]  # when the trigger's source cannot be read
        assert spec["minReplicaCount"] <= fallback <= spec["maxReplicaCount"], name
        (trigger,) = spec["triggers"]
        if service_of(deployment) == "loop-worker":
            _reads_the_exporter(docs, trigger, tmp_path)
            continue
        meta = trigger["metadata"]
        assert trigger["type"] == "nats-jetstream", name
        assert (meta["stream"], meta["consumer"]) == _expected_consumer(docs, deployment, tmp_path)
        assert int(meta["lagThreshold"]) > 0 and int(meta["activationLagThreshold"]) >= 0
        if "authenticationRef" in trigger:
            auth = authentications[trigger["authenticationRef"]["name"]]
            params = {r["parameter"] for r in auth["spec"]["secretTargetRef"]}
            assert params == {"natsServerMonitoringEndpoint", "account"}, name
            assert not {"natsServerMonitoringEndpoint", "account"} & set(meta), name
        else:
            assert meta["account"] == "$G", name
            host, _, port = meta["natsServerMonitoringEndpoint"].partition(":")
            assert host == "nats-headless.nats.svc.cluster.local" and port == "8222", name


def _provisioned_ahead(docs: list[Doc], deployment: Doc, tmp_path: Path) -> None:
    """A Deployment that may scale to zero is a tool pool whose catalog entries are
    pinned, provisioned by a Job with the same image and settings (tool_worker/pool.py):
    else at zero replicas its tools vanish and no backlog ever wakes it."""
    name = deployment["metadata"]["name"]
    assert service_of(deployment) == "tool-worker", f"{name}: only a tool pool scales to zero"
    config = container_config(docs, deployment, tmp_path)
    assert config.tool_worker.pinned, f"{name} scales to zero with unpinned catalog entries"
    worker = deployment["spec"]["template"]["spec"]["containers"][0]
    pool = worker["args"][worker["args"].index("--pool") + 1]
    jobs = [
        job["spec"]["template"]["spec"]["containers"][0]
        for job in of_kind(docs, "Job")
        if "--provision-only" in job["spec"]["template"]["spec"]["containers"][0]["args"]
    ]
    provisioning = [c for c in jobs if c["args"][c["args"].index("--pool") + 1] == pool]
    assert provisioning, f"{name}: no Job provisions pool {pool} ahead of its workers"
    for container in provisioning:
        assert container["image"] == worker["image"], name
        assert container["envFrom"] == worker["envFrom"], name


def test_plain_hpas_cover_every_worker() -> None:
    docs = render("overlays/hpa")
    assert not of_kind(docs, "ScaledObject")
    hpas = {
        h["spec"]["scaleTargetRef"]["name"]: h for h in of_kind(docs, "HorizontalPodAutoscaler")
    }
    assert set(hpas) == {d["metadata"]["name"] for d in _workers(docs)}
    for deployment in _workers(docs):
        assert "replicas" not in deployment["spec"]
        spec = hpas[deployment["metadata"]["name"]]["spec"]
        assert 1 <= spec["minReplicas"] < spec["maxReplicas"]


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


# -- Grafana and NATS ------------------------------------------------------------------------


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


def _key_paths(values: Any, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    if isinstance(values, dict) and values:
        return [p for k, v in values.items() for p in _key_paths(v, (*prefix, k))]
    return [prefix]


def _chart_allows(chart: Any, path: tuple[str, ...]) -> bool:
    """Whether the chart's values have ``path``; below a key whose default is an empty
    map (``merge: {}``, ``env: {}``, ``topologySpreadConstraints: {}``) any key goes."""
    node = chart
    for key in path:
        if isinstance(node, dict) and not node:
            return True
        if not isinstance(node, dict) or key not in node:
            return False
        node = node[key]
    return True


def test_nats_values_use_the_chart_keys() -> None:
    chart = load_yaml(REFERENCE / "nats-chart-2.14.2-values.yaml")
    ours = load_yaml(K8S / "nats" / "values.yaml")
    for values in (ours, load_yaml(K8S / "nats" / "values-tls.yaml")):
        unknown = [".".join(p) for p in _key_paths(values) if not _chart_allows(chart, p)]
        assert not unknown, f"keys the nats chart does not have: {unknown}"
    assert not _chart_allows(chart, ("nats", "jetstream", "fileStorage"))  # the 0.x layout
    assert ours["config"]["jetstream"]["enabled"] and ours["config"]["jetstream"]["fileStore"]
    assert ours["config"]["cluster"] == {"enabled": True, "replicas": 3}
    assert ours["config"]["monitor"]["enabled"] and ours["config"]["monitor"]["port"] == 8222
    assert ours["promExporter"]["enabled"] and ours["promExporter"]["podMonitor"]["enabled"]
    settings = tomllib.loads((K8S / "base" / "config" / "loopmesh.toml").read_text())
    nats = msgspec.convert(settings["nats"], NatsSettings)
    assert nats.replicas == ours["config"]["cluster"]["replicas"]
    assert nats.url == "nats://nats.nats.svc.cluster.local:4222"


# -- NATS over mutual TLS (k8s/nats/tls, values-tls.yaml, components/nats-tls) ---------


def _issued_by_one_ca(certificate: Doc, ca_issuer: Doc) -> None:
    ref = certificate["spec"]["issuerRef"]
    assert (ref["kind"], ref["name"]) == ("ClusterIssuer", ca_issuer["metadata"]["name"])


def test_the_nats_certificates_are_what_the_chart_values_mount() -> None:
    """k8s/nats/tls renders valid cert-manager resources: a CA that a ClusterIssuer signs
    with, and in namespace nats the Secrets that values-tls.yaml names, with the names
    the clients and the routes connect by."""
    docs = render("nats/tls")
    for doc in docs:
        _validate(doc)
    values = load_yaml(K8S / "nats" / "values-tls.yaml")
    certificates = {c["spec"]["secretName"]: c for c in of_kind(docs, "Certificate")}
    (ca_issuer,) = [i for i in of_kind(docs, "ClusterIssuer") if "ca" in i["spec"]]
    ca = certificates[ca_issuer["spec"]["ca"]["secretName"]]
    assert ca["spec"]["isCA"] and ca["metadata"]["namespace"] == "cert-manager"
    assert ca["spec"]["privateKey"]["rotationPolicy"] == "Never"  # renewed, still the CA

    server = certificates[values["config"]["nats"]["tls"]["secretName"]]
    assert values["config"]["nats"]["tls"]["merge"]["verify"] is True  # mutual TLS
    assert values["tlsCA"] == {"enabled": True, "secretName": server["spec"]["secretName"]}
    assert values["config"]["cluster"]["tls"]["secretName"] == server["spec"]["secretName"]
    assert {"server auth", "client auth"} <= set(server["spec"]["usages"])  # routes: both
    names = set(server["spec"]["dnsNames"])
    assert {"nats.nats.svc.cluster.local", "nats", "*.nats-headless"} <= names
    box = certificates[values["natsBox"]["contexts"]["default"]["tls"]["secretName"]]
    for certificate in (server, box):
        assert certificate["metadata"]["namespace"] == "nats"
        _issued_by_one_ca(certificate, ca_issuer)
    assert "client auth" in box["spec"]["usages"]


def test_with_the_tls_component_every_service_connects_over_mutual_tls(tmp_path: Path) -> None:
    """overlays/prod: each Deployment reads a tls:// URL and the three TLS files from
    the Secret of a client Certificate that the NATS servers' CA signs (loading the
    settings fails if a variable names a file cert-manager does not write), by a host
    name in the servers' certificate."""
    docs = render("overlays/prod")
    nats_tls = render("nats/tls")
    (ca_issuer,) = [i for i in of_kind(nats_tls, "ClusterIssuer") if "ca" in i["spec"]]
    (server,) = [
        c for c in of_kind(nats_tls, "Certificate") if c["metadata"]["name"] == "nats-server-tls"
    ]
    (client,) = of_kind(docs, "Certificate")
    _issued_by_one_ca(client, ca_issuer)
    assert client["spec"]["usages"][-1] == "client auth"
    assert client["metadata"]["namespace"] == "loopmesh"
    deployments = of_kind(docs, "Deployment")
    assert deployments
    for deployment in deployments:
        name = deployment["metadata"]["name"]
        nats = container_config(docs, deployment, tmp_path / name).nats
        assert nats.url.startswith("tls://"), name
        host = nats.url.removeprefix("tls://").rsplit(":", 1)[0]
        assert host in server["spec"]["dnsNames"], name
        assert nats.tls_ca_file and nats.tls_cert_file and nats.tls_key_file, name
        pod = deployment["spec"]["template"]["spec"]
        (volume,) = [v for v in pod["volumes"] if v["name"] == "nats-tls"]
        assert volume["secret"]["secretName"] == client["spec"]["secretName"], name
        assert volume["secret"]["defaultMode"] == 0o440, name


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
