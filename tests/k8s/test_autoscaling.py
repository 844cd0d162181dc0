"""The k8s/ autoscaling, rendered by kustomize and checked offline: KEDA's ScaledObjects
follow the consumers the workers pull from (a tool pool's stream and consumer, the loop
workers' turns backlog read from the exporter), a pool that scales to zero is
provisioned ahead, and the plain-HPA overlay covers every worker."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

import pytest

from .checks import named_port, scrapes_allowed
from .render import (
    TARGETS,
    Doc,
    container_config,
    named,
    of_kind,
    pod_labels,
    render,
    selects,
    service_of,
)


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
    assert named_port(container, port["targetPort"]) == listens
    assert scrapes_allowed(docs, labels, listens, namespace="keda"), (
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
