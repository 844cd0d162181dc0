"""What the k8s/ manifest tests share: each rendered document validated offline (core
kinds against Kubernetes' schemas with kubernetes-validate, KEDA and prometheus-operator
kinds against their CRDs' openAPIV3Schema, cert-manager kinds against theirs), a
container's named ports, and what the NetworkPolicies let through."""

from __future__ import annotations

import copy
from typing import Any

import jsonschema
import kubernetes_validate
import pytest

from .cert_manager import SCHEMAS as CERT_MANAGER
from .render import REFERENCE, Doc, load_yaml, of_kind, selects

KUBERNETES_VERSION = "1.32.0"
CRDS = {
    ("keda.sh", "ScaledObject"): "keda.sh_scaledobjects.yaml",
    ("keda.sh", "TriggerAuthentication"): "keda.sh_triggerauthentications.yaml",
    ("monitoring.coreos.com", "PodMonitor"): "monitoring.coreos.com_podmonitors.yaml",
    ("monitoring.coreos.com", "ServiceMonitor"): "monitoring.coreos.com_servicemonitors.yaml",
}


def crd_validator(group: str, kind: str, version: str) -> jsonschema.protocols.Validator:
    crd = load_yaml(REFERENCE / CRDS[(group, kind)])
    assert crd["spec"]["group"] == group and crd["spec"]["names"]["kind"] == kind
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            schema = closed(copy.deepcopy(v["schema"]["openAPIV3Schema"]))
            return jsonschema.Draft202012Validator(schema)
    raise AssertionError(f"the {kind} CRD has no version {version}")


def closed(schema: Any) -> Any:
    """The schema with unknown fields refused where the API server would prune them
    (an object with properties, and neither additionalProperties nor
    x-kubernetes-preserve-unknown-fields): a misspelt field fails here, not silently."""
    if isinstance(schema, dict):
        for value in schema.values():
            closed(value)
        if (
            "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        for item in schema:
            closed(item)
    return schema


def validate(doc: Doc) -> None:
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
        errors = list(crd_validator(group, doc["kind"], version).iter_errors(doc))
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


def named_port(container: Doc, port: int | str) -> int:
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in container["ports"] if p["name"] == port]
    return int(number)


def egress_ports(docs: list[Doc], labels: dict[str, str]) -> set[int | str]:
    """Every port the NetworkPolicies let pods with ``labels`` connect to (``any``: a
    rule that names no port)."""
    return {
        port["port"]
        for policy in of_kind(docs, "NetworkPolicy")
        if selects(policy["spec"]["podSelector"], labels)
        for rule in policy["spec"].get("egress", [])
        for port in rule.get("ports") or [{"port": "any"}]
    }


def scrapes_allowed(
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
