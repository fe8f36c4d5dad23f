"""Services as real processes (``python -m services.<name>``) for e2e and crash tests."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from tests.support.service_roles import as_service

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def settings_env(settings: Any, **extra: str) -> dict[str, str]:
    """CHATQ_* variables for a child process, from a Settings object."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHATQ_")}
    for name, value in settings.model_dump().items():
        if value is None:
            continue
        if hasattr(value, "get_secret_value"):
            value = value.get_secret_value()
        env[f"CHATQ_{name.upper()}"] = str(value)
    env.update(extra)
    env["PYTHONUNBUFFERED"] = "1"
    return env


class ServiceProcess:
    def __init__(
        self,
        module: str,
        env: dict[str, str],
        *,
        name: str | None = None,
        python: str = sys.executable,
        cwd: Path = ROOT,
    ) -> None:
        self.module = module
        self.env = env
        self.name = name or module
        self.python = python
        self.cwd = cwd
        self.proc: asyncio.subprocess.Process | None = None
        self.log_path = ROOT / ".pytest_cache" / f"{self.name}-{os.getpid()}-{time.monotonic_ns()}.log"

    async def start(self) -> ServiceProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")  # noqa: ASYNC230 - a local log file, closed in stop()
        self.proc = await asyncio.create_subprocess_exec(
            self.python,
            "-m",
            self.module,
            cwd=self.cwd,
            env=self.env,
            stdout=self._log,
            stderr=asyncio.subprocess.STDOUT,
        )
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    async def wait_http(self, url: str, *, within: float = 20.0) -> None:
        deadline = time.monotonic() + within
        async with httpx.AsyncClient(timeout=1) as client:
            while True:
                assert self.proc is not None
                if self.proc.returncode is not None:
                    raise AssertionError(f"{self.name} exited with {self.proc.returncode}:\n{self.log()}")
                try:
                    if (await client.get(url)).status_code < 500:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise AssertionError(f"{self.name} did not answer {url} within {within}s:\n{self.log()}")
                await asyncio.sleep(0.1)

    async def wait_exit(self, *, within: float = 20.0) -> int:
        assert self.proc is not None
        try:
            return await asyncio.wait_for(self.proc.wait(), timeout=within)
        except TimeoutError:
            raise AssertionError(f"{self.name} did not exit within {within}s:\n{self.log()}") from None

    async def stop(self, sig: int = signal.SIGTERM, *, within: float = 20.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.returncode is None:
            self.proc.send_signal(sig)
            try:
                await asyncio.wait_for(self.proc.wait(), timeout=within)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        self._log.close()
        return self.proc.returncode


class Receiver(ServiceProcess):
    """The receiver on a free port; with ``admin_port``, its admin surface on that one
    (``admin_url``; without it, ``admin_url`` is ``url``)."""

    def __init__(
        self, settings: Any, *, port: int | None = None, admin_port: int | None = None, **extra: str
    ) -> None:
        self.port = port or free_port()
        self.admin_port = admin_port
        if admin_port is not None:
            extra["CHATQ_ADMIN_PORT"] = str(admin_port)
        super().__init__(
            "services.receiver",
            settings_env(as_service(settings, "receiver"), CHATQ_HTTP_PORT=str(self.port), **extra),
            name="receiver",
        )
        self.url = f"http://127.0.0.1:{self.port}"
        self.admin_url = f"http://127.0.0.1:{admin_port}" if admin_port is not None else self.url

    async def start(self, *, wait_healthy: bool = True) -> Receiver:
        await super().start()
        if wait_healthy:
            await self.wait_http(f"{self.url}/healthz")
            await self.wait_http(f"{self.admin_url}/healthz")
        return self


class Worker(ServiceProcess):
    """A worker service (coalescer, responder) with its ops endpoint on a free port."""

    def __init__(self, service: str, settings: Any, **extra: str) -> None:
        self.port = free_port()
        super().__init__(
            f"services.{service}",
            settings_env(as_service(settings, service), CHATQ_METRICS_PORT=str(self.port), **extra),
            name=service,
        )
        self.url = f"http://127.0.0.1:{self.port}"

    async def start(self, *, wait_healthy: bool = True) -> Worker:
        await super().start()
        if wait_healthy:
            await self.wait_http(f"{self.url}/healthz")
        return self


async def run_tool(
    infra: Any, module: str, *args: str, within: float = 900
) -> subprocess.CompletedProcess[str]:
    """Run one of the project's scripted tools (demo, chaos) against the session's
    Postgres server and RabbitMQ; each makes its own database and vhost."""
    amqp_root = infra.amqp_url.rsplit("/", 1)[0] + "/"
    return await asyncio.to_thread(
        subprocess.run,
        [
            sys.executable,
            "-m",
            module,
            *args,
            "--admin-database-url",
            infra.admin_database_url,
            "--amqp-url",
            amqp_root,
            "--rabbitmq-api-url",
            infra.rabbitmq_api_url or "",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=within,
    )


async def run_chatq(receiver: Receiver, *args: str, token: str | None) -> subprocess.CompletedProcess[str]:
    """``chatq ARGS`` in its own process against ``receiver``'s admin API, with ``token`` (none:
    no token), no CHATQ_ variable of the test run's environment and no ``.env``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHATQ_")}
    env["CHATQ_ADMIN_URL"] = receiver.admin_url
    if token:
        env["CHATQ_ADMIN_TOKEN"] = token
    return await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "chatq.cli", "--env-file", os.devnull, *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=60,
    )
