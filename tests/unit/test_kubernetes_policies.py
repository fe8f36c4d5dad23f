"""The prod overlay and the RabbitMQ cluster, as they would run in a namespace that
enforces Pod Security "restricted" and a default-deny NetworkPolicy: every flow the
deployment needs is allowed and nothing else (tests/support/network_policy.py evaluates
the rendered policies), every pod template is admitted (tests/support/pod_security.py),
the RabbitMQ Cluster Operator's pods included; KEDA keeps a replica count when blind and
says what it scales on in one place. No cluster is reachable here: these evaluators stand
in for the CNI and the admission controller (docs/deploying.md "What runs where")."""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.support.deploy_files import DEPLOY, ROOT, kustomize
from tests.support.network_policy import Cluster, Endpoint, matrix, pod_of, policy_ports, selects
from tests.support.pod_security import operator_pod, restricted_violations

pytestmark = pytest.mark.unit

PROD = DEPLOY / "k8s" / "overlays" / "prod"
DEV = DEPLOY / "k8s" / "overlays" / "dev"
RABBITMQ = DEPLOY / "k8s" / "rabbitmq"
NAMESPACE = "chatqueue"
SERVICES = ("receiver", "coalescer", "responder")


def rendered() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    return kustomize(PROD), kustomize(RABBITMQ)


def world() -> tuple[Cluster, list[Endpoint]]:
    """The prod overlay and deploy/k8s/rabbitmq in namespace chatqueue, and what is around
    them in a typical cluster: the Ingress controller, Prometheus, KEDA, CoreDNS, a pod of
    another application, a stray pod in our namespace, the API server, the Internet and a
    managed Postgres."""
    prod, rabbitmq = rendered()
    policies = [d for d in prod + rabbitmq if d["kind"] == "NetworkPolicy"]
    assert {p["metadata"].get("namespace") for p in policies} == {NAMESPACE}
    pods = [
        pod_of(
            d["spec"]["template"],
            d["metadata"]["name"].removeprefix("chatqueue-"),
            NAMESPACE,
            f"10.244.1.{i}",
        )
        for i, d in enumerate((d for d in prod if d["kind"] == "Deployment"), start=10)
    ]
    (cluster,) = [d for d in rabbitmq if d["kind"] == "RabbitmqCluster"]
    for n in (0, 1):
        template = operator_pod(cluster, "2.16")
        rabbit = pod_of(template, f"rabbitmq-{n}", NAMESPACE, f"10.244.2.{n}")
        # Erlang distribution listens on 25672 without a containerPort of its own.
        pods.append(
            Endpoint(rabbit.name, rabbit.ip, NAMESPACE, rabbit.labels, (*rabbit.ports, (None, 25672, "TCP")))
        )
    tcp = "TCP"
    pods += [
        Endpoint("ingress-nginx", "10.244.3.1", "ingress-nginx", {"app.kubernetes.io/name": "ingress-nginx"}),
        Endpoint("prometheus", "10.244.3.2", "monitoring", {"app.kubernetes.io/name": "prometheus"}),
        Endpoint("keda-operator", "10.244.3.3", "keda", {"app": "keda-operator"}),
        Endpoint(
            "coredns",
            "10.244.3.4",
            "kube-system",
            {"k8s-app": "kube-dns"},
            (("dns", 53, "UDP"), ("dns-tcp", 53, tcp)),
        ),
        Endpoint(
            "metrics-server",
            "10.244.3.5",
            "kube-system",
            {"k8s-app": "metrics-server"},
            (("https", 443, tcp),),
        ),
        Endpoint(
            "other-app", "10.244.4.1", "shop", {"app": "shop"}, (("http", 8080, tcp), ("https", 443, tcp))
        ),
        Endpoint("stray-pod", "10.244.1.99", NAMESPACE, {"run": "debug"}, (("http", 8080, tcp),)),
        Endpoint("kubernetes-service", "10.96.0.1", None, ports=((None, 443, tcp),)),
        Endpoint("kube-apiserver", "172.20.0.1", None, ports=((None, 443, tcp), (None, 6443, tcp))),
        Endpoint("managed-postgres", "10.10.0.5", None, ports=((None, 5432, tcp),)),
        Endpoint("internet", "203.0.113.10", None),
    ]
    namespaces = {n: {} for n in (NAMESPACE, "ingress-nginx", "monitoring", "keda", "kube-system", "shop")}
    return Cluster(policies, namespaces), pods


INTERNET_PORTS = {(p, "TCP") for p in (22, 53, 80, 443, 5432, 5672, 6443, 8080)} | {(53, "UDP")}


def allowed_flows() -> set[tuple[str, str, int, str]]:
    """What the policies allow, where our namespace is one end: pods on the ports they
    listen on, the Internet on INTERNET_PORTS."""
    cluster, endpoints = world()
    ours = {e.name for e in endpoints if e.namespace == NAMESPACE}
    listening = matrix(cluster, endpoints, set())
    internet = {
        f
        for f in matrix(cluster, endpoints, INTERNET_PORTS | policy_ports(cluster.policies))
        if f[1] == "internet"
    }
    return {f for f in listening | internet if f[0] in ours or f[1] in ours}


def needed_flows() -> set[tuple[str, str, int, str]]:
    """Every flow the deployment needs, and why."""
    flows: set[tuple[str, str, int, str]] = set()
    rabbits = ("rabbitmq-0", "rabbitmq-1")

    def add(src: str, dst: str, *ports: int, protocol: str = "TCP") -> None:
        flows.update((src, dst, p, protocol) for p in ports)

    add("ingress-nginx", "receiver", 8080)  # the webhooks
    add("prometheus", "receiver", 8081)  # /metrics on the admin port
    add("prometheus", "coalescer", 9100)
    add("prometheus", "responder", 9100)
    add("prometheus", "postgres-exporter", 9187)
    for r in rabbits:
        add("prometheus", r, 15692)  # rabbitmq_prometheus
        add("keda-operator", r, 15672)  # queue lengths
        add(r, "coredns", 53, protocol="UDP")
        add(r, "coredns", 53)
        add(r, "kubernetes-service", 443)  # peer discovery: the API through its Service
        add(r, "kube-apiserver", 6443)  # or the API server itself, past the Service
        other = rabbits[1 - rabbits.index(r)]
        add(r, other, 4369, 25672)  # clustering
    for s in SERVICES:
        for r in rabbits:
            add(s, r, 5672)
        add(s, "managed-postgres", 5432)
        add(s, "internet", 443, 5432, 5672)  # platforms, model; a database or broker outside
        add(s, "coredns", 53, protocol="UDP")
        add(s, "coredns", 53)
    add("postgres-exporter", "managed-postgres", 5432)
    add("postgres-exporter", "internet", 5432)
    add("postgres-exporter", "coredns", 53, protocol="UDP")
    add("postgres-exporter", "coredns", 53)
    add("stray-pod", "coredns", 53, protocol="UDP")  # every pod of the namespace resolves names
    add("stray-pod", "coredns", 53)
    return flows


def test_the_network_policies_allow_every_needed_flow_and_nothing_else() -> None:
    allowed, needed = allowed_flows(), needed_flows()
    print("\nallowed flows (source -> destination:port/protocol):")
    for src, dst, port, proto in sorted(allowed):
        print(f"  {src:18} -> {dst}:{port}/{proto}")
    assert not needed - allowed, f"needed but cut: {sorted(needed - allowed)}"
    assert not allowed - needed, f"allowed but not needed: {sorted(allowed - needed)}"


def test_without_the_rabbitmq_allows_the_default_deny_cuts_the_broker_off() -> None:
    """What the issue found: the prod overlay's default deny selects the RabbitMQ pods too."""
    cluster, endpoints = world()
    base_only = Cluster(
        [p for p in cluster.policies if not p["metadata"]["name"].startswith("chatq-rabbitmq")], {}
    )
    by_name = {e.name: e for e in endpoints}
    cut = [
        (by_name["responder"], by_name["rabbitmq-0"], 5672),
        (by_name["rabbitmq-0"], by_name["rabbitmq-1"], 25672),
        (by_name["keda-operator"], by_name["rabbitmq-0"], 15672),
        (by_name["prometheus"], by_name["rabbitmq-0"], 15692),
    ]
    for src, dst, port in cut:
        assert not base_only.allowed(src, dst, port), (src.name, dst.name, port)
        assert cluster.allowed(src, dst, port), (src.name, dst.name, port)


def test_the_evaluator_follows_the_api_semantics_it_relies_on() -> None:
    """A check of the checker on hand-made policies: named ports resolve on the
    destination, a namespaceSelector with a podSelector in one peer is an AND, two peers
    are an OR, ipBlock excepts, a pod no policy selects is open, policyTypes default."""
    web = Endpoint("web", "10.0.0.1", "a", {"app": "web"}, (("http", 8080, "TCP"),))
    db = Endpoint("db", "10.0.0.2", "a", {"app": "db"}, (("pg", 5432, "TCP"),))
    mon = Endpoint("mon", "10.0.1.1", "m", {"app": "prom"})
    other = Endpoint("other", "10.0.1.2", "m", {"app": "other"})
    outside = Endpoint("outside", "203.0.113.5", None)

    def policy(spec: dict[str, Any], namespace: str = "a") -> dict[str, Any]:
        return {"metadata": {"name": "p", "namespace": namespace}, "spec": spec}

    and_peer = policy(
        {
            "podSelector": {"matchLabels": {"app": "web"}},
            "ingress": [
                {
                    "from": [
                        {
                            "namespaceSelector": {"matchLabels": {"team": "m"}},
                            "podSelector": {"matchLabels": {"app": "prom"}},
                        }
                    ],
                    "ports": [{"port": "http"}],
                }
            ],
        }
    )
    c = Cluster([and_peer], {"m": {"team": "m"}})
    assert c.allowed(mon, web, 8080) and not c.allowed(other, web, 8080)
    assert not c.allowed(mon, web, 8081), "a named port resolves to the destination's number only"
    assert c.allowed(other, db, 5432), "a pod no policy selects is not isolated"
    assert c.allowed(web, outside, 22), "policyTypes defaults to Ingress only: egress stays open"
    or_peers = policy(
        {
            "podSelector": {"matchLabels": {"app": "web"}},
            "ingress": [
                {
                    "from": [
                        {"namespaceSelector": {"matchLabels": {"team": "m"}}},
                        {"podSelector": {"matchLabels": {"app": "prom"}}},
                    ]
                }
            ],
        }
    )
    c = Cluster([or_peers], {"m": {"team": "m"}})
    assert c.allowed(other, web, 8080), "two peers: either one"
    blocked = policy(
        {
            "podSelector": {},
            "policyTypes": ["Egress"],
            "egress": [
                {
                    "to": [{"ipBlock": {"cidr": "0.0.0.0/0", "except": ["203.0.113.0/24"]}}],
                    "ports": [{"port": 443, "protocol": "TCP"}],
                }
            ],
        }
    )
    c = Cluster([blocked], {})
    assert not c.allowed(web, outside, 443) and not c.allowed(web, outside, 80)
    assert c.allowed(web, Endpoint("x", "198.51.100.1", None), 443)
    assert not c.allowed(web, Endpoint("x", "198.51.100.1", None), 443, "UDP"), "the protocol counts"
    assert selects({}, {"a": "b"}) and not selects(None, {"a": "b"})
    assert selects({"matchExpressions": [{"key": "k", "operator": "NotIn", "values": ["x"]}]}, {})
    assert not selects({"matchExpressions": [{"key": "k", "operator": "Exists"}]}, {})


# ---- Pod Security "restricted" ----------------------------------------------------------


def pod_templates() -> list[tuple[str, dict[str, Any]]]:
    """Every pod template of both overlays, and the RabbitMQ pods the operator makes."""
    out = []
    for overlay in (DEV, PROD):
        for d in kustomize(overlay):
            if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
                out.append((f"{overlay.name}/{d['kind']}/{d['metadata']['name']}", d["spec"]["template"]))
    (cluster,) = [d for d in kustomize(RABBITMQ) if d["kind"] == "RabbitmqCluster"]
    for operator in ("2.16", "2.17"):
        out.append(
            (f"rabbitmq/operator {operator}/{cluster['metadata']['name']}", operator_pod(cluster, operator))
        )
    return out


def test_every_pod_the_deployment_makes_is_admitted_under_pod_security_restricted() -> None:
    namespace = next(d for d in kustomize(PROD) if d["kind"] == "Namespace")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    refused = {}
    print()
    for name, template in pod_templates():
        problems = restricted_violations(template["spec"], template["metadata"].get("annotations"))
        containers = [
            c["name"] for k in ("initContainers", "containers") for c in template["spec"].get(k, [])
        ]
        print(f"  {name:58} containers {', '.join(containers):40} {'admitted' if not problems else problems}")
        if problems:
            refused[name] = problems
    assert not refused, refused
    assert len(pod_templates()) == 9, "dev: 3 services; prod: 3 and the exporter; RabbitMQ's, two operators"


def test_the_rabbitmq_operators_pods_are_refused_without_the_override() -> None:
    (cluster,) = [d for d in kustomize(RABBITMQ) if d["kind"] == "RabbitmqCluster"]
    problems = restricted_violations(operator_pod(cluster, "2.16", with_override=False)["spec"])
    for expected in (
        "initContainers setup-container: allowPrivilegeEscalation is not false",
        "containers rabbitmq: runAsNonRoot is not true (neither the container nor the pod sets it)",
        "containers rabbitmq: seccompProfile is not RuntimeDefault or Localhost",
        "initContainers setup-container: capabilities do not drop ALL",
    ):
        assert expected in problems, problems


def test_the_restricted_check_refuses_what_the_standard_refuses() -> None:
    good = kustomize(PROD)
    receiver = next(
        d for d in good if d["kind"] == "Deployment" and d["metadata"]["name"] == "chatqueue-receiver"
    )
    spec = receiver["spec"]["template"]["spec"]
    assert restricted_violations(spec) == []
    import copy

    for mutate, expected in [
        (
            lambda s: s["containers"][0]["securityContext"].update(allowPrivilegeEscalation=True),
            "allowPrivilegeEscalation",
        ),
        (lambda s: s["initContainers"][0]["securityContext"].pop("capabilities"), "drop ALL"),
        (lambda s: s["securityContext"].pop("runAsNonRoot"), "runAsNonRoot"),
        (lambda s: s["securityContext"].update(runAsUser=0), "runAsUser 0"),
        (lambda s: s["securityContext"].pop("seccompProfile"), "seccompProfile"),
        (lambda s: s.update(hostNetwork=True), "hostNetwork"),
        (lambda s: s.setdefault("volumes", []).append({"name": "h", "hostPath": {"path": "/"}}), "hostPath"),
        (
            lambda s: s["containers"][0]["securityContext"].update(
                capabilities={"drop": ["ALL"], "add": ["NET_ADMIN"]}
            ),
            "capabilities",
        ),
        (lambda s: s["containers"][0]["ports"].append({"containerPort": 1, "hostPort": 80}), "hostPort"),
        (lambda s: s["containers"][0]["securityContext"].update(runAsNonRoot=False), "runAsNonRoot"),
        (
            lambda s: s["containers"][0]["securityContext"].update(seccompProfile={"type": "Unconfined"}),
            "Unconfined",
        ),
        (
            lambda s: s.setdefault("volumes", []).append({"name": "n", "nfs": {"server": "x", "path": "/"}}),
            "nfs",
        ),
    ]:
        broken = copy.deepcopy(spec)
        mutate(broken)
        assert any(expected in p for p in restricted_violations(broken)), expected
    unconfined = {"container.apparmor.security.beta.kubernetes.io/receiver": "unconfined"}
    assert restricted_violations(spec, unconfined) == [
        "annotation container.apparmor.security.beta.kubernetes.io/receiver: unconfined"
    ]


# ---- KEDA ---------------------------------------------------------------------------------


def test_keda_holds_a_fallback_when_blind_and_the_docs_state_the_same_targets() -> None:
    docs = kustomize(PROD)
    scaled = {d["spec"]["scaleTargetRef"]["name"]: d for d in docs if d["kind"] == "ScaledObject"}
    text = (ROOT / "docs" / "deploying.md").read_text()
    for name, obj in scaled.items():
        spec = obj["spec"]
        fallback = spec["fallback"]
        assert fallback["failureThreshold"] >= 1
        assert spec["minReplicaCount"] <= fallback["replicas"] <= spec["maxReplicaCount"], name
        (trigger,) = spec["triggers"]
        assert trigger.get("metricType", "AverageValue") == "AverageValue", "fallback needs AverageValue"
        target = trigger["metadata"]["value"]
        queue = trigger["metadata"]["queueName"]
        documented = re.search(rf"scales on `{re.escape(queue)}` \((\d+) messages", text)
        assert documented, f"docs/deploying.md does not state {queue}'s target"
        assert documented.group(1) == target, f"{queue}: docs say {documented.group(1)}, keda.yaml {target}"
        span = re.search(rf"`{re.escape(queue)}` \(\d+ messages[^)]*\), (\d+)-(\d+)\s+replicas", text)
        assert span and (int(span.group(1)), int(span.group(2))) == (
            spec["minReplicaCount"],
            spec["maxReplicaCount"],
        )
    responder = scaled["chatqueue-responder"]["spec"]["triggers"][0]["metadata"]["value"]
    config = next(d for d in docs if d["kind"] == "ConfigMap")["data"]
    assert int(responder) >= int(config["CHATQ_RESPONDER_CONCURRENCY"]), (
        "a busy responder's own jobs do not scale it up"
    )
    script = (DEPLOY / "rabbitmq" / "add-monitoring-user.sh").read_text()
    assert "set_user_tags" in script and "set_permissions" in script and "'^$' '^$' '^$'" in script
