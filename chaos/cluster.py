"""A local three-node RabbitMQ cluster of the installed RabbitMQ, beside the machine's
default node (which it leaves alone): for ``make cluster``, the cluster chaos scenario
and the tests that lose a broker node.

Each node is a ``rabbitmq-server -detached`` with its own node name, AMQP, distribution
and management ports, config file, data, logs, feature flags and plugins file, all in
one directory of its own (the server drops to the ``rabbitmq`` user, so that user owns
it). The nodes share the installed node's Erlang cookie (``/var/lib/rabbitmq``, the
``rabbitmq`` user's home), which is what lets them cluster and ``rabbitmqctl`` reach
them. The second and third node join the first (``stop_app``, ``join_cluster``,
``start_app``).

Usage: python -m chaos.cluster start [--base-port 5681] | stop [--base-port 5681] | urls
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

USER = PASSWORD = "guest"  # loopback only: every listener is on 127.0.0.1
#: Make the Erlang schedulers sleep instead of spinning: three idle nodes on a shared
#: two-core machine would otherwise burn a core between them.
ERL_ARGS = "+sbwt none +sbwtdcpu none +sbwtdio none"


@dataclass(frozen=True)
class Node:
    index: int
    amqp_port: int
    dist_port: int
    management_port: int
    directory: str

    @property
    def name(self) -> str:
        return f"chatqc{self.amqp_port}@localhost"

    @property
    def url(self) -> str:
        return f"amqp://{USER}:{PASSWORD}@127.0.0.1:{self.amqp_port}/"

    @property
    def api_url(self) -> str:
        return f"http://{USER}:{PASSWORD}@127.0.0.1:{self.management_port}/api"

    @property
    def pid_file(self) -> Path:
        return Path(self.directory) / "node.pid"

    def env(self) -> dict[str, str]:
        d = Path(self.directory)
        return {
            **{k: v for k, v in os.environ.items() if not k.startswith("RABBITMQ_")},
            "RABBITMQ_NODENAME": self.name,
            "RABBITMQ_NODE_PORT": str(self.amqp_port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_CONFIG_FILE": str(d / "rabbitmq"),
            "RABBITMQ_MNESIA_BASE": str(d / "mnesia"),
            "RABBITMQ_LOG_BASE": str(d / "log"),
            "RABBITMQ_PID_FILE": str(self.pid_file),
            "RABBITMQ_FEATURE_FLAGS_FILE": str(d / "feature_flags"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(d / "enabled_plugins"),
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": ERL_ARGS,
        }


def ctl(node: Node | str, *args: str, timeout: float = 120, tool: str = "rabbitmqctl") -> str:
    """Run a RabbitMQ CLI command against ``node``; raise with its output when it fails."""
    name = node.name if isinstance(node, Node) else node
    result = subprocess.run(
        [tool, "-n", name, *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    if result.returncode != 0:
        raise RuntimeError(f"{tool} -n {name} {' '.join(args)}: {result.stdout}{result.stderr}")
    return result.stdout


class LocalCluster:
    """Three nodes on ``base_port``, ``base_port + 1``, ``base_port + 2`` (AMQP; the
    distribution ports are 20000 higher, management 10000 higher), in ``directory``."""

    def __init__(self, base_port: int = 5681, directory: str | Path | None = None, size: int = 3) -> None:
        self.base_port = base_port
        self.directory = Path(directory or default_directory(base_port))
        self.nodes = [
            Node(
                index=i,
                amqp_port=base_port + i,
                dist_port=base_port + 20000 + i,
                management_port=base_port + 10000 + i,
                directory=str(self.directory / f"node{i + 1}"),
            )
            for i in range(size)
        ]

    @property
    def urls(self) -> list[str]:
        return [n.url for n in self.nodes]

    @property
    def amqp_url(self) -> str:
        """Every node's URL, comma-separated: what CHATQ_AMQP_URL takes."""
        return ",".join(self.urls)

    def node_of_port(self, port: int) -> Node:
        return next(n for n in self.nodes if n.amqp_port == port)

    # ---- life cycle ----------------------------------------------------------------

    def start(self) -> LocalCluster:
        if shutil.which("rabbitmq-server") is None:
            raise RuntimeError("rabbitmq-server not found: the cluster runs nodes of the installed RabbitMQ")
        self.directory.mkdir(parents=True, exist_ok=True)
        self.directory.chmod(0o755)
        for node in self.nodes:
            self._prepare(node)
        try:
            for node in self.nodes:
                self.start_node(node, wait=False)
            for node in self.nodes:
                self.wait_running(node)
            first = self.nodes[0]
            for node in self.nodes[1:]:
                if first.name in self.running_nodes(node):
                    continue  # already clustered (a restart of a kept directory)
                ctl(node, "stop_app")
                ctl(node, "join_cluster", first.name)
                ctl(node, "start_app")
            for node in self.nodes:
                self.wait_running(node)
            (self.directory / "cluster.json").write_text(
                json.dumps({"base_port": self.base_port, "nodes": [asdict(n) for n in self.nodes]})
            )
        except BaseException:
            self.stop()
            raise
        return self

    def _prepare(self, node: Node) -> None:
        d = Path(node.directory)
        (d / "mnesia").mkdir(parents=True, exist_ok=True)
        (d / "log").mkdir(exist_ok=True)
        (d / "rabbitmq.conf").write_text(
            f"listeners.tcp.local = 127.0.0.1:{node.amqp_port}\n"
            f"management.tcp.ip = 127.0.0.1\n"
            f"management.tcp.port = {node.management_port}\n"
            # As deploy/rabbitmq/rabbitmq.conf: quorum queue leaders spread over the nodes.
            "queue_leader_locator = balanced\n"
        )
        (d / "enabled_plugins").write_text("[rabbitmq_management].\n")
        if os.geteuid() == 0:  # rabbitmq-server drops to the rabbitmq user
            rabbitmq = pwd.getpwnam("rabbitmq")
            for p in [self.directory, d, *d.rglob("*")]:
                os.chown(p, rabbitmq.pw_uid, rabbitmq.pw_gid)

    def start_node(self, node: Node, *, wait: bool = True) -> None:
        """Start a node (again): a restarted node rejoins the cluster on its own."""
        result = subprocess.run(
            ["rabbitmq-server", "-detached"],
            env=node.env(),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(f"rabbitmq-server -detached ({node.name}): {result.stdout}{result.stderr}")
        if wait:
            self.wait_running(node)

    def wait_running(self, node: Node, *, within: float = 180) -> None:
        ctl(node, "wait", str(node.pid_file), "--timeout", str(int(within)), timeout=within + 10)
        ctl(node, "await_startup", "--timeout", str(int(within)), timeout=within + 10)

    def stop_node(self, node: Node, *, kill: bool = False) -> None:
        """Stop a node: ``kill`` is SIGKILL of its Erlang VM (the node dies, sockets reset);
        otherwise an orderly ``rabbitmqctl stop``."""
        pid = self.pid(node)
        if kill and pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        else:
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                ctl(node, "stop", timeout=90)
        if pid is not None:
            deadline = time.monotonic() + 30
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.2)
            if _alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def pid(self, node: Node) -> int | None:
        try:
            return int(node.pid_file.read_text().strip())
        except (OSError, ValueError):
            return None

    def is_up(self, node: Node) -> bool:
        pid = self.pid(node)
        return pid is not None and _alive(pid)

    def stop(self) -> None:
        """Stop every node and remove the directory."""
        for node in reversed(self.nodes):
            if self.is_up(node):
                self.stop_node(node)
        shutil.rmtree(self.directory, ignore_errors=True)

    # ---- what the cluster says -----------------------------------------------------

    def running_nodes(self, node: Node | None = None) -> list[str]:
        ask = node or next(n for n in self.nodes if self.is_up(n))
        out = ctl(ask, "cluster_status", "--formatter", "json", timeout=60)
        return list(json.loads(out).get("running_nodes", []))

    def api(self, path: str, *, timeout: float = 10) -> object:
        """GET from the management API of the first node that answers."""
        last: Exception | None = None
        for node in self.nodes:
            if not self.is_up(node):
                continue
            try:
                r = httpx.get(
                    f"http://127.0.0.1:{node.management_port}/api{path}",
                    auth=(USER, PASSWORD),
                    timeout=timeout,
                )
                r.raise_for_status()
                return r.json()
            except httpx.HTTPError as exc:
                last = exc
        raise RuntimeError(f"no node's management API answered {path}: {last}")

    def connections_by_node(self) -> dict[str, int]:
        counts = {n.name: 0 for n in self.nodes}
        for c in self.api("/connections"):  # type: ignore[union-attr]
            counts[c["node"]] = counts.get(c["node"], 0) + 1
        return counts

    def leader_of(self, queue: str, vhost: str = "/") -> str | None:
        from urllib.parse import quote

        q = self.api(f"/queues/{quote(vhost, safe='')}/{quote(queue, safe='')}")
        return q.get("leader") if isinstance(q, dict) else None  # type: ignore[union-attr]

    def node_named(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (our own child that was killed) is not alive.
    with contextlib.suppress(OSError):
        if Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z":
            return False
    return True


def default_directory(base_port: int) -> Path:
    return Path(tempfile.gettempdir()) / f"chatq-cluster-{base_port}"


@contextlib.contextmanager
def running_cluster(base_port: int | None = None) -> Iterator[LocalCluster]:
    """A fresh cluster for one test session or chaos run, in a directory and on ports of
    its own (free ones unless ``base_port``), torn down afterwards."""
    for attempt in range(3):
        port = base_port or free_base_port()
        directory = Path(tempfile.mkdtemp(prefix=f"chatq-cluster-{port}-"))
        try:
            cluster = LocalCluster(port, directory).start()
            break
        except RuntimeError:
            # A port taken between the check and the boot (start() stopped what it began).
            if base_port or attempt == 2:
                raise
    try:
        yield cluster
    finally:
        cluster.stop()


def free_base_port(size: int = 3) -> int:
    """A base port whose AMQP, management and distribution ports are all free, all of
    them below the kernel's ephemeral range (32768 and up by default), where a client's
    outgoing connection could take one between this check and the node's boot."""
    import random
    import socket

    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(10000, 12700)
        ports = [base + i + off for i in range(size) for off in (0, 10000, 20000)]
        try:
            with contextlib.ExitStack() as stack:
                for p in ports:
                    s = stack.enter_context(socket.socket())
                    s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
    raise RuntimeError("no free ports for a local cluster")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("command", choices=["start", "stop", "urls"])
    parser.add_argument("--base-port", type=int, default=5681)
    parser.add_argument("--directory", help=f"default: {default_directory(5681)} (with the base port)")
    parser.add_argument("--size", type=int, default=3, help="nodes (default 3; 1: a single private node)")
    args = parser.parse_args(argv)
    cluster = LocalCluster(args.base_port, args.directory, size=args.size)
    if args.command == "stop":
        cluster.stop()
        last = args.base_port + args.size - 1
        print(f"stopped the nodes on {args.base_port}-{last} and removed {cluster.directory}")
        return 0
    if args.command == "start":
        cluster.start()
        print(f"running: {', '.join(cluster.running_nodes())}")
    print(f"CHATQ_AMQP_URL={cluster.amqp_url}")
    for node in cluster.nodes:
        print(f"  {node.name}: {node.url}  management http://127.0.0.1:{node.management_port}/")
    size = "" if args.size == 3 else f" --size {args.size}"
    print(f"stop with: make cluster-stop (python -m chaos.cluster stop --base-port {args.base_port}{size})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
