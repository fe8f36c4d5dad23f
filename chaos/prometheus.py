"""A Prometheus server of the installed ``prometheus`` (Debian's package, which ``make
test`` installs for promtool) watching a scenario's services with the project's alert
rules, scraping and evaluating every 15 s as deploy/prometheus/prometheus.yml does: what
the person on call would have been told, and when (the alert seen, not inferred).

``AlertWatch.poll`` asks its /api/v1/alerts every second or two; ``first_firing`` says when
each alert was first seen firing, ``last_firing`` when last."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from tests.support.processes import free_port

RULES = Path(__file__).resolve().parents[1] / "deploy" / "prometheus" / "rules"


@dataclass
class AlertWatch:
    url: str
    #: (alert name, job) -> time.monotonic() when first and last seen firing.
    first_firing: dict[tuple[str, str], float] = field(default_factory=dict)
    last_firing: dict[tuple[str, str], float] = field(default_factory=dict)

    async def poll(self, client: httpx.AsyncClient) -> None:
        try:
            alerts = (await client.get(f"{self.url}/api/v1/alerts")).json()["data"]["alerts"]
        except (httpx.HTTPError, ValueError, KeyError):
            return  # not up yet, or busy: the next poll asks again
        now = time.monotonic()
        for a in alerts:
            if a.get("state") == "firing":
                key = (a["labels"]["alertname"], a["labels"].get("job", ""))
                self.first_firing.setdefault(key, now)
                self.last_firing[key] = now

    async def watch(self, done: asyncio.Event, every: float = 2.0) -> None:
        async with httpx.AsyncClient(timeout=5) as client:
            while not done.is_set():
                await self.poll(client)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(done.wait(), timeout=every)


@contextlib.asynccontextmanager
async def watching(targets: dict[str, list[str]]) -> AsyncIterator[AlertWatch]:
    """Prometheus scraping each job's targets (host:port, /metrics) with the rules."""
    binary = shutil.which("prometheus")
    if binary is None:
        raise RuntimeError("prometheus not found: make test installs it (Debian package prometheus)")
    directory = Path(tempfile.mkdtemp(prefix="chatq-prometheus-"))
    port = free_port()
    config = {
        "global": {"scrape_interval": "15s", "evaluation_interval": "15s"},
        "rule_files": [str(p) for p in sorted(RULES.glob("*.yml"))],
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": hosts}]} for job, hosts in targets.items()
        ],
    }
    (directory / "prometheus.yml").write_text(yaml.safe_dump(config))
    proc = await asyncio.create_subprocess_exec(
        binary,
        f"--config.file={directory / 'prometheus.yml'}",
        f"--storage.tsdb.path={directory / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--log.level=warn",
        stdout=asyncio.subprocess.DEVNULL,
        stderr=(directory / "prometheus.log").open("w"),
    )
    watch = AlertWatch(f"http://127.0.0.1:{port}")
    try:
        async with httpx.AsyncClient(timeout=2) as client:
            deadline = time.monotonic() + 30
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(f"{watch.url}/-/ready")).status_code == 200:
                        break
                if proc.returncode is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"prometheus did not start: {(directory / 'prometheus.log').read_text()}"
                    )
                await asyncio.sleep(0.2)
        yield watch
    finally:
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except TimeoutError:
            proc.kill()
            await proc.wait()
        shutil.rmtree(directory, ignore_errors=True)
