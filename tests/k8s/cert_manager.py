"""A JSON Schema of the cert-manager.io/v1 kinds that k8s/ uses (Certificate, Issuer,
ClusterIssuer), for the offline validation of tests/k8s.

cert-manager's CRDs are not in tests/k8s/reference: this is written by hand from its v1
API reference, and covers the fields such manifests set, closed (an unknown or
misspelt field fails, as the CRD's structural schema would prune it), with the CRD's
required fields and enums. Issuer kinds other than ``selfSigned`` and ``ca`` (acme,
vault, venafi) are accepted as objects, unchecked. Should the real CRDs be vendored
next to KEDA's, validate against them instead.
"""

from __future__ import annotations

from typing import Any

_STR: dict[str, Any] = {"type": "string"}
_STRS: dict[str, Any] = {"type": "array", "items": _STR}
_DURATION: dict[str, Any] = {"type": "string", "pattern": r"^([0-9]+(\.[0-9]+)?(h|m|s|ms))+$"}
_USAGES = [
    "signing", "digital signature", "content commitment", "key encipherment",
    "key agreement", "data encipherment", "cert sign", "crl sign", "encipher only",
    "decipher only", "any", "server auth", "client auth", "code signing",
    "email protection", "s/mime", "ipsec end system", "ipsec tunnel", "ipsec user",
    "timestamping", "ocsp signing", "microsoft sgc", "netscape sgc",
]  # fmt: skip


def _closed(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(required),
        "additionalProperties": False,
    }


_METADATA = {"type": "object", "required": ["name"]}

_CERTIFICATE_SPEC = _closed(
    {
        "secretName": _STR,
        "issuerRef": _closed({"name": _STR, "kind": _STR, "group": _STR}, ("name",)),
        "commonName": _STR,
        "dnsNames": _STRS,
        "ipAddresses": _STRS,
        "uris": _STRS,
        "emailAddresses": _STRS,
        "isCA": {"type": "boolean"},
        "duration": _DURATION,
        "renewBefore": _DURATION,
        "usages": {"type": "array", "items": {"enum": _USAGES}},
        "privateKey": _closed(
            {
                "algorithm": {"enum": ["RSA", "ECDSA", "Ed25519"]},
                "size": {"type": "integer"},
                "encoding": {"enum": ["PKCS1", "PKCS8"]},
                "rotationPolicy": {"enum": ["Never", "Always"]},
            }
        ),
        "subject": {"type": "object"},
        "secretTemplate": _closed(
            {
                "annotations": {"type": "object"},
                "labels": {"type": "object"},
            }
        ),
        "revisionHistoryLimit": {"type": "integer", "minimum": 1},
    },
    ("secretName", "issuerRef"),
)

_ISSUER_SPEC = {
    **_closed(
        {
            "selfSigned": _closed({"crlDistributionPoints": _STRS}),
            "ca": _closed({"secretName": _STR, "crlDistributionPoints": _STRS}, ("secretName",)),
            "acme": {"type": "object"},
            "vault": {"type": "object"},
            "venafi": {"type": "object"},
        }
    ),
    "minProperties": 1,
    "maxProperties": 1,  # exactly one kind of issuer
}


def _kind(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return _closed(
        {
            "apiVersion": {"const": "cert-manager.io/v1"},
            "kind": {"const": kind},
            "metadata": _METADATA,
            "spec": spec,
        },
        ("apiVersion", "kind", "metadata", "spec"),
    )


SCHEMAS: dict[str, dict[str, Any]] = {
    "Certificate": _kind("Certificate", _CERTIFICATE_SPEC),
    "Issuer": _kind("Issuer", _ISSUER_SPEC),
    "ClusterIssuer": _kind("ClusterIssuer", _ISSUER_SPEC),
}
