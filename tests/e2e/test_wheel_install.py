"""What the image runs is a non-editable install: the package built as a wheel, with only
the files its package data lists. This test builds that wheel, installs it into a fresh
virtualenv outside the checkout, and runs the receiver from it against a fresh database,
so a page, a static file or a SQL file left out of the package data fails here instead
of answering 500 in production.

The fresh virtualenv gets the wheel itself and nothing else; the third-party
dependencies (pinned by constraints.txt, as in the image) are borrowed from the
checkout's virtualenv through a path file, so the test costs seconds rather than a
second resolve of every dependency. The checkout itself is never on the path: the
process runs in a temporary directory and the test asserts where chatqueue was imported
from."""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import httpx
import pytest

from shared.migrate import load_functions, load_migrations
from tests.conftest import ADMIN_TOKEN, TELEGRAM_SECRET, make_settings
from tests.support.deploy_files import image_packages
from tests.support.infra import Infra
from tests.support.payloads import telegram_update
from tests.support.processes import ROOT, ServiceProcess, free_port, settings_env

pytestmark = pytest.mark.e2e


def run(*cmd: str | Path, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, cwd=cwd, env=env, timeout=300)
    assert out.returncode == 0, f"{' '.join(map(str, cmd))}:\n{out.stdout}\n{out.stderr}"
    return out


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The python of a fresh virtualenv holding the chatqueue wheel built from the checkout."""
    work = tmp_path_factory.mktemp("wheel-install")
    # The image's build context (.dockerignore): these files only, and no build/ left over
    # from an earlier build in the checkout to smuggle files into the wheel.
    source = work / "source"
    source.mkdir()
    for name in ("pyproject.toml", "constraints.txt", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for name in image_packages():
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    wheels = work / "wheels"
    # Build isolation, as `pip install .` in the Dockerfile does: a clean setuptools.
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", wheels, source, cwd=work)
    (wheel,) = wheels.glob("chatqueue-*.whl")
    venv = work / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=work)
    python = venv / "bin" / "python"
    run(sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--quiet", wheel, cwd=work)
    purelib = Path(
        run(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))", cwd=work).stdout.strip()
    )
    (purelib / "zz_checkout_dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    where = run(python, "-c", "import shared, services.receiver; print(shared.__file__)", cwd=work).stdout
    assert where.startswith(str(purelib)), f"chatqueue came from {where}, not the installed wheel"
    return python


@pytest.fixture
async def fresh_database(infra: Infra) -> AsyncIterator[str]:
    """A database no migration has touched: the installed package must bring every SQL file."""
    name = f"chatq_wheel_{secrets.token_hex(4)}"
    admin = await asyncpg.connect(infra.admin_database_url)
    await admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield infra.database_url.rsplit("/", 1)[0] + f"/{name}"
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


async def test_the_wheel_installed_outside_the_checkout_serves_every_page_and_migrates_a_fresh_database(
    installed: Path, fresh_database: str, infra: Infra
) -> None:
    settings = make_settings(infra, database_url=fresh_database, migrate_on_start=True)
    port, admin_port = free_port(), free_port()
    env = settings_env(settings, CHATQ_HTTP_PORT=str(port), CHATQ_ADMIN_PORT=str(admin_port))
    env.pop("PYTHONPATH", None)
    receiver = ServiceProcess(
        "services.receiver", env, name="wheel-receiver", python=str(installed), cwd=installed.parents[2]
    )
    await receiver.start()
    try:
        await receiver.wait_http(f"http://127.0.0.1:{port}/healthz", within=60)
        await receiver.wait_http(f"http://127.0.0.1:{admin_port}/healthz")
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{admin_port}", timeout=10) as admin:
            for path, media in [
                ("/ops", "text/html"),
                ("/sandbox", "text/html"),
                ("/static/ops.js", "text/javascript"),
                ("/static/ops.css", "text/css"),
                ("/static/sandbox.js", "text/javascript"),
            ]:
                r = await admin.get(path)
                assert r.status_code == 200, (path, r.status_code, r.text[:300], receiver.log()[-2000:])
                assert r.headers["content-type"].startswith(media), (path, r.headers["content-type"])
            served = (await admin.get("/static/ops.js")).content
            assert served == (ROOT / "services" / "receiver" / "static" / "ops.js").read_bytes()
        # The installed package brought every migration and every function file: a webhook
        # is stored through the SQL functions, and the schema is what the checkout has.
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as public:
            r = await public.post(
                "/v1/webhooks/telegram",
                json=telegram_update(1),
                headers={"X-Telegram-Bot-Api-Secret-Token": TELEGRAM_SECRET},
            )
            assert r.status_code == 200, (r.text, receiver.log()[-2000:])
        conn = await asyncpg.connect(fresh_database)
        try:
            functions = {r["name"] for r in await conn.fetch("SELECT name FROM schema_functions")}
            versions = {r["version"] for r in await conn.fetch("SELECT version FROM schema_migrations")}
        finally:
            await conn.close()
        assert functions == {f.name for f in load_functions()}
        assert versions == {m.version for m in load_migrations()}
        # The console script a person runs inside a pod (`chatq`) works from the install.
        cli_env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("CHATQ_")},
            "CHATQ_ADMIN_TOKEN": ADMIN_TOKEN,
            "CHATQ_ADMIN_URL": f"http://127.0.0.1:{admin_port}",
        }
        stats = await asyncio.to_thread(
            run, installed.parent / "chatq", "stats", cwd=installed.parents[2], env=cli_env
        )
        assert "received 1" in stats.stdout, stats.stdout
    finally:
        await receiver.stop()
