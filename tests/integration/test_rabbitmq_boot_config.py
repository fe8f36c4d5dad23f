"""deploy/rabbitmq on a real RabbitMQ: a second node of the local installation boots
with our rabbitmq.conf, enabled_plugins and the definitions directory exactly as
deploy/compose.yaml mounts them, and we check what a deployment relies on: the
administrator and the application user exist (importing definitions skips the default
user), the application user cannot use the management API yet can declare and use the
chatq.* topology with its narrowed permissions, the quorum
queues and policies are in force, every process can still declare its topology on top
(no argument conflicts), and the broker exports every rabbitmq_* metric that our alert
rules and dashboards read."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import aio_pika
import aiormq.exceptions
import httpx
import pytest
import yaml

from shared.broker.declare import declare_topology
from shared.broker.topology import POLICIES, build_topology
from tests.support.deploy_files import DEPLOY, dashboard_queries, metric_names, rule_queries
from tests.support.processes import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

USER, PASSWORD = "chatq", "boot-test-password-0123"
ADMIN, ADMIN_PASSWORD = "admin", "boot-test-admin-password-4567"

T = TypeVar("T")


@contextlib.contextmanager
def rabbitmq_node() -> Iterator[dict[str, int]]:
    # Not pytest's tmp_path: the node runs as the rabbitmq user, who cannot enter it.
    tmp_path = Path(tempfile.mkdtemp(prefix="chatq-rabbitmq-"))
    tmp_path.chmod(0o755)
    try:
        with _node(tmp_path) as ports:
            yield ports
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)


@contextlib.contextmanager
def _node(tmp_path: Path) -> Iterator[dict[str, int]]:
    server = shutil.which("rabbitmq-server")
    assert server, (
        "this test boots a second node of the local RabbitMQ installation: rabbitmq-server not found"
    )
    ports = {"amqp": free_port(), "management": free_port(), "prometheus": free_port(), "dist": free_port()}
    defs = tmp_path / "definitions.d"
    defs.mkdir()
    shutil.copy(DEPLOY / "rabbitmq" / "definitions.json", defs / "10-topology.json")
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    users = compose["configs"]["rabbitmq-users"]["content"]
    for name, value in {
        "RABBITMQ_USER": USER, "RABBITMQ_PASSWORD": PASSWORD,
        "RABBITMQ_ADMIN_USER": ADMIN, "RABBITMQ_ADMIN_PASSWORD": ADMIN_PASSWORD,
    }.items():  # fmt: skip
        users = users.replace("${" + name + "}", value)
    (defs / "00-users.json").write_text(users)
    conf = (DEPLOY / "rabbitmq" / "rabbitmq.conf").read_text()
    conf = (
        conf.replace("/etc/rabbitmq/definitions.d", str(defs))
        .replace("listeners.tcp.default = 5672", f"listeners.tcp.default = {ports['amqp']}")
        .replace("management.tcp.port = 15672", f"management.tcp.port = {ports['management']}")
        .replace("prometheus.tcp.port = 15692", f"prometheus.tcp.port = {ports['prometheus']}")
    )
    (tmp_path / "rabbitmq.conf").write_text(conf)
    node = f"chatqboot{ports['amqp']}@localhost"
    if os.geteuid() == 0:  # rabbitmq-server drops to the rabbitmq user
        uid = pwd.getpwnam("rabbitmq").pw_uid
        for p in [tmp_path, *tmp_path.rglob("*")]:
            os.chown(p, uid, -1)
    env = {
        **os.environ,
        "RABBITMQ_NODENAME": node,
        "RABBITMQ_CONFIG_FILE": str(tmp_path / "rabbitmq"),
        "RABBITMQ_ENABLED_PLUGINS_FILE": str(DEPLOY / "rabbitmq" / "enabled_plugins"),
        "RABBITMQ_MNESIA_BASE": str(tmp_path / "mnesia"),
        "RABBITMQ_LOG_BASE": str(tmp_path / "log"),
        "RABBITMQ_PID_FILE": str(tmp_path / "node.pid"),
        "RABBITMQ_DIST_PORT": str(ports["dist"]),
    }
    log = (tmp_path / "console.log").open("w")
    proc = subprocess.Popen([server], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        with httpx.Client(auth=(ADMIN, ADMIN_PASSWORD), timeout=5) as client:
            while True:
                assert proc.poll() is None, (
                    "the node did not boot:\n" + (tmp_path / "console.log").read_text()[-3000:]
                )
                with contextlib.suppress(httpx.HTTPError):
                    r = client.get(f"http://127.0.0.1:{ports['management']}/api/whoami")
                    if r.status_code == 200:
                        break
                assert time.monotonic() < deadline, (tmp_path / "console.log").read_text()[-3000:]
                time.sleep(1)
        yield ports
    finally:
        subprocess.run(["rabbitmqctl", "-n", node, "stop"], capture_output=True, timeout=60, check=False)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
        log.close()


async def declare_on(port: int) -> None:
    """As the application user: declare the topology, publish through it, consume."""
    connection = await aio_pika.connect(f"amqp://{USER}:{PASSWORD}@127.0.0.1:{port}/")
    async with connection:
        await declare_topology(await connection.channel(), build_topology())
        channel = await connection.channel(publisher_confirms=True)
        jobs = await channel.get_exchange("chatq.jobs", ensure=True)
        await jobs.publish(aio_pika.Message(b"{}", message_id="boot-test"), routing_key="reply")
        queue = await channel.get_queue("chatq.responder", ensure=True)
        message = await queue.get(timeout=10)
        assert message is not None and message.message_id == "boot-test"
        await message.ack()


async def refused_outside_chatq(port: int) -> None:
    connection = await aio_pika.connect(f"amqp://{USER}:{PASSWORD}@127.0.0.1:{port}/")
    async with connection:
        channel = await connection.channel()
        with pytest.raises(aiormq.exceptions.ChannelAccessRefused):
            await channel.declare_queue("not-chatq", durable=True)


def settled(read: Callable[[], T], done: Callable[[T], bool], *, within: float = 30.0) -> T:
    """What ``read`` returns once ``done`` holds for it; fails with the last reading after
    ``within`` seconds."""
    deadline = time.monotonic() + within
    while not done(value := read()):
        assert time.monotonic() < deadline, value
        time.sleep(0.5)
    return value


def test_a_node_booted_with_the_deploy_config_has_our_user_topology_policies_and_metrics() -> None:
    with rabbitmq_node() as ports:
        api = f"http://127.0.0.1:{ports['management']}/api"
        with httpx.Client(auth=(ADMIN, ADMIN_PASSWORD), timeout=10) as client:
            whoami = client.get(f"{api}/whoami").json()
            assert whoami["name"] == ADMIN
            # The application user is no administrator: no management API, no UI.
            assert httpx.get(f"{api}/whoami", auth=(USER, PASSWORD), timeout=10).status_code == 401
            overview = client.get(f"{api}/overview").json()
            # docs/deploying.md "Supported versions": the tested line is 3.10.
            assert overview["rabbitmq_version"].startswith("3.10."), overview["rabbitmq_version"]
            topology = build_topology()
            expected = {q.name for q in topology.queues}
            # The management API lists a queue, and shows its policy, only once the queue's
            # stats have been emitted, a few seconds after boot: read until they settle.
            queues = settled(
                lambda: {q["name"]: q for q in client.get(f"{api}/queues/%2F").json()},
                lambda queues: set(queues) == expected,
            )
            assert {q["type"] for q in queues.values()} == {"quorum"}
            policies = {p["name"] for p in client.get(f"{api}/policies/%2F").json()}
            assert policies == {p.name for p in POLICIES}
            dead = settled(
                lambda: client.get(f"{api}/queues/%2F/chatq.responder.dead").json(),
                lambda dead: "policy" in dead,
            )
            assert dead["policy"] == "chatq-dead-letters"
            assert dead["effective_policy_definition"]["message-ttl"] > 0

            # Every process declares the same topology at start: no argument conflicts.
            asyncio.run(declare_on(ports["amqp"]))
            asyncio.run(refused_outside_chatq(ports["amqp"]))
            scrape = client.get(f"http://127.0.0.1:{ports['prometheus']}/metrics").text
    exported = {
        line.split("{")[0].split(" ")[0] for line in scrape.splitlines() if line and not line.startswith("#")
    }
    assert 'queue="chatq.responder.dead"' in scrape, "per-queue metrics are needed by the dead-letter alert"
    used = set()
    rules = DEPLOY / "prometheus" / "rules" / "chatqueue.yml"
    exprs = rule_queries(rules) + [
        e for p in (DEPLOY / "grafana" / "dashboards").glob("*.json") for e in dashboard_queries(p)
    ]
    for e in exprs:
        used |= {n for n in metric_names(e) if n.startswith("rabbitmq_")}
    assert used, "the dashboards read no rabbitmq_* metric: the check itself broke"
    assert not used - exported, f"RabbitMQ does not export {sorted(used - exported)}"
