"""Every request the project sends to Telegram and Avito is one their own documents allow.

The fakes check each request they receive against tests/fakes/reference (and each answer
they give); the ``world`` fixture fails a test whose code sent anything the documents do
not allow. This test drives every kind of request the code can make — the responder's
adapters (send, reconciliation listing, token refresh, at the platforms' length limits)
and ``chatq connect`` / ``chatq doctor`` — and then checks, by reading the source, that
no Telegram method or Avito path the code names was left out of the drive. A new call
added to the code without being driven here fails this test.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from pydantic import SecretStr

from chatq.doctor import check_alerts, check_avito, check_model, check_telegram
from platforms.avito.adapter import AvitoPlatform, AvitoToken
from platforms.avito.connect import connect_avito
from platforms.base import Listing, SentQuery
from platforms.connect import ConnectError
from platforms.failures import Failure
from platforms.ratelimit import AccountRateLimiter
from platforms.telegram.adapter import TelegramPlatform
from platforms.telegram.connect import connect_telegram
from shared.settings import Settings
from stores.jobs.protocol import Attempts
from tests.conftest import replace
from tests.fakes.spec import avito_spec, telegram_spec
from tests.fakes.world import FakeWorld
from tests.support.processes import ROOT

pytestmark = pytest.mark.integration

TOKEN = "4242:AAE-test-token"

#: The modules that talk to Telegram and Avito, read for the calls they can make.
TELEGRAM_CODE = ("platforms/telegram/adapter.py", "platforms/telegram/admin.py")
AVITO_CODE = ("platforms/avito/adapter.py", "platforms/avito/admin.py")


def settings_for(world: FakeWorld) -> Settings:
    return Settings(
        public_url="https://chat.example.com",
        telegram_bot_token=SecretStr(TOKEN),
        telegram_webhook_secret=SecretStr("tg-secret-for-tests"),
        telegram_api_base=world.url,
        avito_client_id="client-1",
        avito_client_secret=SecretStr("client-secret"),
        avito_webhook_secret=SecretStr("avito-path-secret-for-tests"),
        avito_api_base=world.url,
        llm_base_url=f"{world.url}/v1",
        alert_webhook_url=f"{world.url}/alerts",
    )


def telegram_methods_in_code() -> set[str]:
    spec = telegram_spec()
    names = set()
    for path in TELEGRAM_CODE:
        for word in re.findall(r"[\"'/](\w+)[\"']", (ROOT / path).read_text()):
            if spec.method(word) == word:
                names.add(word)
    return names


def avito_operations_in_code() -> set[str]:
    spec = avito_spec()
    found = set()
    for path in AVITO_CODE:
        for raw in re.findall(
            r"(/token|/messenger/v\d+/[\w{}./-]*|/core/v\d+/[\w{}./-]*)", (ROOT / path).read_text()
        ):
            template = re.sub(r"\{[^}]*\}", "{}", raw)
            ops = [o for o in spec.operations if re.sub(r"\{[^}]*\}", "{}", o.template) == template]
            assert ops, f"{path} calls {raw}, which is in none of Avito's documents"
            # /token has one operation per grant type; the code asks for client credentials only.
            found |= {"getAccessToken"} if template == "/token" else {o.operation_id for o in ops}
    return found


async def drive_the_responders_adapters(world: FakeWorld, client: httpx.AsyncClient) -> None:
    limiter = AccountRateLimiter(1000)
    telegram = TelegramPlatform(world.url, TOKEN, client, limiter)
    await telegram.send("4242", "1001", "Yes, it is available.", key="job-1")
    await telegram.send("4242", "1001", "x" * telegram.max_text, key="job-2")
    await telegram.send("4242", "-100200", "to a group", key="job-3")
    # A business account's chat (keyed apart from the bot's own), through its connection.
    await telegram.send(
        "4242", "1001@biz-conn-1", "as the business", key="job-3b", business_connection_id="biz-conn-1"
    )
    assert world.telegram[-1] == {
        "chat_id": 1001,
        "text": "as the business",
        "message_id": world.telegram[-1]["message_id"],
        "business_connection_id": "biz-conn-1",
        "bot": 4242,  # the fake records which bot sent it
    }
    world.fail("telegram.send", "403", "429:1")
    for key in ("job-4", "job-5"):
        with pytest.raises(Failure):
            await telegram.send("4242", "1001", "refused", key=key)

    avito = AvitoPlatform(
        world.url, AvitoToken(world.url, "client-1", "client-secret", client), client, limiter
    )
    await avito.send("777", "u2i-chat-1", "Yes, it is available.", key="job-6")
    await avito.send("777", "u2i-chat-1", "y" * avito.max_text, key="job-7")
    world.expire_avito_tokens()  # the next call is refused (403), refreshes, and tries again
    await avito.send("777", "u2i-chat-2", "after a refresh", key="job-8")
    long_ago = datetime.now(UTC) - timedelta(hours=1)
    query = SentQuery("777", "u2i-chat-1", "job-6", Attempts("Yes, it is available.", long_ago, long_ago))
    await avito.find_sent(query)
    await avito.probe("777")  # whether the account is refused as a whole
    assert (await avito.who())["id"] == 777  # the account behind the credentials
    # What the poller and the reply writer ask: unread chats (every page), a chat's buyer
    # messages (paged back), a chat's listing; and marking a chat read after a reply.
    for n in range(105):
        world.add_avito_chat("777", f"u2i-many-{n}", updated=n)
    world.avito_buyer_writes("777", "u2i-chat-1", "Still there?")
    assert len(await avito.recent_chats("777", 0)) == 105 + 1
    assert [m["content"]["text"] for m in await avito.buyer_messages("777", "u2i-chat-1", 0)] == [
        "Still there?"
    ]
    assert (await avito.listing("777", "u2i-many-3")) == Listing(
        "Bicycle", "12 000 ₽", "https://www.avito.ru/moskva/velosipedy/u2i-many-3"
    )
    await avito.mark_read("777", "u2i-chat-1")
    assert ("777", "u2i-chat-1") in world.avito_reads
    await telegram.probe("4242")
    world.business_connection("biz-conn-1", enabled=False)
    assert await telegram.business_connection("4242", "biz-conn-1") == (False, True)


async def drive_connect_and_doctor(world: FakeWorld, client: httpx.AsyncClient) -> None:
    settings = settings_for(world)
    # With channels allowed, allowed_updates has the channel posts too.
    await connect_telegram(replace(settings, telegram_chat_types="private,channel"), client, disconnect=False)
    assert world.telegram_bot(TOKEN).allowed_updates == [
        "message",
        "edited_message",
        "channel_post",
        "edited_channel_post",
        "business_message",
        "edited_business_message",
        "business_connection",
    ]
    for disconnect in (False, False, True, True):
        await connect_telegram(settings, client, disconnect=disconnect)
        await connect_avito(settings, client, disconnect=disconnect)
    await connect_telegram(settings, client, disconnect=False)
    await connect_avito(settings, client, disconnect=False)
    await check_telegram(settings, client, now=0)
    await check_avito(settings, client)
    await check_model(settings, client)
    await check_alerts(settings, client)
    world.avito_messenger_plan = False
    with pytest.raises(ConnectError):
        await connect_avito(settings, client, disconnect=False)
    await check_avito(settings, client)
    world.revoke_telegram_token(TOKEN)
    await check_telegram(settings, client, now=0)


async def test_every_request_the_project_sends_to_telegram_and_avito_is_one_their_documents_allow(
    world: FakeWorld,
) -> None:
    async with httpx.AsyncClient(timeout=5) as client:
        await drive_the_responders_adapters(world, client)
        await drive_connect_and_doctor(world, client)

    assert world.violations == []
    assert world.platform_calls and all(c.allowed for c in world.platform_calls)
    driven = {(c.platform, c.name) for c in world.platform_calls}
    for method in telegram_methods_in_code():
        assert ("telegram", method) in driven, f"the code calls Telegram's {method}; drive it in this test"
    for operation in avito_operations_in_code():
        assert ("avito", operation) in driven, f"the code calls Avito's {operation}; drive it in this test"


def test_the_source_scan_finds_the_calls_the_code_makes() -> None:
    # A scan that found nothing would make the test above prove nothing.
    assert telegram_methods_in_code() == {
        "sendMessage",
        "getMe",
        "getWebhookInfo",
        "setWebhook",
        "deleteWebhook",
        "getBusinessConnection",
    }
    assert avito_operations_in_code() == {
        "getAccessToken",
        "getChatsV2",
        "getChatByIdV2",
        "chatRead",
        "postSendMessage",
        "getMessagesV3",
        "getSubscriptions",
        "postWebhookV3",
        "postWebhookUnsubscribe",
        "getUserInfoSelf",
    }


@pytest.mark.spec_violations_expected
async def test_a_request_the_documents_refuse_gets_the_platforms_error_and_is_recorded(
    world: FakeWorld,
) -> None:
    async with httpx.AsyncClient(base_url=world.url, timeout=5) as client:
        long = await client.post(f"/bot{TOKEN}/sendMessage", json={"chat_id": 1, "text": "x" * 4097})
        unknown = await client.post(f"/bot{TOKEN}/sendMesage", json={"chat_id": 1, "text": "hi"})
        typed = await client.post(f"/bot{TOKEN}/sendMessage", json={"chat_id": [1], "text": "hi"})
        token = (
            await client.post(
                "/token", data={"grant_type": "client_credentials", "client_id": "a", "client_secret": "b"}
            )
        ).json()
        auth = {"Authorization": f"Bearer {token['access_token']}"}
        avito_long = await client.post(
            "/messenger/v1/accounts/777/chats/c/messages",
            json={"message": {"text": "x" * 1001}, "type": "text"},
            headers=auth,
        )
        slash = await client.post("/messenger/v3/webhook/", json={"url": "https://a.example"}, headers=auth)
    assert (long.status_code, long.json()) == (
        400,
        {"ok": False, "error_code": 400, "description": "Bad Request: message is too long"},
    )
    assert (unknown.status_code, unknown.json()["description"]) == (404, "Not Found")
    assert typed.status_code == 400 and typed.json()["description"].startswith("Bad Request: ")
    assert avito_long.status_code == 400 and avito_long.json()["error"]["code"] == 400
    # Only the token path takes a trailing slash (the observed supplement); any other is refused.
    assert slash.status_code == 404 and slash.json() == {"error": {"code": 404, "message": "Not found"}}
    assert [v.call for v in world.violations] == [
        "sendMessage",
        "sendMesage",
        "sendMessage",
        "postSendMessage",
        "POST /messenger/v3/webhook/",
    ]
    assert world.telegram == [] and world.avito == []


async def test_the_fake_avito_chats_answer_in_the_shapes_avitos_documents_give(world: FakeWorld) -> None:
    # Nothing calls these yet (the reconciliation poll will); their answers are checked now.
    world.add_avito_chat("777", "u2i-chat-1", unread=True)
    world.add_avito_chat("777", "u2i-chat-2", unread=False)
    async with httpx.AsyncClient(base_url=world.url, timeout=5) as client:
        form = {"grant_type": "client_credentials", "client_id": "a", "client_secret": "b"}
        token = (await client.post("/token", data=form)).json()["access_token"]
        auth = {"Authorization": f"Bearer {token}"}
        await client.post(
            "/messenger/v1/accounts/777/chats/u2i-chat-1/messages",
            json={"message": {"text": "Yes"}, "type": "text"},
            headers=auth,
        )
        unread = await client.get("/messenger/v2/accounts/777/chats?unread_only=true&limit=10", headers=auth)
        chat = await client.get("/messenger/v2/accounts/777/chats/u2i-chat-1", headers=auth)
        missing = await client.get("/messenger/v2/accounts/777/chats/nope", headers=auth)
    assert [c["id"] for c in unread.json()["chats"]] == ["u2i-chat-1"]
    assert chat.json()["last_message"]["content"] == {"text": "Yes"}
    assert missing.status_code == 404 and missing.json()["error"]["code"] == 404
    assert world.violations == []
