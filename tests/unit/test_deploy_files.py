"""Static checks of deploy/ that need no Docker engine and no cluster: the compose file
against the Compose specification, the kustomize output against Kubernetes' schemas,
Prometheus config, rules and their unit tests through promtool, dashboards' PromQL, and
every chatq_* metric they read being one the services export."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from pydantic import ValidationError

from shared.broker.topology import build_topology
from shared.settings import GUARDED_SECRETS, Settings
from tests.support.deploy_files import (
    DEPLOY,
    RABBITMQ_TRIGGER_KEYS,
    ROOT,
    SCALED_OBJECT_SCHEMA,
    TRIGGER_AUTHENTICATION_SCHEMA,
    dashboard_queries,
    exported_chatq_metrics,
    kustomize,
    metric_names,
    promtool,
    recorded_names,
    rule_queries,
)

pytestmark = pytest.mark.unit

COMPOSE = DEPLOY / "compose.yaml"
RULES = DEPLOY / "prometheus" / "rules" / "chatqueue.yml"
DASHBOARDS = sorted((DEPLOY / "grafana" / "dashboards").glob("*.json"))
OVERLAYS = [DEPLOY / "k8s" / "overlays" / name for name in ("dev", "prod")]
KUBERNETES_VERSION = "1.30.0"
SETTINGS_ENV = {f"CHATQ_{name.upper()}" for name in Settings.model_fields}


def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


# ---- compose ---------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["compose.yaml", "compose.dev.yaml"])
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
        "postgres", "rabbitmq", "migrate", "receiver", "coalescer", "responder", "prometheus", "grafana",
    }  # fmt: skip
    for name in ("receiver", "coalescer", "responder"):
        svc = services[name]
        assert svc["command"] == [f"services.{name}"]
        assert svc["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
        assert svc["depends_on"]["rabbitmq"]["condition"] == "service_healthy"
        assert "readyz" in " ".join(svc["healthcheck"]["test"])
        assert svc["environment"]["CHATQ_ENV"] == "production"
        grace = float(svc["environment"]["CHATQ_SHUTDOWN_GRACE_SECONDS"])
        assert float(svc["stop_grace_period"].rstrip("s")) > grace, (
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
    assert set(n for n, p in published.items() if p) == {"rabbitmq", "receiver", "prometheus", "grafana"}
    for name, ports in published.items():
        for port in ports:
            assert re.fullmatch(r"\$\{[A-Z_]+_BIND:-127\.0\.0\.1\}:\d+:\d+", port), (name, port)
    assert not [p for ports in published.values() for p in ports if p.endswith(":5672")], "AMQP stays inside"


def test_the_compose_stack_takes_every_secret_from_the_env_files_and_passes_only_known_settings() -> None:
    text = COMPOSE.read_text()
    for var in ("POSTGRES_PASSWORD", "RABBITMQ_PASSWORD", "GRAFANA_ADMIN_PASSWORD"):
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
    users = compose()["configs"]["rabbitmq-users"]["content"]
    filled = users.replace("${RABBITMQ_USER}", "chatq").replace("${RABBITMQ_PASSWORD}", "secret")
    doc = json.loads(filled)
    assert doc["vhosts"] == [{"name": "/"}], "permissions need the vhost before the topology file"
    assert doc["permissions"][0]["user"] == "chatq"


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
    assert {"Deployment", "Job", "PodDisruptionBudget", "ScaledObject", "ConfigMap", "Service"} <= kinds
    for doc in docs:
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        if doc["apiVersion"].startswith("keda.sh/"):
            schema = SCALED_OBJECT_SCHEMA if doc["kind"] == "ScaledObject" else TRIGGER_AUTHENTICATION_SCHEMA
            jsonschema.validate(doc, schema)
            continue
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(f"{where}: {exc.message} at {list(exc.path)}") from exc


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_every_deployment_has_probes_limits_a_budget_and_a_grace_period_that_covers_the_drain(
    overlay: Path,
) -> None:
    docs = kustomize(overlay)
    config = next(
        d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("chatqueue-config")
    )
    drain = float(config["data"]["CHATQ_SHUTDOWN_GRACE_SECONDS"])
    assert set(config["data"]) <= SETTINGS_ENV, set(config["data"]) - SETTINGS_ENV
    deployments = [d for d in docs if d["kind"] == "Deployment"]
    assert {d["metadata"]["name"] for d in deployments} == {
        "chatqueue-receiver", "chatqueue-coalescer", "chatqueue-responder",
    }  # fmt: skip
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
        assert pod["terminationGracePeriodSeconds"] >= drain + pre_stop + 5
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        assert pod["initContainers"][0]["args"][:2] == ["shared.migrate", "--wait"]
        annotations = dep["spec"]["template"]["metadata"]["annotations"]
        port = int(annotations["prometheus.io/port"])
        assert port in {p["containerPort"] for p in container["ports"]}
        assert component in budgets
        refs = {e.get("secretRef", e.get("configMapRef"))["name"] for e in container["envFrom"]}
        assert refs == {config["metadata"]["name"], "chatqueue-secrets"}
    job = next(d for d in docs if d["kind"] == "Job")
    assert job["spec"]["template"]["spec"]["containers"][0]["args"] == ["shared.migrate"]


def test_the_dev_overlay_settings_pass_the_guards_its_pods_apply_and_keep_the_sandbox() -> None:
    docs = kustomize(OVERLAYS[0])
    config = next(d for d in docs if d["kind"] == "ConfigMap")["data"]
    secret = next(d for d in docs if d["kind"] == "Secret")["data"]
    values = {**config, **{k: base64.b64decode(v).decode() for k, v in secret.items()}}
    settings = Settings(**{k.removeprefix("CHATQ_").lower(): v for k, v in values.items()})
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
        ref = auth[trigger["authenticationRef"]["name"]]["spec"]["secretTargetRef"][0]
        assert (ref["parameter"], ref["name"], ref["key"]) == ("host", "chatqueue-secrets", "CHATQ_AMQP_URL")
        assert obj["spec"]["minReplicaCount"] >= 2, "two replicas keep serving while one restarts"


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
    out = subprocess.run(
        [promtool(), "test", "rules", str(DEPLOY / "prometheus" / "tests" / "chatqueue-alerts.test.yml")],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    alerts = {
        r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r
    }
    assert {
        "ChatqueueBacklogGrowing", "ChatqueueRepliesSlowWhileBacklogShort", "ChatqueueFailedShareHigh",
        "ChatqueueRetriesRising", "ChatqueueOutboxLagging", "ChatqueueOldestUnfinishedTooOld",
        "ChatqueueDeadLetters",
    } <= alerts  # fmt: skip


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
    assert all(n.startswith("rabbitmq_") for n in others), others
    # The dashboard covers the four numbers, oldest unfinished, outbox and emission lag.
    for needed in (
        "chatq_backlog", "chatq_receipt_to_reply_seconds_bucket", "chatq_operations_total",
        "chatq_retries_total", "chatq_oldest_unfinished_age_seconds", "chatq_outbox_lag_seconds",
        "chatq_coalescer_emission_lag_seconds_bucket", "chatq_platform_request_seconds_bucket",
    ):  # fmt: skip
        assert "chatqueue.json" in used.get(needed, set()), needed


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
