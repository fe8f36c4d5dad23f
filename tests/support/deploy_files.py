"""Helpers for the static checks of deploy/: render kustomize offline, find PromQL in
rules and dashboards, list the metric names the services export, and the schema of the
KEDA resources we use (Kubernetes' own kinds are checked by kubernetes-validate)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


def image_packages() -> list[str]:
    """The Python packages the image (and the wheel) carries: the folders .dockerignore
    lets into the build context, the one list of them."""
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line[1:].rstrip("/") for line in lines if line.startswith("!") and line.endswith("/")]


def kustomize(overlay: Path) -> list[dict[str, Any]]:
    """`kustomize build`, offline: kubectl's embedded kustomize or a kustomize binary."""
    if shutil.which("kustomize"):
        cmd = ["kustomize", "build", str(overlay)]
    elif shutil.which("kubectl"):
        cmd = ["kubectl", "kustomize", str(overlay)]
    else:
        raise AssertionError(
            "rendering deploy/k8s needs kubectl (its embedded kustomize) or kustomize on PATH; "
            "install kubectl from your distribution or kustomize, then rerun"
        )
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def promtool() -> str:
    path = shutil.which("promtool")
    assert path, "promtool not found: `make test` installs it (Debian package prometheus)"
    return path


def dashboard_queries(path: Path) -> list[str]:
    doc = json.loads(path.read_text())
    exprs: list[str] = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for p in panels:
            exprs.extend(t["expr"] for t in p.get("targets", []) if t.get("expr"))
            walk(p.get("panels", []))

    walk(doc["panels"])
    return exprs


def rule_queries(path: Path) -> list[str]:
    doc = yaml.safe_load(path.read_text())
    return [r["expr"] for g in doc["groups"] for r in g["rules"]]


def recorded_names(path: Path) -> set[str]:
    doc = yaml.safe_load(path.read_text())
    return {r["record"] for g in doc["groups"] for r in g["rules"] if "record" in r}


_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"')
_IDENT = re.compile(r"(?<![\w:])([a-zA-Z_:][a-zA-Z0-9_:]*)")
_NOT_METRICS = {
    # PromQL functions, aggregations, keywords and the label names we group by
    *"sum max min avg count rate increase irate histogram_quantile clamp_min clamp_max by without on "
    "ignoring group_left group_right offset and or unless bool abs deriv delta".split(),
    *"le state outcome platform reason queue instance job event vhost namespace scaledObject check gauges".split(),
    "inf",
    "Inf",
}


def metric_names(expr: str) -> set[str]:
    """Metric names used by a PromQL expression (label values and functions removed)."""
    text = _STRINGS.sub('""', expr)
    text = re.sub(r"\[[^\]]*\]", "", text)  # range selectors
    names = set()
    for m in _IDENT.finditer(text):
        word = m.group(1)
        rest = text[m.end() :].lstrip()
        if word in _NOT_METRICS or rest.startswith("("):
            continue
        if rest.startswith(("=", "!=", "=~", "!~")):  # a label matcher inside {...}
            continue
        if re.fullmatch(r"\d+[smhdwy]?", word):
            continue
        names.add(word)
    return names


def exported_chatq_metrics() -> set[str]:
    """Every sample name the three services can export."""
    from prometheus_client import REGISTRY

    import services.coalescer.service  # noqa: F401
    import shared.alerts
    import shared.metrics  # noqa: F401

    names: set[str] = set()
    for family in REGISTRY.collect():
        if not family.name.startswith("chatq_"):
            continue
        if family.type == "counter":
            names.add(family.name + "_total")
        elif family.type == "histogram":
            names.update(family.name + s for s in ("_bucket", "_sum", "_count"))
        else:
            names.add(family.name)
    return names


# KEDA keda.sh/v1alpha1, transcribed from its CRDs for the fields chatqueue uses; unknown
# fields are refused so a typo cannot pass. Trigger metadata keys: KEDA's RabbitMQ scaler.
RABBITMQ_TRIGGER_KEYS = {
    "host", "hostFromEnv", "protocol", "queueName", "mode", "value", "activationValue",
    "vhostName", "useRegex", "excludeUnacknowledged", "pageSize", "operation", "timeout", "unsafeSsl",
}  # fmt: skip
_INT = {"type": "integer", "minimum": 0}
SCALED_OBJECT_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "ScaledObject"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["scaleTargetRef", "triggers"],
            "properties": {
                "scaleTargetRef": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["name"],
                    "properties": {
                        "name": {"type": "string"},
                        "kind": {"type": "string"},
                        "apiVersion": {"type": "string"},
                        "envSourceContainerName": {"type": "string"},
                    },
                },
                "pollingInterval": _INT,
                "cooldownPeriod": _INT,
                "idleReplicaCount": _INT,
                "minReplicaCount": _INT,
                "maxReplicaCount": _INT,
                "fallback": {"type": "object"},
                "advanced": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "restoreToOriginalReplicaCount": {"type": "boolean"},
                        "horizontalPodAutoscalerConfig": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {"name": {"type": "string"}, "behavior": {"type": "object"}},
                        },
                        "scalingModifiers": {"type": "object"},
                    },
                },
                "triggers": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["type", "metadata"],
                        "properties": {
                            "type": {"type": "string"},
                            "name": {"type": "string"},
                            "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                            "useCachedMetrics": {"type": "boolean"},
                            "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
                            "authenticationRef": {
                                "type": "object",
                                "additionalProperties": False,
                                "required": ["name"],
                                "properties": {
                                    "name": {"type": "string"},
                                    "kind": {
                                        "enum": ["TriggerAuthentication", "ClusterTriggerAuthentication"]
                                    },
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}
TRIGGER_AUTHENTICATION_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "TriggerAuthentication"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "secretTargetRef": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["parameter", "name", "key"],
                        "properties": {
                            "parameter": {"type": "string"},
                            "name": {"type": "string"},
                            "key": {"type": "string"},
                        },
                    },
                },
                "env": {"type": "array"},
                "podIdentity": {"type": "object"},
            },
        },
    },
}


def kustomize_variant(
    overlay: Path, workdir: Path, *, literals: dict[str, str], image_tag: str
) -> list[dict[str, Any]]:
    """``overlay`` rendered as the next release would be: a kustomization in ``workdir``
    on top of it that changes some settings of chatqueue-config and the image tag."""
    import os

    images = {
        d["spec"]["template"]["spec"]["containers"][0]["image"].rsplit(":", 1)[0]
        for d in kustomize(overlay)
        if d["kind"] == "Deployment" and d["metadata"]["name"] != "chatqueue-postgres-exporter"
    }
    (workdir / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [os.path.relpath(overlay, workdir)],
                "configMapGenerator": [
                    {
                        "name": "chatqueue-config",
                        "behavior": "merge",
                        "literals": [f"{k}={v}" for k, v in literals.items()],
                    }
                ],
                "images": [{"name": name, "newTag": image_tag} for name in sorted(images)],
            }
        )
    )
    return kustomize(workdir)


# Fields Kubernetes refuses to change on an existing object ("field is immutable"), by
# kind; `kubectl apply` of a changed value fails. Kinds not listed here and not in
# MUTABLE_KINDS are refused by `apply_conflicts`, so a new kind must be classified.
IMMUTABLE_FIELDS: dict[str, list[tuple[str, ...]]] = {
    "Job": [("spec", "template"), ("spec", "selector"), ("spec", "completions"), ("spec", "completionMode")],
    "Deployment": [("spec", "selector")],
    "DaemonSet": [("spec", "selector")],
    "StatefulSet": [
        ("spec", "selector"), ("spec", "serviceName"), ("spec", "volumeClaimTemplates"),
        ("spec", "podManagementPolicy"),
    ],
    "Service": [("spec", "clusterIP"), ("spec", "clusterIPs")],
    "PersistentVolumeClaim": [("spec", "storageClassName"), ("spec", "accessModes"), ("spec", "selector")],
}  # fmt: skip
MUTABLE_KINDS = {
    "Namespace", "ServiceAccount", "ConfigMap", "Secret", "PodDisruptionBudget", "NetworkPolicy", "Ingress",
    "ScaledObject", "TriggerAuthentication", "PodMonitor", "ServiceMonitor", "PrometheusRule",
}  # fmt: skip


def _at(doc: dict[str, Any], path: tuple[str, ...]) -> Any:
    for key in path:
        doc = doc.get(key) if isinstance(doc, dict) else None  # type: ignore[assignment]
    return doc


def apply_conflicts(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> list[str]:
    """What `kubectl apply` of ``after`` would be refused for, in a namespace holding
    ``before``: an object of the same kind and name whose immutable field changed (an
    immutable ConfigMap or Secret included). Empty: the second apply is valid."""
    existing = {(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]): d for d in before}
    problems = []
    for doc in after:
        kind = doc["kind"]
        if kind not in IMMUTABLE_FIELDS and kind not in MUTABLE_KINDS:
            problems.append(f"{kind}: not classified in IMMUTABLE_FIELDS or MUTABLE_KINDS")
            continue
        old = existing.get((kind, doc["metadata"].get("namespace"), doc["metadata"]["name"]))
        if old is None:
            continue
        paths = list(IMMUTABLE_FIELDS.get(kind, []))
        if kind in {"ConfigMap", "Secret"} and old.get("immutable"):
            paths += [("data",), ("binaryData",), ("stringData",)]
        for path in paths:
            if _at(old, path) != _at(doc, path):
                problems.append(
                    f"{kind}/{doc['metadata']['name']}: {'.'.join(path)} is immutable and changed"
                )
    return problems


# prometheus-operator monitoring.coreos.com/v1, transcribed from its CRDs for the fields
# chatqueue uses; unknown fields are refused so a typo cannot pass.
_LABEL_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
        "matchExpressions": {"type": "array"},
    },
}
_METADATA = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string"},
        "namespace": {"type": "string"},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}
_DURATION = {
    "type": "string",
    "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
}


def _crd_schema(api_version: str, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    """A custom resource's schema: its apiVersion, kind and metadata, and ``spec``."""
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": api_version},
            "kind": {"const": kind},
            "metadata": _METADATA,
            "spec": spec,
        },
    }


POD_MONITOR_SCHEMA = _crd_schema(
    "monitoring.coreos.com/v1",
    "PodMonitor",
    {
        "type": "object",
        "additionalProperties": False,
        "required": ["selector"],
        "properties": {
            "selector": _LABEL_SELECTOR,
            "namespaceSelector": {"type": "object"},
            "jobLabel": {"type": "string"},
            "podTargetLabels": {"type": "array", "items": {"type": "string"}},
            "podMetricsEndpoints": {
                "type": "array",
                "items": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "port": {"type": "string"},
                        "path": {"type": "string"},
                        "scheme": {"enum": ["http", "https"]},
                        "interval": _DURATION,
                        "scrapeTimeout": _DURATION,
                        "honorLabels": {"type": "boolean"},
                        "relabelings": {"type": "array"},
                        "metricRelabelings": {"type": "array"},
                    },
                },
            },
        },
    },
)
PROMETHEUS_RULE_SCHEMA = _crd_schema(
    "monitoring.coreos.com/v1",
    "PrometheusRule",
    {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "groups": {
                "type": "array",
                "items": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["name", "rules"],
                    "properties": {
                        "name": {"type": "string", "minLength": 1},
                        "interval": _DURATION,
                        "rules": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "additionalProperties": False,
                                "required": ["expr"],
                                "oneOf": [{"required": ["alert"]}, {"required": ["record"]}],
                                "properties": {
                                    "alert": {"type": "string"},
                                    "record": {"type": "string"},
                                    "expr": {"type": ["string", "integer"]},
                                    "for": _DURATION,
                                    "keep_firing_for": _DURATION,
                                    "labels": {
                                        "type": "object",
                                        "additionalProperties": {"type": "string"},
                                    },
                                    "annotations": {
                                        "type": "object",
                                        "additionalProperties": {"type": "string"},
                                    },
                                },
                            },
                        },
                    },
                },
            }
        },
    },
)
RABBITMQ_CLUSTER_SCHEMA = _crd_schema(
    "rabbitmq.com/v1beta1",
    "RabbitmqCluster",
    # The RabbitMQ Cluster Operator's CRD (v1beta1), the fields a manifest sets.
    {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "replicas": {"type": "integer", "minimum": 0},
            "image": {"type": "string"},
            "imagePullSecrets": {"type": "array"},
            "service": {"type": "object"},
            "persistence": {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "storageClassName": {"type": "string"},
                    "storage": {"type": ["string", "integer"]},
                },
            },
            "resources": {
                "type": "object",
                "additionalProperties": False,
                "properties": {"limits": {"type": "object"}, "requests": {"type": "object"}},
            },
            "affinity": {"type": "object"},
            "tolerations": {"type": "array"},
            "rabbitmq": {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "additionalConfig": {"type": "string", "maxLength": 2000},
                    "advancedConfig": {"type": "string", "maxLength": 100000},
                    "envConfig": {"type": "string", "maxLength": 100000},
                    "erlangInetConfig": {"type": "string", "maxLength": 2000},
                    "additionalPlugins": {
                        "type": "array",
                        "maxItems": 100,
                        "items": {"type": "string", "pattern": "^\\w+$"},
                    },
                },
            },
            "tls": {"type": "object"},
            "override": {"type": "object"},
            "skipPostDeploySteps": {"type": "boolean"},
            "terminationGracePeriodSeconds": {"type": "integer", "minimum": 0},
            "delayStartSeconds": {"type": "integer", "minimum": 0},
            "secretBackend": {"type": "object"},
        },
    },
)
CUSTOM_SCHEMAS = {
    ("rabbitmq.com/v1beta1", "RabbitmqCluster"): RABBITMQ_CLUSTER_SCHEMA,
    ("keda.sh/v1alpha1", "ScaledObject"): SCALED_OBJECT_SCHEMA,
    ("keda.sh/v1alpha1", "TriggerAuthentication"): TRIGGER_AUTHENTICATION_SCHEMA,
    ("monitoring.coreos.com/v1", "PodMonitor"): POD_MONITOR_SCHEMA,
    ("monitoring.coreos.com/v1", "PrometheusRule"): PROMETHEUS_RULE_SCHEMA,
}


def validate_object(doc: dict[str, Any], kubernetes_version: str) -> None:
    """Strict validation of one rendered object: Kubernetes' own kinds against the
    version's OpenAPI schemas (kubernetes-validate), the CRD kinds we use against the
    schemas transcribed above. Raises AssertionError naming the object and the field."""
    import jsonschema
    import kubernetes_validate

    where = f"{doc['kind']}/{doc['metadata']['name']}"
    schema = CUSTOM_SCHEMAS.get((doc["apiVersion"], doc["kind"]))
    if schema is not None:
        try:
            jsonschema.validate(doc, schema)
        except jsonschema.ValidationError as exc:
            raise AssertionError(f"{where}: {exc.message} at {list(exc.path)}") from exc
        return
    assert "." not in doc["apiVersion"].split("/")[0] or doc["apiVersion"].split("/")[0].endswith(
        ".k8s.io"
    ), f"{where}: {doc['apiVersion']} is a custom resource with no schema here"
    try:
        kubernetes_validate.validate(doc, kubernetes_version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        raise AssertionError(f"{where}: {exc.message} at {list(exc.path)}") from exc


def interpolated(text: str, values: dict[str, str]) -> str:
    """``text`` as docker compose interpolates it from ``values``: ``$$``, ``${NAME}``,
    ``${NAME:-default}`` (the default itself interpolated, so defaults nest),
    ``${NAME-default}``, ``${NAME:?message}`` (an AssertionError with the message when
    unset or empty) and ``$NAME``."""
    out: list[str] = []
    i = 0
    while i < len(text):
        if text.startswith("$$", i):
            out.append("$")
            i += 2
        elif text.startswith("${", i):
            depth, j = 1, i + 2
            while depth:
                if text.startswith("${", j):
                    depth, j = depth + 1, j + 2
                    continue
                depth -= text[j] == "}"
                j += 1
            inner = text[i + 2 : j - 1]
            name = re.match(r"[A-Za-z_][A-Za-z0-9_]*", inner)
            assert name, f"bad interpolation ${{{inner}}}"
            key, rest = name.group(0), inner[name.end() :]
            value = values.get(key)
            if rest.startswith(":-"):
                out.append(value if value else interpolated(rest[2:], values))
            elif rest.startswith("-"):
                out.append(value if value is not None else interpolated(rest[1:], values))
            elif rest.startswith(":?"):
                assert value, f"compose refuses: {key}: {rest[2:]}"
                out.append(value)
            else:
                assert not rest, f"interpolation not understood: ${{{inner}}}"
                out.append(value or "")
            i = j
        elif text[i] == "$" and re.match(r"[A-Za-z_]", text[i + 1 : i + 2]):
            name = re.match(r"[A-Za-z_][A-Za-z0-9_]*", text[i + 1 :])
            assert name
            out.append(values.get(name.group(0), ""))
            i += 1 + name.end()
        else:
            out.append(text[i])
            i += 1
    return "".join(out)
