"""The person on call's tools against real services: the chatq command line and the
operations web page in headless Chromium."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import httpx
import pytest
from playwright.async_api import async_playwright, expect

from tests.conftest import ADMIN_TOKEN, AVITO_SECRET, TELEGRAM_SECRET
from tests.fakes.world import FakeWorld
from tests.support.broker import wait_for
from tests.support.payloads import avito_webhook, telegram_update
from tests.support.pipeline import pipeline_settings
from tests.support.processes import ROOT, Receiver, Worker, run_chatq

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("clean")]

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


@pytest.fixture
async def stack(settings, world: FakeWorld) -> AsyncIterator[Receiver]:
    s = pipeline_settings(settings, world)
    receiver = await Receiver(s).start()
    coalescer = await Worker("coalescer", s).start()
    responder = await Worker("responder", s).start()
    try:
        yield receiver
    finally:
        for p in (responder, coalescer, receiver):
            await p.stop()


async def failed_operation(
    receiver: Receiver, world: FakeWorld, n: int, *, fault: str = "400", status: str = "failed"
) -> str:
    """A Telegram message whose send meets ``fault``, once it reached ``status``."""
    world.fail("telegram.send", fault)
    async with httpx.AsyncClient(base_url=receiver.url, timeout=10) as client:
        r = await client.post(
            "/v1/webhooks/telegram",
            json=telegram_update(n, chat_id=800 + n, text="Is it available?"),
            headers={"X-Telegram-Bot-Api-Secret-Token": TELEGRAM_SECRET},
        )
        op = r.json()["operation_id"]

        async def settled() -> bool:
            return (await client.get(f"/v1/operations/{op}", headers=ADMIN)).json()["status"] == status

        await wait_for(settled, within=20, what=f"the operation to be {status}")
    return op


async def chatq(
    receiver: Receiver, *args: str, token: str | None = ADMIN_TOKEN
) -> subprocess.CompletedProcess[str]:
    return await run_chatq(receiver, *args, token=token)


async def test_the_cli_shows_lists_retries_and_resolves_with_exit_codes_scripts_can_use(
    stack: Receiver, world: FakeWorld
) -> None:
    op = await failed_operation(stack, world, 1)
    status = await chatq(stack, "status", op)
    assert status.returncode == 0, status.stderr
    assert "status     failed — gave up: telegram: HTTP 400" in status.stdout
    listed = await chatq(stack, "list", "--status", "failed")
    assert listed.returncode == 0 and op in listed.stdout and "1 operation(s)" in listed.stdout
    stats = await chatq(stack, "stats")
    assert stats.returncode == 0 and re.search(r"^failed share \(24 h\) +100\.0 %$", stats.stdout, re.M)
    retried = await chatq(stack, "retry", op)
    assert retried.returncode == 0 and f"re-queued 1 operation(s): {op}" in retried.stdout
    async with httpx.AsyncClient(base_url=stack.url) as client:

        async def replied() -> bool:
            return (await client.get(f"/v1/operations/{op}", headers=ADMIN)).json()["status"] == "replied"

        await wait_for(replied, within=20, what="the retried operation to be replied")
    again = await chatq(stack, "retry", op)
    assert again.returncode == 1 and "not_retryable" in again.stderr
    other = await failed_operation(stack, world, 2)
    resolved = await chatq(
        stack, "resolve", other, "--resolution", "dismissed", "--owner", "anna", "--note", "spam"
    )
    assert resolved.returncode == 0 and resolved.stdout.startswith("ignored")
    assert (await chatq(stack, "status", "00000000-0000-0000-0000-000000000000")).returncode == 1
    assert (await chatq(stack, "stats", token=None)).returncode == 2
    assert (await chatq(stack, "resolve", other)).returncode == 2  # argparse: missing options
    unsure = await failed_operation(stack, world, 4, fault="hang", status="needs_review")
    refused = await chatq(stack, "retry", unsure)
    assert refused.returncode == 1 and "resend_not_confirmed" in refused.stderr
    confirmed = await chatq(stack, "retry", unsure, "--resend", "--by", "anna")
    assert (
        confirmed.returncode == 0
        and f"re-send confirmed; re-queued 1 operation(s): {unsure}" in confirmed.stdout
    )
    unreachable = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "chatq.cli", "--env-file", os.devnull, "stats"],
        capture_output=True,
        text=True,
        env={**os.environ, "CHATQ_ADMIN_URL": "http://127.0.0.1:9", "CHATQ_ADMIN_TOKEN": "x"},
        cwd=ROOT,
    )
    assert unreachable.returncode == 3


@contextlib.asynccontextmanager
async def browser_page() -> AsyncIterator[tuple[Any, list[str]]]:
    """A page in headless Chromium, and every Content-Security-Policy violation it reports
    (Chromium logs each blocked script, style or connection on the console)."""
    async with async_playwright() as p:
        browser = await p.chromium.launch(
            executable_path=CHROMIUM,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
            ],
        )
        try:
            page = await browser.new_page()
            violations: list[str] = []
            page.on(
                "console",
                lambda m: violations.append(m.text) if "Content Security Policy" in m.text else None,
            )
            yield page, violations
        finally:
            await browser.close()


async def test_the_ops_page_retries_a_failed_operation_and_shows_its_status_change(
    stack: Receiver, world: FakeWorld
) -> None:
    op = await failed_operation(stack, world, 3)
    async with browser_page() as (page, violations):
        response = await page.goto(f"{stack.url}/ops")
        assert "frame-ancestors 'none'" in response.headers["content-security-policy"]
        dialogs: list[str] = []

        async def answer(dialog: Any) -> None:
            dialogs.append(dialog.type)
            await dialog.accept("anna")

        page.on("dialog", answer)
        await page.fill("#token", ADMIN_TOKEN)
        await page.click("#login button")
        row = page.locator(f'tr[data-id="{op}"]')
        await row.wait_for(timeout=10_000)
        assert "gave up" in await row.inner_text()
        await row.get_by_role("button", name="Retry").click()
        status = page.locator("#detail-status")
        await status.wait_for(timeout=10_000)
        # The page refreshes the open operation every few seconds. (Locator assertions, not
        # wait_for_function: evaluating a string in the page is what the policy forbids.)
        await expect(status).to_have_attribute("data-status", "replied", timeout=30_000)
        assert "reply sent at" in await status.inner_text()
        await expect(row).to_have_count(0, timeout=10_000)
        # The stylesheet applied: the header is the page's dark bar, not the browser's default.
        header = await page.eval_on_selector("header", "h => getComputedStyle(h).backgroundColor")
        assert header == "rgb(31, 41, 55)"
        await page.screenshot(path=str(ROOT / ".pytest_cache" / "ops-page.png"), full_page=True)
        assert dialogs == ["prompt"]  # who decided: recorded with the retry
    assert violations == []


async def test_choosing_an_account_on_the_ops_page_narrows_needs_a_person_to_that_accounts_messages(
    stack: Receiver, world: FakeWorld
) -> None:
    telegram_op = await failed_operation(stack, world, 9)
    world.fail("avito.send", "400")
    async with httpx.AsyncClient(base_url=stack.url, timeout=10) as client:
        r = await client.post(
            f"/v1/webhooks/avito/{AVITO_SECRET}", json=avito_webhook("f-1", chat_id="filter-1")
        )
        avito_op = r.json()["operation_id"]

        async def failed() -> bool:
            return (await client.get(f"/v1/operations/{avito_op}", headers=ADMIN)).json()[
                "status"
            ] == "failed"

        await wait_for(failed, within=20, what="the Avito message to fail")
    async with browser_page() as (page, violations):
        await page.goto(f"{stack.url}/ops")
        await page.fill("#token", ADMIN_TOKEN)
        await page.click("#login button")
        telegram_row, avito_row = (page.locator(f'tr[data-id="{op}"]') for op in (telegram_op, avito_op))
        await telegram_row.wait_for(timeout=10_000)
        await avito_row.wait_for(timeout=10_000)
        await page.locator('#account-filter option[value="avito:777"]').wait_for(state="attached")
        await page.select_option("#account-filter", "avito:777")
        await expect(telegram_row).to_have_count(0, timeout=10_000)
        await expect(avito_row).to_have_count(1)
        await page.select_option("#account-filter", "")
        await expect(telegram_row).to_have_count(1, timeout=10_000)
    assert violations == []


async def test_the_ops_page_account_filter_offers_a_quiet_account_among_many_busier_ones(
    stack: Receiver, world: FakeWorld, pool: asyncpg.Pool
) -> None:
    """/v1/stats lists the 20 busiest accounts; the filter must still offer every account
    of the deployment (issue 21: hundreds), a quiet one too."""
    await pool.executemany(
        "INSERT INTO accounts (platform, account_id, name) VALUES ('avito', $1, 'busy')",
        [(str(100 + n),) for n in range(25)],
    )
    quiet = '#account-filter option[value="telegram:4242"]'  # the environment's bot, after them
    async with browser_page() as (page, violations):
        await page.goto(f"{stack.url}/ops")
        await page.fill("#token", ADMIN_TOKEN)
        await page.click("#login button")
        await page.locator('#account-filter option[value="avito:100"]').wait_for(state="attached")
        await page.locator(quiet).wait_for(state="attached", timeout=10_000)
        await page.select_option("#account-filter", "telegram:4242")
        await expect(page.locator('tr[data-account="telegram:4242"]')).to_have_count(1, timeout=10_000)
    assert violations == []


async def test_the_ops_page_asks_a_person_to_confirm_before_sending_a_needs_review_reply_again(
    stack: Receiver, world: FakeWorld
) -> None:
    op = await failed_operation(stack, world, 5, fault="hang", status="needs_review")
    async with browser_page() as (page, violations):
        answers = iter([False, True])  # first: "not yet"; then: confirmed
        dialogs: list[str] = []

        async def answer(dialog: Any) -> None:
            dialogs.append(dialog.type)
            if dialog.type == "confirm" and not next(answers):
                await dialog.dismiss()
            else:
                await dialog.accept("anna")

        page.on("dialog", answer)
        await page.goto(f"{stack.url}/ops")
        await page.fill("#token", ADMIN_TOKEN)
        await page.click("#login button")
        row = page.locator(f'tr[data-id="{op}"]')
        await row.wait_for(timeout=10_000)
        await row.get_by_role("button", name="Re-send…").click()
        await expect(row).to_have_count(1)  # declined: nothing happened
        await row.get_by_role("button", name="Re-send…").click()
        status = page.locator("#detail-status")
        await expect(status).to_have_attribute("data-status", "replied", timeout=30_000)
        assert dialogs == ["confirm", "confirm", "prompt"]
    assert violations == []
    async with httpx.AsyncClient(base_url=stack.url) as client:
        doc = (await client.get(f"/v1/operations/{op}", headers=ADMIN)).json()
    assert doc["status"] == "replied"


async def test_the_sandbox_page_sends_a_message_and_shows_the_bots_answer_under_its_policy(
    stack: Receiver,
) -> None:
    async with browser_page() as (page, violations):
        await page.goto(f"{stack.url}/sandbox?chat=browser1")
        await page.fill("#text", "Is it still available?")
        await page.click("#send button")
        await page.locator(".msg.buyer").wait_for(timeout=10_000)
        await page.locator(".msg.bot").wait_for(timeout=30_000)
        assert "available" in await page.locator(".msg.bot").inner_text()
        header = await page.eval_on_selector("header", "h => getComputedStyle(h).backgroundColor")
        assert header == "rgb(31, 41, 55)"
    assert violations == []
