"""The NATS side of k8s/, checked offline: the chart values against the chart's own
values, and mutual TLS (k8s/nats/tls, values-tls.yaml, components/nats-tls): the
cert-manager resources, and every service connecting with a client certificate the
servers' CA signs."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import msgspec

from loopmesh.settings import NatsSettings

from .checks import validate
from .render import K8S, REFERENCE, Doc, container_config, load_yaml, of_kind, render


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
        validate(doc)
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
