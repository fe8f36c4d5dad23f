"""The image and deploy/compose.yaml, run for real: built by tests/containers/run.sh (which
starts a Docker engine in a private network namespace and runs this file inside it), then
driven through the containers, not beside them. The fake platforms run in this process
and the containers reach them as ``fakes`` (the namespace's gateway).

What the stack runs is deploy/compose.yaml as shipped, with an override that only swaps
in the images built here (stand-ins for Postgres, RabbitMQ, Prometheus, Alertmanager and
the Postgres exporter from Debian's packages), lets the containers reach the fakes,
publishes Postgres inside the namespace for the accounting queries, and makes Prometheus
quicker (5 s scrapes, ChatqueueTargetDown's `for` 10 s instead of 2 min: the `for`
durations are promtool's to test, deploy/prometheus/tests).

The tests run in file order against one stack (each says what it leaves behind)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import shutil
import subprocess
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
import yaml

from chaos.runner import Event, deliver, verdict
from tests.fakes.platforms import running_fakes
from tests.fakes.world import FakeWorld
from tests.support.deploy_files import image_packages
from tests.support.payloads import telegram_update

pytestmark = pytest.mark.containers

PROJECT = "chatq-ct"
SERVICES = ("receiver", "coalescer", "responder")
STACK = (
    "postgres", "rabbitmq", "migrate", *SERVICES, "prometheus", "alertmanager", "postgres-exporter",
)  # fmt: skip
ALERTS_BOT = "7000002"
CRITICAL_CHAT, WARNING_CHAT = -1001, -1002
TARGET_DOWN_FOR = "10s"


def _env(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        pytest.fail(
            f"{name} is not set: run the container tests through tests/containers/run.sh "
            "(`make containers`), which builds the images and starts the engine",
            pytrace=False,
        )
    return value


def log(message: str) -> None:
    """The transcript: what happened, when, on the test's output (pytest -s shows it)."""
    print(f"[stack {time.monotonic() - STARTED:6.1f}s] {message}", flush=True)


STARTED = time.monotonic()


def token() -> str:
    return secrets.token_urlsafe(24)


@dataclass
class Stack:
    workdir: Path
    repo: Path
    image: str
    fakes: FakeWorld
    env: dict[str, str] = field(default_factory=dict)
    chatq_env: dict[str, str] = field(default_factory=dict)

    @property
    def fakes_url(self) -> str:
        return f"http://fakes:{self.fakes.url.rsplit(':', 1)[1]}"

    def write(self, image: str) -> None:
        """The env files and the override, for ``image``."""
        env = {**self.env, "CHATQ_IMAGE": image}
        (self.workdir / "compose.env").write_text("".join(f"{k}={v}\n" for k, v in env.items()))
        (self.workdir / "chatqueue.env").write_text("".join(f"{k}={v}\n" for k, v in self.chatq_env.items()))

    def compose(
        self, *args: str, check: bool = True, timeout: float = 300, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        cmd = [
            "docker", "compose", "-p", PROJECT, "--env-file", str(self.workdir / "compose.env"),
            "-f", str(self.repo / "deploy" / "compose.yaml"), "-f", str(self.workdir / "override.yaml"), *args,
        ]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, input=input)
        if check and out.returncode != 0:
            logs = subprocess.run(
                [*cmd[: len(cmd) - len(args)], "logs", "--tail", "30"],
                capture_output=True,
                text=True,
            )
            raise AssertionError(
                f"docker compose {' '.join(args)} exited {out.returncode}:\n{out.stdout}\n{out.stderr}\n{logs.stdout[-6000:]}"
            )
        return out

    def up(self, image: str, *services: str) -> float:
        self.write(image)
        started = time.monotonic()
        self.compose("up", "-d", "--no-build", "--wait", "--wait-timeout", "180", *(services or STACK))
        return time.monotonic() - started

    def container(self, service: str) -> str:
        return self.compose("ps", "-q", service).stdout.strip()

    def docker(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        out = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=120)
        if check and out.returncode != 0:
            raise AssertionError(f"docker {' '.join(args)}: {out.stdout}{out.stderr}")
        return out

    def logs(self, service: str) -> str:
        return self.compose("logs", "--no-log-prefix", service).stdout

    def database_url(self) -> str:
        return f"postgresql://postgres:{self.env['POSTGRES_PASSWORD']}@127.0.0.1:15432/chatqueue"


def override(workdir: Path) -> dict[str, Any]:
    """Only what the shipped compose file cannot have here: local images, the way to the
    fakes, Postgres reachable from the test, and a quicker Prometheus."""
    fakes = {"extra_hosts": ["fakes:host-gateway"]}
    return {
        "services": {
            "postgres": {"image": "localhost/postgres-debian:ci", "ports": ["127.0.0.1:15432:5432"]},
            "rabbitmq": {"image": "localhost/rabbitmq-debian:ci"},
            "postgres-exporter": {"image": "localhost/postgres-exporter-debian:ci"},
            "prometheus": {
                "image": "localhost/prometheus-debian:ci",
                "volumes": [
                    f"{workdir / 'prometheus.yml'}:/etc/prometheus/prometheus.yml:ro",
                    f"{workdir / 'rules'}:/etc/prometheus/rules:ro",
                ],
            },
            "alertmanager": {"image": "localhost/alertmanager-debian:ci", **fakes},
            **{name: fakes for name in ("migrate", *SERVICES)},
        }
    }


def quick_prometheus(repo: Path, workdir: Path) -> None:
    config = yaml.safe_load((repo / "deploy" / "prometheus" / "prometheus.yml").read_text())
    config["global"] = {"scrape_interval": "5s", "evaluation_interval": "5s"}
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config, sort_keys=False))
    rules = workdir / "rules"
    rules.mkdir(exist_ok=True)
    for path in (repo / "deploy" / "prometheus" / "rules").glob("*.yml"):
        doc = yaml.safe_load(path.read_text())
        for group in doc["groups"]:
            for rule in group["rules"]:
                if rule.get("alert") == "ChatqueueTargetDown":
                    rule["for"] = TARGET_DOWN_FOR
        (rules / path.name).write_text(yaml.safe_dump(doc, sort_keys=False))


@pytest.fixture(scope="module")
async def stack() -> AsyncIterator[Stack]:
    workdir = Path(_env("CHATQ_CT_WORKDIR"))
    repo = Path(_env("CHATQ_CT_REPO"))
    image = _env("CHATQ_CT_IMAGE")
    async with running_fakes(host="0.0.0.0") as world:
        s = Stack(workdir, repo, image, world)
        s.env = {
            "POSTGRES_PASSWORD": token(), "CHATQ_DB_PASSWORD": token(), "POSTGRES_MONITOR_PASSWORD": token(),
                "CHATQ_RECEIVER_DB_PASSWORD": token(), "CHATQ_COALESCER_DB_PASSWORD": token(),
                "CHATQ_RESPONDER_DB_PASSWORD": token(),
            "RABBITMQ_ADMIN_USER": "admin", "RABBITMQ_ADMIN_PASSWORD": token(),
            "RABBITMQ_USER": "chatq", "RABBITMQ_PASSWORD": token(),
            "RABBITMQ_ERLANG_COOKIE": token(), "GRAFANA_ADMIN_PASSWORD": token(),
            "ALERTMANAGER_RECEIVER": "telegram",
            "ALERTMANAGER_TELEGRAM_API_URL": s.fakes_url,
            "ALERTMANAGER_TELEGRAM_BOT_TOKEN": f"{ALERTS_BOT}:{token()}",
            "ALERTMANAGER_TELEGRAM_CRITICAL_CHAT_ID": str(CRITICAL_CHAT),
            "ALERTMANAGER_TELEGRAM_WARNING_CHAT_ID": str(WARNING_CHAT),
            "ALERTMANAGER_HEARTBEAT_URL": f"{s.fakes_url}/alerts",
            "CHATQ_ENV_FILE": str(workdir / "chatqueue.env"),
        }  # fmt: skip
        s.chatq_env = {
            "CHATQ_ADMIN_TOKEN": token(),
            "CHATQ_TELEGRAM_BOT_TOKEN": f"7000001:{token()}",
            "CHATQ_TELEGRAM_WEBHOOK_SECRET": token(),
            "CHATQ_TELEGRAM_API_BASE": s.fakes_url,
            "CHATQ_LOG_FORMAT": "json",
            "CHATQ_QUIET_SECONDS": "0.5",
            "CHATQ_REPLY_DELAY_MIN_SECONDS": "1",
            "CHATQ_REPLY_DELAY_MAX_SECONDS": "2",
            "CHATQ_MAX_WAIT_SECONDS": "10",
        }
        (workdir / "override.yaml").write_text(yaml.safe_dump(override(workdir)))
        quick_prometheus(repo, workdir)
        took = s.up(image)
        log(f"stack up with {image} in {took:.0f} s: " + ", ".join(STACK))
        log(
            s.compose("ps", "-a", "--format", "table {{.Service}}\t{{.Status}}")
            .stdout.strip()
            .replace("\n", "\n    ")
        )
        try:
            yield s
        finally:
            if os.environ.get("KEEP") == "1":
                (workdir / "stack.log").write_text(s.compose("logs", check=False).stdout)
            started = time.monotonic()
            s.compose("down", "-v", "--remove-orphans", "-t", "30", check=False)
            log(f"stack down in {time.monotonic() - started:.0f} s")


@pytest.fixture(scope="module")
async def pool(stack: Stack) -> AsyncIterator[asyncpg.Pool]:
    async with asyncpg.create_pool(stack.database_url(), min_size=1, max_size=3) as p:
        yield p


def webhook(stack: Stack) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url="http://127.0.0.1:8080", timeout=10)


async def post_message(stack: Stack, chat: int, message_id: int, text: str) -> None:
    async with webhook(stack) as client:
        r = await client.post(
            "/v1/webhooks/telegram",
            json=telegram_update(message_id, chat_id=chat, text=text),
            headers={"X-Telegram-Bot-Api-Secret-Token": stack.chatq_env["CHATQ_TELEGRAM_WEBHOOK_SECRET"]},
        )
    assert r.status_code == 200, r.text


def replies(world: FakeWorld, chat: int) -> list[dict[str, Any]]:
    return [m for m in world.telegram if str(m["chat_id"]) == str(chat)]


async def until(what: str, check: Any, within: float = 60.0, every: float = 0.5) -> Any:
    deadline = time.monotonic() + within
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {within:.0f} s: {what}")
        await asyncio.sleep(every)


async def answered_once(stack: Stack, chat: int, message_id: int, text: str) -> float:
    started = time.monotonic()
    await post_message(stack, chat, message_id, text)
    await until(f"a reply in chat {chat}", lambda: replies(stack.fakes, chat), within=60)
    await asyncio.sleep(3)  # a second reply would come within the reply delay (1-2 s)
    got = replies(stack.fakes, chat)
    assert len(got) == 1, got
    return time.monotonic() - started


# ---- through the containers --------------------------------------------------------------


async def test_a_buyer_message_posted_to_the_receiver_is_answered_once_through_the_fake_platform(
    stack: Stack,
) -> None:
    took = await answered_once(stack, 424201, 1, "Hello, is the blue kettle still available?")
    (reply,) = replies(stack.fakes, 424201)
    log(f"message answered once in {took:.1f} s (reply {reply['message_id']}: {reply['text'][:60]!r})")


async def test_killing_the_responder_and_the_coalescer_mid_burst_loses_and_duplicates_nothing(
    stack: Stack, pool: asyncpg.Pool
) -> None:
    chats, per_chat = 30, 3
    events = [
        Event(
            "telegram",
            str(500000 + c),
            str(100 + i),
            f"burst message {i} in chat {c}",
            at=(c % 10) * 0.6 + i * 0.3,
        )
        for c in range(chats)
        for i in range(per_chat)
    ]
    started = time.monotonic()

    async def send() -> None:
        async with webhook(stack) as client:

            async def one(e: Event) -> None:
                await asyncio.sleep(max(0.0, started + e.at - time.monotonic()))
                secret = stack.chatq_env["CHATQ_TELEGRAM_WEBHOOK_SECRET"]
                await deliver(client, e, time.monotonic() + 60, telegram_secret=secret)

            await asyncio.gather(*(one(e) for e in events))

    async def kill() -> None:
        await asyncio.sleep(2.0)
        stack.docker("kill", stack.container("responder"))
        log("docker kill responder (mid-burst)")
        await asyncio.sleep(1.5)
        stack.docker("kill", stack.container("coalescer"))
        log("docker kill coalescer (mid-burst)")

    await asyncio.gather(send(), kill())
    log(f"burst of {len(events)} messages in {chats} chats delivered in {time.monotonic() - started:.1f} s")
    took = stack.up(stack.image, "coalescer", "responder")
    log(f"responder and coalescer started again, healthy in {took:.0f} s")
    await until(
        "every message final",
        lambda: pool.fetchval(
            "SELECT count(*) = 0 FROM operations WHERE status NOT IN ('replied','failed','needs_review','ignored')"
        ),
        within=120,
    )
    v = await verdict("containers: kills mid-burst", pool, stack.fakes, [events], restarts=2, seconds=0)
    log(
        f"accounting: attempted {v.attempted}, acknowledged {v.acknowledged}, stored {v.stored}, "
        f"replied {v.replied}, failed {v.failed}, needs review {v.needs_review}, lost {v.lost}, "
        f"duplicated {v.duplicated}, out of order {v.out_of_order}"
    )
    assert v.acknowledged == v.attempted == v.stored
    assert (v.lost, v.duplicated, v.out_of_order) == (0, 0, 0), v
    statuses = {
        s["State"]["Status"]: s["RestartCount"]
        for s in json.loads(stack.docker("inspect", stack.container("responder")).stdout)
    }
    assert "running" in statuses


async def test_prometheus_scrapes_every_target_of_the_stack(stack: Stack) -> None:
    async with httpx.AsyncClient(base_url="http://127.0.0.1:9090", timeout=5) as client:

        async def all_up() -> list[dict[str, Any]] | None:
            targets = (await client.get("/api/v1/targets")).json()["data"]["activeTargets"]
            return targets if targets and all(t["health"] == "up" for t in targets) else None

        targets = await until("every Prometheus target up", all_up, within=60, every=1)
    jobs = sorted(t["labels"]["job"] for t in targets)
    assert jobs == sorted(
        ["chatqueue-receiver", "chatqueue-coalescer", "chatqueue-responder", "rabbitmq", "postgres"]
    )
    log("Prometheus targets up: " + ", ".join(jobs))
    async with httpx.AsyncClient(base_url="http://127.0.0.1:9090", timeout=5) as client:
        r = await client.get("/api/v1/query", params={"query": "pg_up"})
    assert [x["value"][1] for x in r.json()["data"]["result"]] == ["1"], r.text


async def test_stopping_the_responder_sends_an_alert_through_alertmanager_to_telegram(stack: Stack) -> None:
    await until("the Watchdog heartbeat", lambda: heartbeats(stack.fakes), within=120)
    log(f"Watchdog heartbeat received by ALERTMANAGER_HEARTBEAT_URL ({len(heartbeats(stack.fakes))} so far)")
    stopped = time.monotonic()
    stack.compose("stop", "-t", "30", "responder")
    log("docker compose stop responder")

    def alert() -> list[dict[str, Any]]:
        return [
            m
            for m in stack.fakes.telegram
            if str(m["bot"]) == ALERTS_BOT and "ChatqueueTargetDown" in m["text"] and "FIRING" in m["text"]
        ]

    try:
        (message, *_) = await until("ChatqueueTargetDown in the alerts chat", alert, within=120, every=1)
    except AssertionError:
        print(stack.compose("logs", "--tail", "20", "alertmanager", "prometheus", check=False).stdout)
        raise
    finally:
        took = stack.up(stack.image, "responder")
        log(f"responder started again, healthy in {took:.0f} s")
    log(f"alert delivered to the fake Telegram {time.monotonic() - stopped:.0f} s after the stop:")
    log("    " + message["text"].replace("\n", "\n    "))
    assert str(message["chat_id"]) == str(CRITICAL_CHAT), "critical alerts go to the critical chat"
    for number in ("Backlog", "Receipt-to-reply", "Failed share", "Retries"):
        assert number in message["text"], f"the README's {number!r} is not in the alert"
    assert "chatqueue-responder" in message["text"]
    assert not stack.fakes.violations, stack.fakes.violations


def heartbeats(world: FakeWorld) -> list[dict[str, Any]]:
    return [a for a in world.alerts if a["body"].get("receiver") == "heartbeat"]


async def test_the_documented_monitoring_user_reads_queue_lengths_as_keda_does(stack: Stack) -> None:
    """KEDA's rabbitmq scaler (protocol http) asks GET /api/queues/<vhost>/<queue>. With the
    monitoring tag alone, RabbitMQ 3.10 answers 401; with deploy/rabbitmq/add-monitoring-user.sh
    (vhost access, empty permissions) it answers the queue's length."""
    password = token()
    url = "http://127.0.0.1:15672/api/queues/%2F/chatq.responder"

    def rabbitmqctl(*args: str) -> None:
        stack.compose("exec", "-T", "rabbitmq", "rabbitmqctl", "-q", *args)

    rabbitmqctl("add_user", "chatq-monitor-tag-only", password)
    rabbitmqctl("set_user_tags", "chatq-monitor-tag-only", "monitoring")
    script = (stack.repo / "deploy" / "rabbitmq" / "add-monitoring-user.sh").read_text()
    stack.compose("exec", "-T", "rabbitmq", "env", f"MONITOR_PASSWORD={password}", "sh", "-s", input=script)
    async with httpx.AsyncClient(timeout=5) as client:
        tag_only = await client.get(url, auth=("chatq-monitor-tag-only", password))
        documented = await client.get(url, auth=("chatq-monitor", password))
        publish = await client.post(
            "http://127.0.0.1:15672/api/exchanges/%2F/chatq.jobs/publish",
            auth=("chatq-monitor", password),
            json={"properties": {}, "routing_key": "x", "payload": "x", "payload_encoding": "string"},
        )
    assert tag_only.status_code == 401, tag_only.text
    assert documented.status_code == 200, documented.text
    assert {"messages", "messages_ready", "messages_unacknowledged"} <= set(documented.json())
    # Refused: 401/403, or 400 with the broker's access_refused (empty write permission).
    assert publish.status_code in (400, 401, 403), (publish.status_code, publish.text)
    assert "routed" not in publish.text, publish.text
    log(
        f"KEDA's query as a monitoring-tag-only user: {tag_only.status_code}; as the documented user: "
        f"{documented.status_code}, messages {documented.json()['messages']}; its publish: "
        f"{publish.status_code} {publish.text[:120]}"
    )


# ---- the image ------------------------------------------------------------------------------


async def test_every_chatqueue_container_runs_as_a_non_root_user_on_a_read_only_root(stack: Stack) -> None:
    for service in SERVICES:
        (info,) = json.loads(stack.docker("inspect", stack.container(service)).stdout)
        assert info["Config"]["User"] == "10001:10001", service
        assert info["HostConfig"]["ReadonlyRootfs"] is True, service
        assert info["HostConfig"]["CapDrop"] == ["ALL"], service
        assert stack.compose("exec", "-T", service, "id", "-u").stdout.strip() == "10001"
        wrote = stack.compose("exec", "-T", service, "touch", "/app/x", check=False)
        assert wrote.returncode != 0 and "Read-only file system" in wrote.stderr, wrote.stderr
    log("receiver, coalescer, responder: uid 10001, read-only root file system, every capability dropped")


async def test_a_start_up_failure_is_one_json_log_line(stack: Stack) -> None:
    out = stack.compose(
        "run", "--rm", "--no-deps", "-e", "CHATQ_ADMIN_TOKEN=CHANGE-ME-admin-token-32-characters", "receiver",
        check=False,
    )  # fmt: skip
    assert out.returncode == 1, (out.returncode, out.stdout, out.stderr)
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]
    lines = [line for line in lines if not re.match(r"^(Container|Network|Volume) ", line)]  # compose's own
    assert len(lines) == 1, lines
    record = json.loads(lines[0])
    assert record["level"] == "ERROR" and record["service"] == "receiver"
    assert "CHATQ_ADMIN_TOKEN" in record["message"] and "traceback" not in record
    log(f"a start-up failure: one JSON line: {lines[0][:200]}")


# ---- upgrade and rollback -------------------------------------------------------------------


def next_release_context(repo: Path, into: Path, migration: int) -> None:
    """The image's build context as the next release would be: a migration more and a
    function file changed (a new release of it that keeps every signature)."""
    for name in ("pyproject.toml", "constraints.txt", "README.md", "Dockerfile", ".dockerignore"):
        shutil.copy2(repo / name, into / name)
    for name in image_packages():
        shutil.copytree(repo / name, into / name, ignore=shutil.ignore_patterns("__pycache__"))
    (into / "shared" / "migrations" / f"{migration:04d}_ci_next_release.sql").write_text(
        "CREATE TABLE ci_next_release (id integer PRIMARY KEY);\n"
    )
    functions = into / "stores" / "accounts" / "functions" / "50_accounts.sql"
    from shared.migrate import stamp

    functions.write_text(
        functions.read_text()
        + "\n-- The next release's addition: a function the previous release does not call.\n"
        "CREATE OR REPLACE FUNCTION chatq_ci_next_release() RETURNS integer LANGUAGE sql AS $$ SELECT 1 $$;\n"
    )
    stamp(functions)


async def test_an_upgrade_applies_the_new_release_and_a_rollback_runs_on_its_functions(
    stack: Stack, pool: asyncpg.Pool, tmp_path: Path
) -> None:
    from shared.migrate import read_header

    previous = stack.image
    migration = 1 + max(int(p.name[:4]) for p in (stack.repo / "shared" / "migrations").glob("*.sql"))
    next_release_context(stack.repo, tmp_path, migration)
    started = time.monotonic()
    stack.docker(
        "build", "-q", "--network", "host", "--build-arg", "PYTHON_IMAGE=" + _env("CHATQ_CT_PYTHON_IMAGE"),
        "-t", "chatqueue:ci-next", str(tmp_path),
    )  # fmt: skip
    log(f"the next release's image chatqueue:ci-next built in {time.monotonic() - started:.0f} s")
    release = read_header(
        (tmp_path / "stores" / "accounts" / "functions" / "50_accounts.sql").read_text()
    ).release

    took = stack.up("chatqueue:ci-next")
    log(f"upgrade: compose up with chatqueue:ci-next, healthy in {took:.0f} s")
    print(stack.logs("migrate")[-2000:])
    assert await pool.fetchval("SELECT max(version) FROM schema_migrations") == migration
    assert (
        await pool.fetchval("SELECT release FROM schema_functions WHERE name = '50_accounts.sql'") == release
    )
    await answered_once(stack, 424202, 1, "After the upgrade: do you deliver on Sundays?")
    log("upgrade: a message answered once")
    again = stack.compose("run", "--rm", "migrate")
    assert "applied 0 migration(s)" in again.stdout, again.stdout
    log("upgrade: the migration run again applies nothing")

    took = stack.up(previous)
    migrate_log = stack.logs("migrate")
    log(f"rollback: compose up with {previous}, healthy in {took:.0f} s")
    assert (
        await pool.fetchval("SELECT release FROM schema_functions WHERE name = '50_accounts.sql'") == release
    )
    assert await pool.fetchval("SELECT to_regproc('chatq_ci_next_release') IS NOT NULL"), "newer bodies kept"
    newer = [
        json.loads(line) for line in migrate_log.splitlines() if "newer" in line and line.startswith("{")
    ]
    assert newer, migrate_log[-3000:]
    log(f"rollback: migrate says: {newer[-1]['message']}")
    await answered_once(stack, 424203, 1, "After the rollback: is the kettle still there?")
    log("rollback: a message answered once, the newer function bodies kept")
