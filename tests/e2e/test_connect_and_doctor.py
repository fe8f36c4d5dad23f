"""``chatq connect`` and ``chatq doctor`` as a seller runs them: real processes, with the
settings in the environment, against the fake Telegram and Avito (which refuse anything
their documents do not allow), the test session's Postgres and RabbitMQ."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

from shared.settings import Settings
from tests.conftest import AVITO_SECRET, TELEGRAM_SECRET
from tests.fakes.world import FakeWorld
from tests.support.pipeline import pipeline_settings
from tests.support.processes import ROOT, settings_env

pytestmark = pytest.mark.e2e

PUBLIC_URL = "https://chat.example.com"
TELEGRAM_URL = f"{PUBLIC_URL}/v1/webhooks/telegram"
AVITO_URL = f"{PUBLIC_URL}/v1/webhooks/avito/{AVITO_SECRET}"


@pytest.fixture
def seller(settings: Settings, world: FakeWorld) -> Settings:
    """A deployment with both platforms, a model and an alert sink, all on the fakes, and
    the retry tiers the test session's broker has declared."""
    return pipeline_settings(
        settings,
        world,
        public_url=PUBLIC_URL,
        llm_base_url=f"{world.url}/v1",
        retry_delays_seconds=settings.retry_delays_seconds,
    )


async def chatq(settings: Settings, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``chatq`` in its own process; nothing it prints may carry a secret."""
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "chatq.cli", "--env-file", os.devnull, *args],
        capture_output=True,
        text=True,
        env=settings_env(settings, **env),
        cwd=ROOT,
        timeout=60,
    )
    printed = done.stdout + done.stderr
    for secret in settings.secret_values():
        assert secret not in printed, f"chatq {' '.join(args)} printed a secret"
    return done


def line(output: str, check: str) -> str:
    """The doctor's line for one check, with its fix line when it has one."""
    lines = output.splitlines()
    for i, text in enumerate(lines):
        if text.startswith(f"{check}  "):
            fix = lines[i + 1] if i + 1 < len(lines) and lines[i + 1].startswith(" ") else ""
            return f"{text}\n{fix}"
    raise AssertionError(f"no {check!r} line in:\n{output}")


async def test_connect_registers_both_webhooks_and_a_second_run_changes_nothing_and_says_so(
    seller: Settings, world: FakeWorld
) -> None:
    telegram = await chatq(seller, "connect", "telegram")
    assert telegram.returncode == 0, telegram.stderr
    assert f"webhook registered at {TELEGRAM_URL}" in telegram.stdout
    kinds = [
        "message",
        "edited_message",
        "business_message",
        "edited_business_message",
        "business_connection",
    ]
    assert f"allowed updates   {', '.join(kinds)}" in telegram.stdout
    bot = world.telegram_bot("4242:test-token")
    assert (bot.webhook_url, bot.secret_token, bot.allowed_updates) == (
        TELEGRAM_URL,
        TELEGRAM_SECRET,
        kinds,
    )

    avito = await chatq(seller, "connect", "avito")
    assert avito.returncode == 0, avito.stderr
    assert f"Avito: subscribed {PUBLIC_URL}/v1/webhooks/avito/***" in avito.stdout
    assert world.avito_subscriptions == [AVITO_URL]

    again = [await chatq(seller, "connect", platform) for platform in ("telegram", "avito")]
    assert [r.returncode for r in again] == [0, 0]
    assert "already registered" in again[0].stdout and "nothing changed" in again[0].stdout
    assert "already subscribed" in again[1].stdout and "nothing changed" in again[1].stdout
    assert (bot.webhook_url, world.avito_subscriptions) == (TELEGRAM_URL, [AVITO_URL])


async def test_disconnect_removes_each_webhook_and_a_second_run_changes_nothing(
    seller: Settings, world: FakeWorld
) -> None:
    world.avito_subscriptions.append("https://crm.example.net/hooks/avito?key=theirs")
    for platform in ("telegram", "avito"):
        assert (await chatq(seller, "connect", platform)).returncode == 0
    telegram = await chatq(seller, "connect", "telegram", "--disconnect")
    assert telegram.returncode == 0, telegram.stderr
    assert "webhook removed" in telegram.stdout
    assert world.telegram_bot("4242:test-token").webhook_url == ""
    avito = await chatq(seller, "connect", "avito", "--disconnect")
    assert avito.returncode == 0, avito.stderr
    assert (
        "unsubscribed" in avito.stdout
        and "https://crm.example.net/…?…  (another receiver; not touched)" in avito.stdout
    )
    assert world.avito_subscriptions == ["https://crm.example.net/hooks/avito?key=theirs"]

    again = [await chatq(seller, "connect", platform, "--disconnect") for platform in ("telegram", "avito")]
    assert [r.returncode for r in again] == [0, 0]
    assert "no webhook is registered; nothing changed" in again[0].stdout
    assert "not subscribed; nothing changed" in again[1].stdout


async def test_connect_refuses_a_public_url_the_platforms_cannot_call_and_asks_them_nothing(
    seller: Settings, world: FakeWorld
) -> None:
    plain = await chatq(seller, "connect", "avito", CHATQ_PUBLIC_URL="http://chat.example.com")
    assert plain.returncode == 2
    assert "HTTPS only" in plain.stderr
    odd_port = await chatq(seller, "connect", "telegram", CHATQ_PUBLIC_URL="https://chat.example.com:8080")
    assert odd_port.returncode == 2
    assert "only on ports 443, 80, 88 and 8443" in odd_port.stderr
    unset = await chatq(seller.model_copy(update={"public_url": None}), "connect", "telegram")
    assert unset.returncode == 2 and "CHATQ_PUBLIC_URL is not set" in unset.stderr
    assert world.platform_calls == []


async def test_doctor_is_all_green_on_a_connected_deployment(seller: Settings, world: FakeWorld) -> None:
    for platform in ("telegram", "avito"):
        assert (await chatq(seller, "connect", platform)).returncode == 0
    doctor = await chatq(seller, "doctor")
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert doctor.stdout.rstrip().endswith("all checks passed")
    for check in (
        "database",
        "migrations",
        "broker",
        "broker topology",
        "telegram token",
        "telegram webhook",
        "avito token",
        "avito messenger",
        "avito webhook",
        "model",
        "alerts",
    ):
        assert " ok " in line(doctor.stdout, check), line(doctor.stdout, check)
    assert [a["body"]["type"] for a in world.alerts] == ["doctor_check"]


async def test_doctor_says_which_platforms_are_not_configured_and_how_to_configure_them(
    settings: Settings,
) -> None:
    bare = Settings(database_url=settings.database_url, amqp_url=settings.amqp_url)
    doctor = await chatq(bare, "doctor")
    assert doctor.returncode == 0, doctor.stdout
    assert "skipped  not configured (CHATQ_TELEGRAM_BOT_TOKEN is not set)" in line(
        doctor.stdout, "telegram token"
    )
    assert "to set up: create a bot with @BotFather" in line(doctor.stdout, "telegram token")
    assert "to set up: register an application" in line(doctor.stdout, "avito token")
    assert "built-in facts responder" in line(doctor.stdout, "model")
    assert "skipped" in line(doctor.stdout, "alerts")


async def test_doctor_with_a_revoked_telegram_token_fails_with_the_reason_and_the_fix(
    seller: Settings, world: FakeWorld
) -> None:
    for platform in ("telegram", "avito"):
        assert (await chatq(seller, "connect", platform)).returncode == 0
    world.revoke_telegram_token("4242:test-token")
    doctor = await chatq(seller, "doctor")
    assert doctor.returncode == 1
    token = line(doctor.stdout, "telegram token")
    assert "FAIL" in token and "401 Unauthorized" in token and "revoked" in token
    assert "fix: in @BotFather" in token and "CHATQ_TELEGRAM_BOT_TOKEN" in token
    assert "skipped  the token does not work" in line(doctor.stdout, "telegram webhook")
    assert " ok " in line(doctor.stdout, "avito webhook")  # one platform's trouble is its own
    assert doctor.stdout.rstrip().endswith("1 check(s) failed")


async def test_doctor_reports_a_recent_telegram_delivery_error_with_its_message(
    seller: Settings, world: FakeWorld
) -> None:
    assert (await chatq(seller, "connect", "telegram")).returncode == 0
    world.telegram_delivery_failed("4242:test-token", "Wrong response from the webhook: 502 Bad Gateway")
    doctor = await chatq(seller, "doctor")
    assert doctor.returncode == 1
    webhook = line(doctor.stdout, "telegram webhook")
    assert "FAIL" in webhook and "Wrong response from the webhook: 502 Bad Gateway" in webhook
    assert "fix:" in webhook


async def test_doctor_fails_a_webhook_registered_before_edits_and_business_messages_were_answered(
    seller: Settings, world: FakeWorld
) -> None:
    # A deployment connected by an older version asked Telegram for messages only: edits
    # and business messages would never arrive until `chatq connect telegram` runs again.
    assert (await chatq(seller, "connect", "telegram")).returncode == 0
    world.telegram_bot("4242:test-token").allowed_updates = ["message"]
    doctor = await chatq(seller, "doctor")
    assert doctor.returncode == 1
    webhook = line(doctor.stdout, "telegram webhook")
    assert "FAIL" in webhook and "Telegram delivers only message" in webhook
    assert "chatq connect telegram" in webhook
    assert (await chatq(seller, "connect", "telegram")).returncode == 0
    assert " ok " in line((await chatq(seller, "doctor")).stdout, "telegram webhook")


async def test_doctor_explains_an_avito_account_without_the_messenger_plan(
    seller: Settings, world: FakeWorld
) -> None:
    world.avito_messenger_plan = False
    connect = await chatq(seller, "connect", "avito")
    assert connect.returncode == 1 and "no paid Messenger plan" in connect.stderr
    doctor = await chatq(seller, "doctor")
    assert doctor.returncode == 1
    messenger = line(doctor.stdout, "avito messenger")
    assert "FAIL" in messenger and "HTTP 403" in messenger
    assert "the account has no paid Messenger plan" in messenger
    assert "fix: put the Avito account on a paid plan" in messenger
    assert " ok " in line(doctor.stdout, "avito token")
