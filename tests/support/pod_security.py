"""The Pod Security Standards' "restricted" profile (Kubernetes 1.30, version "latest"),
as the pod-security admission controller applies it to a pod, over a pod template: no
cluster is reachable here, so this stands in for the namespace's
``pod-security.kubernetes.io/enforce: restricted``. Each check is one control of the
standard (kubernetes.io/docs/concepts/security/pod-security-standards), baseline's and
restricted's.

And the pods the RabbitMQ Cluster Operator makes, which are not in our manifests: its pod
template as its source builds it (internal/resource/statefulset.go; the security-relevant
parts, before and since 2.17, which added a security context of its own), with the
RabbitmqCluster's ``override`` merged the way the operator merges it (a strategic merge:
maps key by key, containers, init containers and volumes by name)."""

from __future__ import annotations

import copy
from typing import Any

BASELINE_CAPABILITIES = {
    "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE",
    "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
}  # fmt: skip
RESTRICTED_VOLUMES = {
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret",
}  # fmt: skip
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}  # fmt: skip
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}


def restricted_violations(pod_spec: dict[str, Any], annotations: dict[str, str] | None = None) -> list[str]:
    """What the restricted profile refuses in a pod spec (and its template's annotations:
    AppArmor's, before Kubernetes 1.30's field), one line each (empty: admitted)."""
    out: list[str] = []
    for key, value in (annotations or {}).items():
        if key.startswith("container.apparmor.security.beta.kubernetes.io/") and not (
            value == "runtime/default" or value.startswith("localhost/")
        ):
            out.append(f"annotation {key}: {value}")
    pod_sc = pod_spec.get("securityContext") or {}
    containers = [
        (kind, c)
        for kind in ("initContainers", "containers", "ephemeralContainers")
        for c in pod_spec.get(kind) or []
    ]

    # -- baseline --
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod_spec.get(field):
            out.append(f"{field}: true")
    if (pod_sc.get("windowsOptions") or {}).get("hostProcess"):
        out.append("pod hostProcess")
    for volume in pod_spec.get("volumes") or []:
        if "hostPath" in volume:
            out.append(f"volume {volume['name']}: hostPath")
    for sysctl in pod_sc.get("sysctls") or []:
        if sysctl["name"] not in SAFE_SYSCTLS:
            out.append(f"sysctl {sysctl['name']}")
    for where, sc in [("pod", pod_sc)] + [
        (f"{k} {c['name']}", c.get("securityContext") or {}) for k, c in containers
    ]:
        se = sc.get("seLinuxOptions") or {}
        if se.get("type", "") not in SELINUX_TYPES or se.get("user") or se.get("role"):
            out.append(f"{where}: seLinuxOptions {se}")
        if (sc.get("seccompProfile") or {}).get("type") == "Unconfined":
            out.append(f"{where}: seccompProfile Unconfined")
        apparmor = (sc.get("appArmorProfile") or {}).get("type")
        if apparmor not in (None, "RuntimeDefault", "Localhost"):
            out.append(f"{where}: appArmorProfile {apparmor}")
    for kind, c in containers:
        name, sc = f"{kind} {c['name']}", c.get("securityContext") or {}
        if sc.get("privileged"):
            out.append(f"{name}: privileged")
        if (sc.get("windowsOptions") or {}).get("hostProcess"):
            out.append(f"{name}: hostProcess")
        if sc.get("procMount", "Default") != "Default":
            out.append(f"{name}: procMount {sc['procMount']}")
        for port in c.get("ports") or []:
            if port.get("hostPort"):
                out.append(f"{name}: hostPort {port['hostPort']}")
        added = set((sc.get("capabilities") or {}).get("add") or [])
        if added - BASELINE_CAPABILITIES:
            out.append(f"{name}: adds capabilities {sorted(added - BASELINE_CAPABILITIES)}")

    # -- restricted --
    for volume in pod_spec.get("volumes") or []:
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            out.append(f"volume {volume['name']}: type {sorted(kinds - RESTRICTED_VOLUMES)}")
    pod_non_root = pod_sc.get("runAsNonRoot") is True
    pod_seccomp = (pod_sc.get("seccompProfile") or {}).get("type")
    if pod_sc.get("runAsUser") == 0:
        out.append("pod: runAsUser 0")
    for kind, c in containers:
        name, sc = f"{kind} {c['name']}", c.get("securityContext") or {}
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{name}: allowPrivilegeEscalation is not false")
        non_root = sc.get("runAsNonRoot")
        if non_root is False or (non_root is None and not pod_non_root):
            out.append(f"{name}: runAsNonRoot is not true (neither the container nor the pod sets it)")
        if sc.get("runAsUser") == 0:
            out.append(f"{name}: runAsUser 0")
        seccomp = (sc.get("seccompProfile") or {}).get("type") or pod_seccomp
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{name}: seccompProfile is not RuntimeDefault or Localhost")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"{name}: capabilities do not drop ALL")
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            out.append(f"{name}: adds capabilities beyond NET_BIND_SERVICE")
    return out


# ---- the RabbitMQ Cluster Operator's pods ---------------------------------------------------

RABBITMQ_PORTS = [
    {"name": "epmd", "containerPort": 4369},
    {"name": "amqp", "containerPort": 5672},
    {"name": "management", "containerPort": 15672},
    {"name": "prometheus", "containerPort": 15692},
]
_RESTRICTED_CONTAINER = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "privileged": False,
    "readOnlyRootFilesystem": True,
    "runAsNonRoot": True,
    "seccompProfile": {"type": "RuntimeDefault"},
}


def operator_pod_template(cluster: dict[str, Any], operator: str) -> dict[str, Any]:
    """The pod template the Cluster Operator builds for ``cluster`` (a RabbitmqCluster),
    before its override: ``operator`` "2.16" (every 2.x before 2.17: the pod runs as 999
    with fsGroup 0 and nothing else) or "2.17" (since, restricted by default)."""
    name = cluster["metadata"]["name"]
    image = cluster["spec"].get("image", "rabbitmq")
    pod_sc: dict[str, Any] = {"fsGroup": 0, "runAsUser": 999}
    setup: dict[str, Any] = {"name": "setup-container", "image": image}
    rabbit: dict[str, Any] = {"name": "rabbitmq", "image": image, "ports": copy.deepcopy(RABBITMQ_PORTS)}
    if operator == "2.17":
        pod_sc |= {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
        setup["securityContext"] = copy.deepcopy(_RESTRICTED_CONTAINER)
        rabbit["securityContext"] = copy.deepcopy(_RESTRICTED_CONTAINER)
    elif operator != "2.16":
        raise ValueError(operator)
    return {
        "metadata": {
            "labels": {
                "app.kubernetes.io/name": name,
                "app.kubernetes.io/component": "rabbitmq",
                "app.kubernetes.io/part-of": "rabbitmq",
            }
        },
        "spec": {
            "securityContext": pod_sc,
            "automountServiceAccountToken": True,
            "volumes": [
                {"name": "server-conf", "configMap": {"name": f"{name}-server-conf"}},
                {"name": "plugins-conf", "configMap": {"name": f"{name}-plugins-conf"}},
                {"name": "rabbitmq-confd", "projected": {"sources": []}},
                {"name": "rabbitmq-erlang-cookie", "emptyDir": {}},
                {"name": "erlang-cookie-secret", "secret": {"secretName": f"{name}-erlang-cookie"}},
                {"name": "rabbitmq-plugins", "emptyDir": {}},
                {"name": "pod-info", "downwardAPI": {"items": []}},
                {"name": "persistence", "persistentVolumeClaim": {"claimName": "persistence"}},
            ],
            "initContainers": [setup],
            "containers": [rabbit],
        },
    }


def strategic_merge(base: Any, patch: Any, key: str = "") -> Any:
    """A strategic merge patch of a PodSpec, as far as an override uses one: maps merged
    key by key, containers, initContainers and volumes merged by name, other lists
    replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            out[k] = strategic_merge(base[k], v, k) if k in base else copy.deepcopy(v)
        return out
    if (
        key in ("containers", "initContainers", "volumes")
        and isinstance(base, list)
        and isinstance(patch, list)
    ):
        merged = {item["name"]: item for item in base}
        order = [item["name"] for item in base]
        for item in patch:
            if item["name"] in merged:
                merged[item["name"]] = strategic_merge(merged[item["name"]], item)
            else:
                merged[item["name"]] = copy.deepcopy(item)
                order.append(item["name"])
        return [merged[n] for n in order]
    return copy.deepcopy(patch)


def operator_pod(cluster: dict[str, Any], operator: str, *, with_override: bool = True) -> dict[str, Any]:
    """The RabbitMQ pod the operator makes for ``cluster``, its override applied."""
    template = operator_pod_template(cluster, operator)
    override = (
        (((cluster["spec"].get("override") or {}).get("statefulSet") or {}).get("spec") or {}).get("template")
        if with_override
        else None
    )
    if override:
        if "metadata" in override:
            template["metadata"] = strategic_merge(template["metadata"], override["metadata"])
        if "spec" in override:
            template["spec"] = strategic_merge(template["spec"], override["spec"])
    return template
