"""An evaluator of Kubernetes NetworkPolicies (networking.k8s.io/v1), for the rendered
manifests: given the policies, the pods (labels, namespace, container ports) and the
namespaces' labels, whether a connection from one endpoint to another on a port is
allowed. No cluster is reachable here, so this stands in for a CNI that enforces the API's
semantics, as the Kubernetes documentation states them:

- A pod is isolated for ingress (egress) when a policy of its namespace selects it and
  has Ingress (Egress) in its policyTypes; policyTypes defaults to Ingress, plus Egress
  when the policy has an egress section. A pod no policy isolates allows everything.
- An isolated pod allows a connection when at least one rule of one policy selecting it
  allows it (policies add up; nothing denies). A connection needs both the source's
  egress and the destination's ingress.
- A rule with no (or empty) from/to matches every peer; with no (or empty) ports, every
  port. A peer: podSelector alone (pods of the policy's namespace), namespaceSelector
  alone (every pod of the matching namespaces), both in one element (those pods of those
  namespaces), or ipBlock (addresses in the CIDR but not in its excepts; for a pod, its
  IP). An empty selector ({}) matches everything; matchLabels and matchExpressions (In,
  NotIn, Exists, DoesNotExist) are ANDed.
- A port: protocol (TCP when unset), a number or a named port (resolved against the
  destination pod's container ports, for ingress and egress alike), endPort for a range.
- Endpoints outside the cluster (the Internet, a managed database) have an address and
  no labels: only ipBlock peers match them.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Endpoint:
    """A pod (namespace set) or an address outside the cluster (namespace None)."""

    name: str
    ip: str
    namespace: str | None = None
    labels: dict[str, str] = field(default_factory=dict, hash=False, compare=False)
    #: (name or None, port, protocol) of the ports it listens on.
    ports: tuple[tuple[str | None, int, str], ...] = ()

    @property
    def is_pod(self) -> bool:
        return self.namespace is not None

    def port_named(self, name: str, protocol: str) -> int | None:
        for port_name, number, proto in self.ports:
            if port_name == name and proto == protocol:
                return number
        return None


def selects(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    """A LabelSelector against labels; None (absent) matches nothing, {} everything."""
    if selector is None:
        return False
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
        if op not in ("In", "NotIn", "Exists", "DoesNotExist"):
            raise ValueError(f"unknown selector operator {op}")
    return True


@dataclass
class Cluster:
    policies: list[dict[str, Any]]
    #: namespace name -> its labels (kubernetes.io/metadata.name is added for each).
    namespaces: dict[str, dict[str, str]]

    def namespace_labels(self, name: str) -> dict[str, str]:
        return {**self.namespaces.get(name, {}), "kubernetes.io/metadata.name": name}

    def _policies_of(self, pod: Endpoint, direction: str) -> list[dict[str, Any]]:
        out = []
        for p in self.policies:
            meta, spec = p["metadata"], p["spec"]
            if meta.get("namespace") != pod.namespace:
                continue
            types = spec.get("policyTypes") or (["Ingress"] + (["Egress"] if "egress" in spec else []))
            if direction in types and selects(spec.get("podSelector", {}), pod.labels):
                out.append(p)
        return out

    def _peer_matches(self, peer: dict[str, Any], policy_namespace: str, other: Endpoint) -> bool:
        if "ipBlock" in peer:
            block = peer["ipBlock"]
            address = ipaddress.ip_address(other.ip)
            if address not in ipaddress.ip_network(block["cidr"]):
                return False
            return not any(address in ipaddress.ip_network(e) for e in block.get("except") or [])
        if not other.is_pod:
            return False
        pod_selector = peer.get("podSelector")
        namespace_selector = peer.get("namespaceSelector")
        if namespace_selector is None:
            return other.namespace == policy_namespace and selects(pod_selector, other.labels)
        assert other.namespace is not None
        if not selects(namespace_selector, self.namespace_labels(other.namespace)):
            return False
        return pod_selector is None or selects(pod_selector, other.labels)

    @staticmethod
    def _port_matches(
        rule_ports: list[dict[str, Any]] | None, dst: Endpoint, port: int, protocol: str
    ) -> bool:
        if not rule_ports:
            return True
        for p in rule_ports:
            if p.get("protocol", "TCP") != protocol:
                continue
            if "port" not in p:
                return True
            value = p["port"]
            if isinstance(value, str) and not value.isdigit():
                number = dst.port_named(value, protocol) if dst.is_pod else None
                if number == port:
                    return True
                continue
            low = int(value)
            if low <= port <= int(p.get("endPort", low)):
                return True
        return False

    def _allowed_one_way(
        self, pod: Endpoint, other: Endpoint, dst: Endpoint, port: int, protocol: str, direction: str
    ) -> bool:
        """Whether ``pod``'s policies of ``direction`` let the connection with ``other``."""
        policies = self._policies_of(pod, direction)
        if not policies:
            return True
        key, peers_key = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
        for p in policies:
            namespace = p["metadata"]["namespace"]
            for rule in p["spec"].get(key) or []:
                peers = rule.get(peers_key)
                if peers and not any(self._peer_matches(peer, namespace, other) for peer in peers):
                    continue
                if self._port_matches(rule.get("ports"), dst, port, protocol):
                    return True
        return False

    def allowed(self, src: Endpoint, dst: Endpoint, port: int, protocol: str = "TCP") -> bool:
        """Whether a connection from ``src`` to ``dst``:``port`` gets through."""
        if src.is_pod and not self._allowed_one_way(src, dst, dst, port, protocol, "Egress"):
            return False
        return not dst.is_pod or self._allowed_one_way(dst, src, dst, port, protocol, "Ingress")


def pod_of(template: dict[str, Any], name: str, namespace: str, ip: str) -> Endpoint:
    """An Endpoint for a Deployment's (or any) pod template."""
    ports = tuple(
        (p.get("name"), p["containerPort"], p.get("protocol", "TCP"))
        for c in template["spec"]["containers"]
        for p in c.get("ports", [])
    )
    return Endpoint(name, ip, namespace, dict(template["metadata"].get("labels", {})), ports)


def policy_ports(policies: list[dict[str, Any]]) -> set[tuple[int, str]]:
    """Every numbered port (and each end of a range) the policies name."""
    out = set()
    for p in policies:
        for key in ("ingress", "egress"):
            for rule in p["spec"].get(key) or []:
                for port in rule.get("ports") or []:
                    value = port.get("port")
                    if isinstance(value, int) or (isinstance(value, str) and value.isdigit()):
                        out.add((int(value), port.get("protocol", "TCP")))
                        if "endPort" in port:
                            out.add((int(port["endPort"]), port.get("protocol", "TCP")))
    return out


def matrix(
    cluster: Cluster, endpoints: list[Endpoint], ports: set[tuple[int, str]]
) -> set[tuple[str, str, int, str]]:
    """Every (source, destination, port, protocol) allowed between distinct endpoints, over
    ``ports`` and each destination's own."""
    out = set()
    for dst in endpoints:
        probes = ports | {(n, proto) for _, n, proto in dst.ports}
        for src in endpoints:
            if src is dst:
                continue
            for number, protocol in sorted(probes):
                if cluster.allowed(src, dst, number, protocol):
                    out.add((src.name, dst.name, number, protocol))
    return out
