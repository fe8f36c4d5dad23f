"""Static checks of deploy/ that need no Docker engine and no cluster: the compose file
against the Compose specification, the kustomize output against Kubernetes' schemas,
Prometheus config, rules and their unit tests through promtool, dashboards' PromQL, and
every chatq_* metric they read being one the services export."""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml
from pydantic import ValidationError

from shared.broker.topology import build_topology
from shared.settings import GUARDED_SECRETS, Settings
from tests.support.deploy_files import (
    DEPLOY,
    RABBITMQ_TRIGGER_KEYS,
    ROOT,
    apply_conflicts,
    dashboard_queries,
    exported_chatq_metrics,
    interpolated,
    kustomize,
    kustomize_variant,
    metric_names,
    promtool,
    recorded_names,
    rule_queries,
    validate_object,
)

pytestmark = pytest.mark.unit

COMPOSE = DEPLOY / "compose.yaml"
RULES = DEPLOY / "prometheus" / "rules" / "chatqueue.yml"
DASHBOARDS = sorted((DEPLOY / "grafana" / "dashboards").glob("*.json"))
OVERLAYS = [DEPLOY / "k8s" / "overlays" / name for name in ("dev", "prod")]
KUBERNETES_VERSION = "1.30.0"
SETTINGS_ENV = {f"CHATQ_{name.upper()}" for name in Settings.model_fields}
# After the drain: the relay's stop (up to 10 s), closing the broker and the pool.
CLOSE_SECONDS = 10


def tuning(values: dict[str, str]) -> Settings:
    """The timing, concurrency and pool values of a ConfigMap, without its credentials
    (the arithmetic of grace periods and connections needs only those)."""
    return overlay_settings({**values, "CHATQ_ENV": "development", "CHATQ_HTTP_HOST": "127.0.0.1"})


def overlay_settings(values: dict[str, str]) -> Settings:
    """Settings from CHATQ_* values of a ConfigMap or Secret (other keys ignored)."""
    return Settings(
        **{k.removeprefix("CHATQ_").lower(): v for k, v in values.items() if k.startswith("CHATQ_")}
    )


def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def service_of(deployment: dict) -> str | None:
    """receiver, coalescer or responder for a chatqueue service's Deployment, else None."""
    component = deployment["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component")
    return component if component in ("receiver", "coalescer", "responder") else None


# ---- compose ---------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["compose.yaml", "compose.dev.yaml", "compose.cluster.yaml"])
def test_the_compose_files_validate_against_the_compose_specification(path: str) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "check_jsonschema",
            "--builtin-schema",
            "vendor.compose-spec",
            str(DEPLOY / path),
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_compose_stack_runs_every_service_and_waits_for_healthy_dependencies() -> None:
    services = compose()["services"]
    assert set(services) == {
        "postgres", "rabbitmq", "migrate", "receiver", "coalescer", "responder", "prometheus", "alertmanager",
        "grafana", "postgres-exporter",
    }  # fmt: skip
    for name in ("receiver", "coalescer", "responder"):
        svc = services[name]
        assert svc["command"] == [f"services.{name}"]
        assert svc["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
        assert svc["depends_on"]["rabbitmq"]["condition"] == "service_healthy"
        assert "readyz" in " ".join(svc["healthcheck"]["test"])
        assert svc["environment"]["CHATQ_ENV"] == "production"
        grace = float(svc["environment"]["CHATQ_SHUTDOWN_GRACE_SECONDS"])
        assert grace >= Settings().worst_case_job_seconds(), "the drain must outlast the longest job"
        assert float(svc["stop_grace_period"].rstrip("s")) >= grace + CLOSE_SECONDS, (
            "docker must not SIGKILL a draining service"
        )
    assert services["migrate"]["command"] == ["shared.migrate"]
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    for name, svc in services.items():
        if name != "migrate":
            assert "healthcheck" in svc, f"{name} has no health check"


def test_the_compose_stack_publishes_nothing_beyond_localhost_by_default_and_no_database() -> None:
    services = compose()["services"]
    assert "ports" not in services["postgres"]
    published = {name: svc.get("ports", []) for name, svc in services.items()}
    assert set(n for n, p in published.items() if p) == {
        "rabbitmq", "receiver", "prometheus", "alertmanager", "grafana",
    }  # fmt: skip
    for name, ports in published.items():
        for port in ports:
            assert re.fullmatch(r"\$\{[A-Z_]+_BIND:-127\.0\.0\.1\}:\d+:\d+", port), (name, port)
    assert not [p for ports in published.values() for p in ports if p.endswith(":5672")], "AMQP stays inside"


def test_the_compose_stack_takes_every_secret_from_the_env_files_and_passes_only_known_settings() -> None:
    text = COMPOSE.read_text()
    for var in (
        "POSTGRES_PASSWORD", "CHATQ_DB_PASSWORD", "RABBITMQ_PASSWORD", "RABBITMQ_ADMIN_PASSWORD",
        "GRAFANA_ADMIN_PASSWORD", "POSTGRES_MONITOR_PASSWORD", "ALERTMANAGER_RECEIVER",
        "ALERTMANAGER_HEARTBEAT_URL",
    ):  # fmt: skip
        assert f"${{{var}:?" in text or f"${{{var}}}" in text
        assert f"{var}=" in (DEPLOY / ".env.example").read_text()
    assert "guest" not in text
    env = compose()["x-chatqueue"]["environment"]
    example = [
        line.lstrip("#").split("=", 1)[0]
        for line in (DEPLOY / "chatqueue.env.example").read_text().splitlines()
        if re.match(r"#?CHATQ_[A-Z_]+=", line)
    ]
    unknown = (set(env) | set(example)) - SETTINGS_ENV
    assert not unknown, f"not chatqueue settings: {unknown}"


def example_values(path: Path) -> dict[str, str]:
    """NAME=value lines of an example env file, commented-out ones included."""
    lines = (line.lstrip("#").strip() for line in path.read_text().splitlines())
    return dict(line.split("=", 1) for line in lines if re.match(r"[A-Z_]+=\S", line))


def test_the_example_files_placeholders_are_refused_until_a_person_replaces_them() -> None:
    chatq = example_values(DEPLOY / "chatqueue.env.example")
    guarded = {f"CHATQ_{name.upper()}" for name in GUARDED_SECRETS}
    examples = {k: v for k, v in chatq.items() if k in guarded}
    assert "CHATQ_ADMIN_TOKEN" in examples
    real = {
        "database_url": "postgresql://chatq:Qm7vTz2pLw9xKc4R@db/chatq",
        "amqp_url": "amqp://chatq:Hs8dJ3kq0PzX5nVb@mq/",
    }
    for name, value in examples.items():
        with pytest.raises(ValidationError, match=name):
            Settings(env="production", **real, **{name.removeprefix("CHATQ_").lower(): value})
    infra = example_values(DEPLOY / ".env.example")
    env = compose()["x-chatqueue"]["environment"]
    urls = {
        name: re.sub(r"\$\{(\w+)[^}]*\}", lambda m: infra[m.group(1)], env[name])
        for name in ("CHATQ_DATABASE_URL", "CHATQ_AMQP_URL")
    }
    with pytest.raises(ValidationError) as refused:
        Settings(env="production", database_url=urls["CHATQ_DATABASE_URL"], amqp_url=urls["CHATQ_AMQP_URL"])
    assert "CHATQ_DATABASE_URL's password contains 'change-me'" in str(refused.value)
    assert "CHATQ_AMQP_URL's password contains 'change-me'" in str(refused.value)


def test_rabbitmq_loads_the_generated_topology_and_its_user_at_boot() -> None:
    rabbit = compose()["services"]["rabbitmq"]
    targets = {c["source"]: c["target"] for c in rabbit["configs"]}
    assert targets["rabbitmq-topology"] == "/etc/rabbitmq/definitions.d/10-topology.json"
    assert targets["rabbitmq-users"] == "/etc/rabbitmq/definitions.d/00-users.json"
    conf = (DEPLOY / "rabbitmq" / "rabbitmq.conf").read_text()
    assert "definitions.local.path = /etc/rabbitmq/definitions.d" in conf
    plugins = (DEPLOY / "rabbitmq" / "enabled_plugins").read_text()
    assert "rabbitmq_management" in plugins and "rabbitmq_prometheus" in plugins
    doc = rabbitmq_users("chatq", "secret", "admin", "admin-secret")
    assert doc["vhosts"] == [{"name": "/"}], "permissions need the vhost before the topology file"
    users = {u["name"]: u for u in doc["users"]}
    permissions = {p["user"]: p for p in doc["permissions"]}
    assert users["admin"]["tags"] == "administrator"
    assert users["chatq"]["tags"] == "", "the application user has no management tag"
    for what in ("configure", "write", "read"):
        pattern = re.compile(permissions["chatq"][what])
        names = [e.name for e in build_topology().exchanges] + [q.name for q in build_topology().queues]
        assert all(pattern.match(name) for name in names), (what, names)
        assert not pattern.match("amq.topic") and not pattern.match("other.queue"), what


# ---- a three-node RabbitMQ cluster ----------------------------------------------------

CLUSTER_COMPOSE = DEPLOY / "compose.cluster.yaml"
RABBITMQ_K8S = DEPLOY / "k8s" / "rabbitmq"


def merged_compose(*paths: Path) -> dict:
    """compose files merged as `docker compose -f a -f b` does: mappings key by key,
    configs and volumes of a service by target, other sequences replaced."""

    def merge(base: object, extra: object, key: str = "") -> object:
        if isinstance(base, dict) and isinstance(extra, dict):
            out = dict(base)
            for k, v in extra.items():
                out[k] = merge(base[k], v, k) if k in base else v
            return out
        if key in ("configs", "volumes") and isinstance(base, list) and isinstance(extra, list):

            def target(item: object) -> str:
                return item["target"] if isinstance(item, dict) else str(item).split(":")[1]

            by_target = {target(i): i for i in base}
            by_target.update({target(i): i for i in extra})
            return list(by_target.values())
        return extra

    doc: dict = {}
    for path in paths:
        doc = merge(doc, yaml.safe_load(path.read_text()))  # type: ignore[assignment]
    return doc


def substituted(text: str, values: dict[str, str]) -> str:
    """${NAME}, ${NAME:?message} and $$ as compose interpolates them."""
    text = re.sub(r"\$\{([A-Z_]+)(?::\?[^}]*)?\}", lambda m: values[m.group(1)], text)
    return text.replace("$$", "$")


def test_the_cluster_override_runs_three_rabbitmq_nodes_that_find_each_other_with_one_cookie() -> None:
    stack = merged_compose(COMPOSE, CLUSTER_COMPOSE)
    services = stack["services"]
    nodes = {n: svc for n, svc in services.items() if n.startswith("rabbitmq") and "hostname" in svc}
    assert len(nodes) == 3
    hostnames = {svc["hostname"] for svc in nodes.values()}
    assert len(hostnames) == 3
    data = [v for svc in nodes.values() for v in svc["volumes"] if v.endswith(":/var/lib/rabbitmq")]
    assert len(set(data)) == 3, "each node keeps its own data"
    conf = (DEPLOY / "rabbitmq" / "cluster.conf").read_text()
    listed = set(re.findall(r"classic_config\.nodes\.\d+ = (\S+)", conf))
    assert listed == {f"rabbit@{h}" for h in hostnames}
    base_image = compose()["services"]["rabbitmq"]["image"]
    cookies = set()
    for name, svc in nodes.items():
        assert svc["image"] == base_image, f"{name} runs another RabbitMQ than the tested one"
        targets = {c["target"] for c in svc["configs"]}
        assert "/etc/rabbitmq/conf.d/20-cluster.conf" in targets
        assert "/etc/rabbitmq/definitions.d/10-topology.json" in targets
        cookies.add(svc["environment"]["RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS"])
        assert (
            svc["environment"]["RABBITMQ_CTL_ERL_ARGS"]
            == svc["environment"]["RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS"]
        )
        assert svc["healthcheck"]["test"]
    assert len(cookies) == 1 and "${RABBITMQ_ERLANG_COOKIE:?" in cookies.pop()
    assert "RABBITMQ_ERLANG_COOKIE=" in (DEPLOY / ".env.example").read_text()
    # Queues created before every node joined get their missing replicas before any
    # service starts.
    init = services["rabbitmq-cluster-init"]
    assert {n: d["condition"] for n, d in init["depends_on"].items()} == dict.fromkeys(
        nodes, "service_healthy"
    )
    script = init["command"][0]
    assert "await_online_nodes 3" in script
    assert "rabbitmq-queues" in script and "grow" in script
    assert all(h in script for h in hostnames)


def test_with_the_cluster_override_every_service_knows_all_three_nodes_and_waits_for_the_cluster() -> None:
    stack = merged_compose(COMPOSE, CLUSTER_COMPOSE)
    services = stack["services"]
    hostnames = {
        svc["hostname"] for n, svc in services.items() if n.startswith("rabbitmq") and "hostname" in svc
    }
    values = {"RABBITMQ_USER": "chatq", "RABBITMQ_PASSWORD": "Hs8dJ3kq0PzX5nVbW2", "CHATQ_DB_PASSWORD": "x"}
    for name in ("migrate", "receiver", "coalescer", "responder"):
        env = services[name]["environment"]
        url = substituted(env["CHATQ_AMQP_URL"], values)
        settings = Settings(
            env="production", amqp_url=url, database_url="postgresql://chatq:Qm3xT9vLp2Rk8sWz@pg/db"
        )
        urls = settings.amqp_urls()
        assert {urlsplit(u).hostname for u in urls} == hostnames, name
        assert all(urlsplit(u).username == "chatq" for u in urls)
        if name != "migrate":
            deps = services[name]["depends_on"]
            assert deps["rabbitmq-cluster-init"]["condition"] == "service_completed_successfully"
            assert deps["migrate"]["condition"] == "service_completed_successfully", (
                "the base file's wait stays"
            )


def test_the_rabbitmq_cluster_operator_manifest_runs_three_tested_nodes_apart_one_down_at_a_time() -> None:
    docs = kustomize(RABBITMQ_K8S)
    for doc in docs:
        validate_object(doc, KUBERNETES_VERSION)
    (cluster,) = [d for d in docs if d["kind"] == "RabbitmqCluster"]
    (budget,) = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    spec = cluster["spec"]
    assert spec["replicas"] == 3
    compose_version = compose()["services"]["rabbitmq"]["image"].split(":")[1].split("-")[0]
    assert spec["image"].split(":")[1].split("-")[0] == compose_version, "the tested RabbitMQ line"
    # The operator labels its pods app.kubernetes.io/name: <cluster name>.
    pods = {"app.kubernetes.io/name": cluster["metadata"]["name"]}
    anti = spec["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert anti["labelSelector"]["matchLabels"] == pods and anti["topologyKey"] == "kubernetes.io/hostname"
    assert budget["spec"]["selector"]["matchLabels"] == pods and budget["spec"]["maxUnavailable"] == 1
    # The broker settings compose uses, the same values.
    ours = {}
    for path in (DEPLOY / "rabbitmq" / "rabbitmq.conf", DEPLOY / "rabbitmq" / "cluster.conf"):
        for line in path.read_text().splitlines():
            if "=" in line and not line.startswith("#"):
                key, value = (p.strip() for p in line.split("=", 1))
                ours[key] = value
    for line in spec["rabbitmq"]["additionalConfig"].splitlines():
        key, value = (p.strip() for p in line.split("=", 1))
        assert ours.get(key) == value, f"{key} differs from deploy/rabbitmq"
    for key in ("queue_leader_locator", "consumer_timeout", "vm_memory_high_watermark.relative"):
        assert key in spec["rabbitmq"]["additionalConfig"], key


def rabbitmq_users(user: str, password: str, admin: str, admin_password: str) -> dict:
    """The users file compose writes into RabbitMQ's definitions, filled in."""
    content = compose()["configs"]["rabbitmq-users"]["content"]
    for name, value in {
        "RABBITMQ_USER": user, "RABBITMQ_PASSWORD": password,
        "RABBITMQ_ADMIN_USER": admin, "RABBITMQ_ADMIN_PASSWORD": admin_password,
    }.items():  # fmt: skip
        content = content.replace("${" + name + "}", value)
    return json.loads(content)


# ---- image -----------------------------------------------------------------------------


def test_the_image_is_multi_stage_pinned_and_runs_as_a_non_root_user() -> None:
    text = (ROOT / "Dockerfile").read_text()
    base = re.search(r"ARG PYTHON_IMAGE=(\S+)", text).group(1)
    assert re.fullmatch(r"python:3\.11\.\d+-slim-\w+", base), base
    assert text.count("FROM ") == 2 and "AS build" in text
    assert re.search(r"^USER 10001:10001$", text, re.M)
    assert 'ENTRYPOINT ["python", "-m"]' in text
    for src in re.findall(r"^COPY (?!--from)(.+) \S+$", text, re.M):
        for part in src.split():
            assert (ROOT / part).exists(), f"Dockerfile copies {part}, which does not exist"
            assert (
                f"!{part}" in (ROOT / ".dockerignore").read_text()
                or f"!{part}/" in (ROOT / ".dockerignore").read_text()
            ), f".dockerignore leaves {part} out of the build context"


# ---- Kubernetes ------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_the_kustomize_overlay_renders_and_every_object_validates_against_its_schema(overlay: Path) -> None:
    docs = kustomize(overlay)
    kinds = {d["kind"] for d in docs}
    assert {
        "Deployment", "PodDisruptionBudget", "ScaledObject", "ConfigMap", "Service", "NetworkPolicy",
    } <= kinds  # fmt: skip
    if overlay.name == "prod":
        assert {"Ingress", "PodMonitor", "PrometheusRule"} <= kinds
    for doc in docs:
        validate_object(doc, KUBERNETES_VERSION)


def test_the_schema_checks_refuse_a_misspelt_field_of_every_custom_kind() -> None:
    for doc in kustomize(OVERLAYS[1]):
        if doc["apiVersion"].startswith(("keda.sh/", "monitoring.coreos.com/")):
            broken = {**doc, "spec": {**doc["spec"], "selektor": {}}}
            with pytest.raises(AssertionError, match="selektor"):
                validate_object(broken, KUBERNETES_VERSION)
    for doc in kustomize(RABBITMQ_K8S):
        if doc["kind"] == "RabbitmqCluster":
            broken = {**doc, "spec": {**doc["spec"], "selektor": {}}}
            with pytest.raises(AssertionError, match="selektor"):
                validate_object(broken, KUBERNETES_VERSION)


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_every_deployment_has_probes_limits_a_budget_and_a_grace_period_that_covers_the_longest_job(
    overlay: Path,
) -> None:
    docs = kustomize(overlay)
    config = next(
        d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("chatqueue-config")
    )
    assert set(config["data"]) <= SETTINGS_ENV, set(config["data"]) - SETTINGS_ENV
    # docs/deploying.md "Grace periods": drain >= the longest job, from the overlay's own values;
    # terminationGracePeriodSeconds >= preStop + drain + closing.
    drain = float(config["data"]["CHATQ_SHUTDOWN_GRACE_SECONDS"])
    worst = tuning(config["data"]).worst_case_job_seconds()
    assert drain >= worst, f"CHATQ_SHUTDOWN_GRACE_SECONDS={drain} < the longest job, {worst} s"
    deployments = [d for d in docs if d["kind"] == "Deployment" and service_of(d) is not None]
    assert {d["metadata"]["name"] for d in deployments} == {
        "chatqueue-receiver", "chatqueue-coalescer", "chatqueue-responder",
    }  # fmt: skip
    others = {d["metadata"]["name"] for d in docs if d["kind"] == "Deployment"} - {
        d["metadata"]["name"] for d in deployments
    }
    assert others <= {"chatqueue-postgres-exporter"}, others
    budgets = {
        d["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"]
        for d in docs
        if d["kind"] == "PodDisruptionBudget"
    }
    for dep in deployments:
        pod = dep["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        component = dep["metadata"]["name"].removeprefix("chatqueue-")
        assert container["args"] == [f"services.{component}"]
        assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
        assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
        assert container["resources"]["requests"]["cpu"] and container["resources"]["limits"]["memory"]
        pre_stop = float(container["lifecycle"]["preStop"]["exec"]["command"][-1])
        assert pod["terminationGracePeriodSeconds"] >= pre_stop + drain + CLOSE_SECONDS
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        (init,) = pod["initContainers"]
        # The receiver applies the migrations; the workers wait until the schema is current.
        expected = ["shared.migrate"] if component == "receiver" else ["shared.migrate", "--wait"]
        assert init["args"][: len(expected)] == expected, init["args"]
        assert init["envFrom"] == container["envFrom"]
        annotations = dep["spec"]["template"]["metadata"]["annotations"]
        port = int(annotations["prometheus.io/port"])
        assert port in {p["containerPort"] for p in container["ports"]}
        assert component in budgets
        refs = {e.get("secretRef", e.get("configMapRef"))["name"] for e in container["envFrom"]}
        assert refs == {config["metadata"]["name"], "chatqueue-secrets"}
    assert not [d for d in docs if d["kind"] == "Job"], "a Job's template is immutable: see the double apply"


def test_the_dev_overlay_settings_pass_the_guards_its_pods_apply_and_keep_the_sandbox() -> None:
    docs = kustomize(OVERLAYS[0])
    config = next(d for d in docs if d["kind"] == "ConfigMap")["data"]
    secret = next(d for d in docs if d["kind"] == "Secret")["data"]
    values = {**config, **{k: base64.b64decode(v).decode() for k, v in secret.items()}}
    settings = overlay_settings(values)
    assert settings.production_guards, "pods listen on 0.0.0.0, not loopback"
    assert settings.sandbox_active


def test_the_receiver_keeps_its_admin_port_apart_from_the_webhook_port_in_every_deploy() -> None:
    receiver = compose()["services"]["receiver"]
    admin_port = receiver["environment"]["CHATQ_ADMIN_PORT"]
    assert receiver["environment"]["CHATQ_ENV"] == "production", "the merge kept the shared settings"
    assert receiver["ports"] == [
        "${RECEIVER_BIND:-127.0.0.1}:8080:8080",
        f"${{ADMIN_BIND:-127.0.0.1}}:{admin_port}:{admin_port}",
    ]
    assert "ADMIN_BIND=127.0.0.1" in (DEPLOY / ".env.example").read_text()
    scrape = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())["scrape_configs"]
    job = next(j for j in scrape if j["job_name"] == "chatqueue-receiver")
    assert job["static_configs"][0]["targets"] == [f"receiver:{admin_port}"]
    for overlay in OVERLAYS:
        docs = kustomize(overlay)
        config = next(d for d in docs if d["kind"] == "ConfigMap")["data"]
        dep = next(
            d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "chatqueue-receiver"
        )
        (container,) = dep["spec"]["template"]["spec"]["containers"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports == {"http": int(config["CHATQ_HTTP_PORT"]), "admin": int(config["CHATQ_ADMIN_PORT"])}
        annotations = dep["spec"]["template"]["metadata"]["annotations"]
        assert int(annotations["prometheus.io/port"]) == ports["admin"], "/metrics is on the admin port"
        assert container["readinessProbe"]["httpGet"]["port"] == "http"
        service = next(
            d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "chatqueue-receiver"
        )
        assert {p["name"]: p["targetPort"] for p in service["spec"]["ports"]} == {
            "http": "http",
            "admin": "admin",
        }


def test_keda_scales_the_responder_and_the_coalescer_on_their_own_queues() -> None:
    docs = kustomize(OVERLAYS[1])
    queues = {q.name for q in build_topology().queues}
    scaled = {d["spec"]["scaleTargetRef"]["name"]: d for d in docs if d["kind"] == "ScaledObject"}
    assert set(scaled) == {"chatqueue-responder", "chatqueue-coalescer"}
    expected = {"chatqueue-responder": "chatq.responder", "chatqueue-coalescer": "chatq.coalescer"}
    auth = {d["metadata"]["name"]: d for d in docs if d["kind"] == "TriggerAuthentication"}
    for target, obj in scaled.items():
        (trigger,) = obj["spec"]["triggers"]
        assert trigger["type"] == "rabbitmq"
        assert set(trigger["metadata"]) <= RABBITMQ_TRIGGER_KEYS
        assert trigger["metadata"]["queueName"] == expected[target] and expected[target] in queues
        assert trigger["metadata"]["mode"] == "QueueLength"
        # Over HTTP the queue length is ready + unacked; over AMQP busy workers look idle.
        assert trigger["metadata"]["protocol"] == "http"
        ref = auth[trigger["authenticationRef"]["name"]]["spec"]["secretTargetRef"][0]
        assert (ref["parameter"], ref["name"], ref["key"]) == (
            "host", "chatqueue-secrets", "RABBITMQ_MANAGEMENT_URL",
        )  # fmt: skip
        assert obj["spec"]["minReplicaCount"] >= 2, "two replicas keep serving while one restarts"
        deployment = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == target)
        assert "replicas" not in deployment["spec"], f"{target}: KEDA owns its replicas"
    keda = (DEPLOY / "k8s" / "base" / "keda.yaml").read_text()
    assert "ready + unacked" in keda.lower() and "only ready messages" in keda


# ---- Prometheus and Grafana ------------------------------------------------------------


def test_the_prometheus_config_and_rules_pass_promtool(tmp_path: Path) -> None:
    tool = promtool()
    config = (DEPLOY / "prometheus" / "prometheus.yml").read_text()
    local = tmp_path / "prometheus.yml"
    local.write_text(config.replace("/etc/prometheus/rules", str(RULES.parent)))
    for args in (["check", "config", str(local)], ["check", "rules", str(RULES)]):
        out = subprocess.run([tool, *args], capture_output=True, text=True)
        assert out.returncode == 0, out.stdout + out.stderr


def test_each_alert_fires_on_its_situation_and_stays_quiet_when_healthy() -> None:
    tests = sorted((DEPLOY / "prometheus" / "tests").glob("*.test.yml"))
    assert [t.name for t in tests] == ["chatqueue-alerts.test.yml", "postgres-outage.test.yml"]
    out = subprocess.run([promtool(), "test", "rules", *map(str, tests)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    alerts = {
        r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r
    }
    assert {
        "ChatqueueBacklogGrowing", "ChatqueueRepliesSlowWhileBacklogShort", "ChatqueueFailedShareHigh",
        "ChatqueueRetriesRising", "ChatqueueOutboxLagging", "ChatqueueOldestUnfinishedTooOld",
        "ChatqueueDeadLetters", "ChatqueuePostgresUnreachable", "ChatqueueNotReady", "ChatqueueGaugesStale",
        "ChatqueueConsumerStalled",
    } <= alerts  # fmt: skip


def test_a_45_minute_postgres_outage_fires_the_postgres_alert_within_a_minute_and_the_stale_numbers_alert() -> (
    None
):
    """Issue 40, point 5: the services answer /metrics while Postgres is away, with numbers
    frozen at their last values; before, a 45-minute outage fired no chatqueue alert.
    deploy/prometheus/tests/postgres-outage.test.yml plays it out every 15 s."""
    outage = DEPLOY / "prometheus" / "tests" / "postgres-outage.test.yml"
    out = subprocess.run([promtool(), "test", "rules", str(outage)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    checks = yaml.safe_load(outage.read_text())["tests"][0]["alert_rule_test"]
    fired: dict[str, str] = {}
    for c in checks:
        if c.get("exp_alerts"):
            fired.setdefault(c["alertname"], c["eval_time"])  # the first time each is expected
    assert fired["ChatqueuePostgresUnreachable"] == "10m30s"  # Postgres stopped at 10m
    assert fired["ChatqueueGaugesStale"] == "11m45s"


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_every_dashboard_query_is_valid_promql(path: Path, tmp_path: Path) -> None:
    doc = json.loads(path.read_text())
    assert doc["uid"] and doc["panels"]
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    exprs = dashboard_queries(path)
    assert exprs
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {
                        "record": f"dashboard:query_{i}",
                        "expr": e.replace("$__rate_interval", "1m").replace("$__range", "1h"),
                    }
                    for i, e in enumerate(exprs)
                ],
            }
        ]
    }
    file = tmp_path / "dashboard-rules.yml"
    file.write_text(yaml.safe_dump(rules))
    out = subprocess.run([promtool(), "check", "rules", str(file)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_chatq_metric_in_rules_and_dashboards_is_one_the_services_export() -> None:
    exported = exported_chatq_metrics()
    recorded = recorded_names(RULES)
    used: dict[str, set[str]] = {}
    for source, exprs in [("rules", rule_queries(RULES))] + [
        (p.name, dashboard_queries(p)) for p in DASHBOARDS
    ]:
        for e in exprs:
            for name in metric_names(e):
                used.setdefault(name, set()).add(source)
    chatq = {n for n in used if n.startswith("chatq_")}
    assert chatq, "the extraction found no chatq metric: the check itself broke"
    assert not chatq - exported, {n: used[n] for n in chatq - exported}
    others = set(used) - chatq - recorded - {"up"}
    # RabbitMQ's own, the Postgres exporter's (pg_up) and KEDA's scaler errors.
    assert all(n.startswith("rabbitmq_") or n in {"pg_up"} for n in others), others
    assert "rabbitmq_queue_messages" in others and "pg_up" in others
    # The dashboard covers the four numbers, oldest unfinished, outbox and emission lag.
    for needed in (
        "chatq_backlog", "chatq_receipt_to_reply_seconds_bucket", "chatq_operations_total",
        "chatq_retries_total", "chatq_oldest_unfinished_age_seconds", "chatq_outbox_lag_seconds",
        "chatq_coalescer_emission_lag_seconds_bucket", "chatq_platform_request_seconds_bucket",
    ):  # fmt: skip
        assert "chatqueue.json" in used.get(needed, set()), needed


# Gauges every process reads from the same table (each receiver and coalescer counts the
# whole outbox, each receiver the whole backlog): summed over processes, one backlog would
# count once per replica.
SHARED_GAUGES = (
    "chatq_outbox_pending", "chatq_outbox_lag_seconds", "chatq_backlog", "chatq_oldest_unfinished_age_seconds",
)  # fmt: skip


def test_no_query_sums_a_gauge_that_every_replica_reads_from_the_same_table() -> None:
    exprs = [e for p in DASHBOARDS for e in dashboard_queries(p)] + rule_queries(RULES)
    summed = [
        e
        for e in exprs
        for g in SHARED_GAUGES
        if re.search(rf"\b(sum|avg)\s*(by\s*\([^)]*\)\s*)?\(\s*{g}\b", e)
    ]
    assert not summed, f"summed across replicas (use max): {summed}"
    assert any("max(chatq_outbox_pending)" in e for e in exprs)


def test_grafana_provisions_the_prometheus_datasource_the_dashboards_use() -> None:
    ds = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yaml").read_text())
    uid = ds["datasources"][0]["uid"]
    for path in DASHBOARDS:
        doc = json.loads(path.read_text())
        for panel in doc["panels"]:
            if panel["type"] != "row":
                assert panel["datasource"]["uid"] == uid, (path.name, panel["title"])
    provider = yaml.safe_load(
        (DEPLOY / "grafana" / "provisioning" / "dashboards" / "chatqueue.yaml").read_text()
    )
    mount = next(v for v in compose()["services"]["grafana"]["volumes"] if "dashboards:" in v)
    assert provider["providers"][0]["options"]["path"] == mount.split(":")[1]


def test_the_dashboard_files_are_what_their_builder_renders() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "build_dashboards", DEPLOY / "grafana" / "build_dashboards.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rendered = module.render()
    assert sorted(rendered) == [p.name for p in DASHBOARDS]
    for path in DASHBOARDS:
        assert path.read_text() == rendered[path.name], (
            f"run: python deploy/grafana/build_dashboards.py ({path.name})"
        )


# ---- day two: upgrades, secrets, connections, exposure, alerting ----------------------


def test_applying_the_overlay_again_with_new_config_and_a_new_image_is_valid(tmp_path: Path) -> None:
    prod = OVERLAYS[1]
    first = kustomize(prod)
    second = kustomize_variant(
        prod, tmp_path, literals={"CHATQ_LLM_TIMEOUT_SECONDS": "25"}, image_tag="0.2.0"
    )
    # The second render really is another release: new config (a new ConfigMap name the
    # pods follow) and the new image everywhere.
    config_names = [{d["metadata"]["name"] for d in r if d["kind"] == "ConfigMap"} for r in (first, second)]
    assert config_names[0] != config_names[1]
    images = {
        c["image"]
        for d in second
        if d["kind"] == "Deployment" and service_of(d)
        for c in d["spec"]["template"]["spec"]["containers"] + d["spec"]["template"]["spec"]["initContainers"]
    }
    assert images == {"registry.example.invalid/chatqueue:0.2.0"}
    assert apply_conflicts(first, second) == []
    assert apply_conflicts(second, second) == [], "re-applying the same release changes nothing"
    # The check catches what broke upgrades before: a Job of a fixed name with a new template.
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "chatqueue-migrate", "namespace": "chatqueue"},
        "spec": {"template": {"spec": {"containers": [{"image": "chatqueue:0.1.0"}]}}},
    }
    newer = json.loads(json.dumps(job).replace("0.1.0", "0.2.0"))
    assert apply_conflicts([job], [newer]) == [
        "Job/chatqueue-migrate: spec.template is immutable and changed"
    ]


PROD_SECRETS = DEPLOY / "k8s" / "overlays" / "prod" / "secrets.env.example"


def secret_keys(path: Path) -> tuple[dict[str, str], set[str]]:
    """The required NAME=value lines of a secrets example, and every key it names."""
    required = dict(
        line.split("=", 1) for line in path.read_text().splitlines() if re.match(r"[A-Z_]+=\S", line)
    )
    named = set(re.findall(r"^#?([A-Z_]+)=", path.read_text(), re.M))
    return required, named


def test_the_prod_secret_is_one_documented_instruction_whose_keys_pass_the_production_guards() -> None:
    instruction = (
        "kubectl -n chatqueue create secret generic chatqueue-secrets "
        "--from-env-file=deploy/k8s/overlays/prod/secrets.env"
    )
    kustomization = (DEPLOY / "k8s" / "overlays" / "prod" / "kustomization.yaml").read_text()
    readme = (ROOT / "docs" / "deploying.md").read_text()
    for where, text in [
        ("overlay", kustomization),
        ("example", PROD_SECRETS.read_text()),
        ("docs/deploying.md", readme),
    ]:
        assert instruction in text, f"the {where} does not give the one instruction"
    assert "secret generic chatqueue-secrets --from-env-file=" not in readme.replace(instruction, ""), (
        "docs/deploying.md names another file"
    )
    required, named = secret_keys(PROD_SECRETS)
    not_ours = {"RABBITMQ_MANAGEMENT_URL", "POSTGRES_EXPORTER_DATA_SOURCE_NAME"}  # KEDA's, the exporter's
    # Each service's own Postgres role's URL, its CHATQ_DATABASE_URL (the owner's is the migration's).
    not_ours |= {f"{service.upper()}_DATABASE_URL" for service in ("receiver", "coalescer", "responder")}
    assert set(required) == {"CHATQ_DATABASE_URL", "CHATQ_AMQP_URL", "CHATQ_ADMIN_TOKEN", *not_ours}
    assert named - not_ours <= SETTINGS_ENV, named - SETTINGS_ENV
    docs = kustomize(OVERLAYS[1])
    # Every key an object reads from the Secret is one the example requires.
    read = {
        ref["key"]
        for d in docs
        if d["kind"] == "TriggerAuthentication"
        for ref in d["spec"]["secretTargetRef"]
        if ref["name"] == "chatqueue-secrets"
    } | {
        env["valueFrom"]["secretKeyRef"]["key"]
        for d in docs
        if d["kind"] == "Deployment"
        for c in d["spec"]["template"]["spec"]["containers"]
        for env in c.get("env", [])
        if "secretKeyRef" in env.get("valueFrom", {})
    }
    assert "POSTGRES_EXPORTER_DATA_SOURCE_NAME" in read
    assert read <= set(required), read - set(required)
    config = next(d for d in docs if d["kind"] == "ConfigMap")["data"]
    # As shipped, every placeholder is refused.
    with pytest.raises(ValidationError) as refused:
        overlay_settings({**config, **required})
    for name in ("CHATQ_DATABASE_URL", "CHATQ_AMQP_URL", "CHATQ_ADMIN_TOKEN"):
        assert name in str(refused.value)
    # Filled in as the comment says, the Secret plus the ConfigMap pass the validator.
    filled = {
        k: re.sub(r"CHANGE-ME[\w-]*", lambda _: "Qm7vTz2pLw9xKc4RHs8dJ3kq", v) for k, v in required.items()
    }
    settings = overlay_settings({**config, **filled})
    assert settings.production_guards and settings.env == "production"
    assert settings.admin_token is not None


def test_at_maximum_scale_every_connection_fits_in_the_documented_postgres_max_connections() -> None:
    """docs/deploying.md "Connections": each process's pool at its maximum, at KEDA's maximum replicas
    plus the one pod a rollout adds, plus the init containers of the surging pods, a
    person's sessions and Postgres' superuser reserve."""
    docs = kustomize(OVERLAYS[1])
    config = tuning(next(d for d in docs if d["kind"] == "ConfigMap")["data"])
    scaled = {
        d["spec"]["scaleTargetRef"]["name"]: d["spec"]["maxReplicaCount"]
        for d in docs
        if d["kind"] == "ScaledObject"
    }
    needed = 0
    for dep in (d for d in docs if d["kind"] == "Deployment"):
        name = dep["metadata"]["name"]
        if service_of(dep) is None:  # the Postgres exporter: one connection, and one more in a rollout
            needed += dep["spec"]["replicas"] + 1
            continue
        pods = (
            scaled.get(name, dep["spec"].get("replicas", 1))
            + dep["spec"]["strategy"]["rollingUpdate"]["maxSurge"]
        )
        needed += pods * config.database_connections(name.removeprefix("chatqueue-"))
        needed += dep["spec"]["strategy"]["rollingUpdate"]["maxSurge"]  # its init container
    needed += PERSON_SESSIONS + SUPERUSER_RESERVED
    readme = (ROOT / "docs" / "deploying.md").read_text()
    documented = int(re.search(r"`max_connections` of at least (\d+)", readme).group(1))
    assert needed <= documented, (
        f"{needed} connections at maximum scale, docs/deploying.md asks for {documented}"
    )
    assert f"= {needed}" in readme, "docs/deploying.md shows the same arithmetic"
    # compose: one process of each, the one-shot migration, within its Postgres' setting.
    command = compose()["services"]["postgres"]["command"]
    limit = int(next(c.split("=")[1] for c in command if c.startswith("max_connections=")))
    services = compose()["services"]
    one_each = sum(
        tuning(services[s]["environment"] | {"CHATQ_DATABASE_POOL_SIZE": "10"}).database_connections(s)
        for s in ("receiver", "coalescer", "responder")
    )
    assert one_each + 1 + PERSON_SESSIONS + SUPERUSER_RESERVED <= limit


PERSON_SESSIONS = 5  # psql, pg_dump, chatq doctor
SUPERUSER_RESERVED = 3  # Postgres' superuser_reserved_connections default


def test_only_the_webhooks_are_public_over_tls_and_everything_else_is_denied_by_default() -> None:
    docs = kustomize(OVERLAYS[1])
    (ingress,) = [d for d in docs if d["kind"] == "Ingress"]
    spec = ingress["spec"]
    hosts = {h for t in spec["tls"] for h in t["hosts"]}
    paths = [p for rule in spec["rules"] for p in rule["http"]["paths"]]
    assert {r["host"] for r in spec["rules"]} <= hosts, "every routed host has TLS"
    assert [(p["path"], p["pathType"]) for p in paths] == [("/v1/webhooks/", "Prefix")]
    backend = paths[0]["backend"]["service"]
    assert (backend["name"], backend["port"]) == ("chatqueue-receiver", {"name": "http"})
    service = next(
        d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "chatqueue-receiver"
    )
    http = next(p for p in service["spec"]["ports"] if p["name"] == "http")
    receiver = next(
        d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "chatqueue-receiver"
    )
    ports = {
        p["name"]: p["containerPort"] for p in receiver["spec"]["template"]["spec"]["containers"][0]["ports"]
    }
    assert http["targetPort"] == "http" and ports["http"] != ports["admin"]

    # The NetworkPolicies: tests/unit/test_kubernetes_policies.py evaluates them.
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    deny = [
        p
        for p in policies
        if p["spec"]["podSelector"] == {} and "ingress" not in p["spec"] and "egress" not in p["spec"]
    ]
    assert deny and set(deny[0]["spec"]["policyTypes"]) == {"Ingress", "Egress"}, "default deny, both ways"


def test_the_kube_prometheus_objects_scrape_every_service_and_carry_the_same_rules_as_compose() -> None:
    import importlib.util

    docs = kustomize(OVERLAYS[1])
    namespace = next(d for d in docs if d["kind"] == "Namespace")["metadata"]["name"]
    monitors = {d["metadata"]["name"]: d for d in docs if d["kind"] == "PodMonitor"}
    target_down = next(
        r["expr"]
        for g in yaml.safe_load(RULES.read_text())["groups"]
        for r in g["rules"]
        if r.get("alert") == "ChatqueueTargetDown"
    )
    job_regex = re.search(r'job=~"([^"]+)"', target_down).group(1)
    for dep in (d for d in docs if d["kind"] == "Deployment" and service_of(d)):
        name = dep["metadata"]["name"]
        monitor = monitors[name]
        pod = dep["spec"]["template"]
        assert monitor["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
        (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
        ports = {p["name"]: p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]}
        assert ports[endpoint["port"]] == int(pod["metadata"]["annotations"]["prometheus.io/port"])
        # prometheus-operator names a PodMonitor's job <namespace>/<name>: target-down matches it.
        assert re.fullmatch(job_regex, f"{namespace}/{name}"), (job_regex, name)
        assert re.fullmatch(job_regex, name), "and compose's job names"
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    assert rule["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]
    spec = importlib.util.spec_from_file_location(
        "build_k8s_rules", DEPLOY / "prometheus" / "build_k8s_rules.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.OUTPUT.read_text() == module.render(), "run: python deploy/prometheus/build_k8s_rules.py"


ALERTING_VALUES = {
    "ALERTMANAGER_HEARTBEAT_URL": "https://heartbeat.test/ping",
    "ALERTMANAGER_TELEGRAM_BOT_TOKEN": "7000002:alerts-bot-token-for-tests",
    "ALERTMANAGER_TELEGRAM_CRITICAL_CHAT_ID": "-1001",
    "ALERTMANAGER_TELEGRAM_WARNING_CHAT_ID": "-1002",
    "ALERTMANAGER_SLACK_CRITICAL_WEBHOOK_URL": "https://hooks.slack.test/critical",
    "ALERTMANAGER_WEBHOOK_CRITICAL_URL": "https://pager.test/critical",
}


def alertmanager_config(receiver: str, **values: str) -> str:
    """The Alertmanager config compose writes, for ALERTMANAGER_RECEIVER=``receiver``."""
    content = compose()["configs"]["alertmanager-config"]["content"]
    return interpolated(content, {**ALERTING_VALUES, "ALERTMANAGER_RECEIVER": receiver, **values})


def rule_alerts() -> set[str]:
    return {
        r["alert"]
        for path in RULES.parent.glob("*.yml")
        for g in yaml.safe_load(path.read_text())["groups"]
        for r in g["rules"]
        if "alert" in r
    }


@pytest.mark.parametrize("receiver", ["telegram", "slack", "webhook"])
def test_alertmanager_sends_with_the_receiver_the_settings_choose_and_amtool_accepts_it(
    receiver: str, tmp_path: Path
) -> None:
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    targets = [
        t for a in config["alerting"]["alertmanagers"] for s in a["static_configs"] for t in s["targets"]
    ]
    services = compose()["services"]
    assert targets == ["alertmanager:9093"] and "alertmanager" in services
    assert services["prometheus"]["depends_on"]["alertmanager"]["condition"] == "service_healthy"
    filled = alertmanager_config(receiver)
    (tmp_path / "alertmanager.yml").write_text(filled)
    amtool = shutil.which("amtool")
    assert amtool, "amtool not found: `make test` installs it (Debian package prometheus-alertmanager)"
    out = subprocess.run(
        [amtool, "check-config", str(tmp_path / "alertmanager.yml")], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr
    doc = yaml.safe_load(filled)
    receivers = {r["name"]: r for r in doc["receivers"]}
    route = doc["route"]
    # Warnings by default, critical alerts apart and sooner, the heartbeat on its own.
    assert route["receiver"] == f"{receiver}-warning"
    by_matcher = {tuple(r["matchers"]): r for r in route["routes"]}
    assert by_matcher[('severity="critical"',)]["receiver"] == f"{receiver}-critical"
    heartbeat = by_matcher[('alertname="Watchdog"',)]
    assert heartbeat["receiver"] == "heartbeat" and heartbeat["repeat_interval"] == "1m"
    assert next(iter(by_matcher)) == ('alertname="Watchdog"',), "the Watchdog is matched before severities"
    assert (
        receivers["heartbeat"]["webhook_configs"][0]["url"] == ALERTING_VALUES["ALERTMANAGER_HEARTBEAT_URL"]
    )
    kind = {"telegram": "telegram_configs", "slack": "slack_configs", "webhook": "webhook_configs"}[receiver]
    for severity in ("critical", "warning"):
        (sender,) = receivers[f"{receiver}-{severity}"][kind]
        assert sender["send_resolved"] is True
    if receiver == "telegram":
        chats = {
            s: receivers[f"telegram-{s}"]["telegram_configs"][0]["chat_id"] for s in ("critical", "warning")
        }
        assert chats == {"critical": -1001, "warning": -1002}
    # Inhibition: the broker's or Postgres' outage mutes its fallout, alerts that exist; the
    # first rule mutes what either outage causes, the others what Postgres' alone does.
    names = rule_alerts()

    def alerts_of(matcher: str) -> list[str]:
        found = re.search(r'alertname=~?"([^"]+)"', matcher)
        assert found, matcher
        return found.group(1).split("|")

    rules = [
        (alerts_of(r["source_matchers"][0]), alerts_of(r["target_matchers"][0])) for r in doc["inhibit_rules"]
    ]
    # Only a whole outage mutes: one broker node down (RabbitmqDown) mutes nothing.
    assert set(rules[0][0]) == {"RabbitmqUnavailable", "PostgresDown"}
    assert not any(
        "RabbitmqDown" in sources or "ChatqueuePostgresUnreachable" in sources for sources, _ in rules
    )
    for sources, targets_ in rules:
        assert set(sources + targets_) <= names, set(sources + targets_) - names
        assert "Watchdog" not in targets_ and not set(sources) & set(targets_)
    muted_by_postgres = {
        t for s, ts in rules if {"PostgresDown", "ChatqueuePostgresUnreachable"} & set(s) for t in ts
    }
    assert {
        "ChatqueueGaugesStale",
        "ChatqueueConsumerStalled",
        "ChatqueuePostgresUnreachable",
    } <= muted_by_postgres


def test_alertmanager_refuses_to_start_without_a_receiver_or_a_heartbeat() -> None:
    with pytest.raises(AssertionError, match="ALERTMANAGER_RECEIVER"):
        interpolated(compose()["configs"]["alertmanager-config"]["content"], ALERTING_VALUES)
    values = {k: v for k, v in ALERTING_VALUES.items() if k != "ALERTMANAGER_HEARTBEAT_URL"}
    with pytest.raises(AssertionError, match="ALERTMANAGER_HEARTBEAT_URL"):
        interpolated(
            compose()["configs"]["alertmanager-config"]["content"],
            {**values, "ALERTMANAGER_RECEIVER": "slack"},
        )
    example = example_values(DEPLOY / ".env.example")
    assert example["ALERTMANAGER_RECEIVER"] == "telegram"
    assert "CHANGE-ME" in example["ALERTMANAGER_HEARTBEAT_URL"]
    assert "CHANGE-ME" in example["ALERTMANAGER_TELEGRAM_BOT_TOKEN"]


def test_each_service_connects_to_postgres_as_its_own_role_and_only_the_migration_as_the_owner() -> None:
    """shared/roles.py: compose and Kubernetes give each service its own role's URL; the
    owner's (chatq) reaches the migration alone."""
    services = compose()["services"]
    owner = compose()["x-chatqueue"]["environment"]["CHATQ_DATABASE_URL"]
    assert owner.startswith("postgresql://chatq:")
    assert services["migrate"]["environment"]["CHATQ_DATABASE_URL"] == owner  # YAML's merge: the owner's
    initdb = services["postgres"]["environment"]
    for service in ("receiver", "coalescer", "responder"):
        url = services[service]["environment"]["CHATQ_DATABASE_URL"]
        assert url.startswith(f"postgresql://chatq_{service}:${{CHATQ_{service.upper()}_DB_PASSWORD:?"), (
            service
        )
        assert f"CHATQ_{service.upper()}_DB_PASSWORD" in initdb
    docs = kustomize(OVERLAYS[1])
    ours = [f"chatqueue-{s}" for s in ("receiver", "coalescer", "responder")]
    deployments = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] in ours]
    assert len(deployments) == 3
    for d in deployments:
        spec = d["spec"]["template"]["spec"]
        service = d["metadata"]["name"].removeprefix("chatqueue-")
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            env = {e["name"]: e for e in c.get("env", [])}
            if c["args"] == ["shared.migrate"]:
                assert "CHATQ_DATABASE_URL" not in env  # the Secret's: the owner's
                continue
            ref = env["CHATQ_DATABASE_URL"]["valueFrom"]["secretKeyRef"]
            assert ref == {"name": "chatqueue-secrets", "key": f"{service.upper()}_DATABASE_URL"}, c["name"]
