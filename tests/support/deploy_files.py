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
    *"le state outcome platform reason queue instance job event vhost".split(),
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
