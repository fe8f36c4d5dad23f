"""Write deploy/k8s/components/monitoring/prometheus-rule.yaml: the alert rules of
deploy/prometheus/rules/*.yml wrapped in a PrometheusRule for the kube-prometheus stack,
so compose and Kubernetes alert on the same rules (a test keeps the file current).

    python deploy/prometheus/build_k8s_rules.py
"""

from __future__ import annotations

from pathlib import Path

import yaml

DEPLOY = Path(__file__).resolve().parents[1]
RULES = DEPLOY / "prometheus" / "rules"
OUTPUT = DEPLOY / "k8s" / "components" / "monitoring" / "prometheus-rule.yaml"


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the folded expressions and descriptions) as literal blocks."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def render() -> str:
    groups = [g for path in sorted(RULES.glob("*.yml")) for g in yaml.safe_load(path.read_text())["groups"]]
    doc = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "chatqueue"},
        "spec": {"groups": groups},
    }
    header = "# Generated from deploy/prometheus/rules by deploy/prometheus/build_k8s_rules.py: edit those.\n"
    return header + yaml.dump(doc, Dumper=_Dumper, sort_keys=False, width=110)


if __name__ == "__main__":
    OUTPUT.write_text(render())
    print(f"wrote {OUTPUT.relative_to(DEPLOY.parent)}")
