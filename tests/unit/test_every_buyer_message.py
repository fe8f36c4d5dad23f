"""Every buyer message the platforms can send gets an answer or a person (issue 38): every
payload Avito's and Telegram's documents allow is stored (never refused), missing fields get
defaults the record shows, non-text messages become typed placeholders the bot can answer,
and what it cannot read alone goes to a person; the account's own automatic messages and a
business's away messages are not a takeover; a topic is answered in its topic. Pure: the
payloads are made from the documents (tests/fakes/instances.py), not from what we expect."""

from __future__ import annotations

import json
from typing import Any

import pytest

from platforms.avito import webhook as avito
from platforms.avito.webhook import message_intake
from platforms.inbound import ApiError
from platforms.telegram import webhook as telegram
from tests.fakes.instances import Resolver, full, minimal, variants, without_each
from tests.fakes.spec import avito_document, telegram_spec
from tests.support.payloads import avito_content, avito_webhook, telegram_business_update, telegram_update

pytestmark = pytest.mark.unit

ME = "777"


def avito_values() -> list[tuple[str, dict[str, Any]]]:
    """Messages Avito's document allows: a full one without each field in turn, and one of
    each type with its content."""
    doc = avito_document()
    resolve = Resolver(doc)
    schema = doc["components"]["schemas"]["WebhookMessage"]
    whole = {**full(schema, resolve), "user_id": int(ME), "author_id": 555, "chat_type": "u2i"}
    out = [("full", whole), *without_each(whole)]
    for label, value in variants(schema, resolve):
        out.append((f"variant {label}", {**whole, **value}))
    for kind in resolve(schema["properties"]["type"])["enum"]:
        out.append((f"type {kind}", {**whole, "type": kind, "content": avito_content(kind)}))
    return out


@pytest.mark.parametrize(("label", "value"), avito_values(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_avito_message_the_document_allows_is_stored_never_refused(label: str, value: dict) -> None:
    body = {
        "id": "evt-1",
        "version": "v3.0.0",
        "timestamp": 1,
        "payload": {"type": "message", "value": value},
    }
    intake = avito.normalise(body, json.dumps(body))  # raises ApiError (a 422) when refused
    assert intake.message_id
    if intake.ignored_reason is None:
        assert intake.text, label


def test_a_missing_field_gets_a_default_that_the_record_shows() -> None:
    body = avito_webhook("m-1", text="Is it available?")
    for field in ("author_id", "type", "created"):
        del body["payload"]["value"][field]
    intake = avito.normalise(body, "{}")
    assert intake.ignored_reason is None and intake.text == "Is it available?"
    assert intake.author_id is None
    assert intake.received_detail == (
        "defaults: author_id missing: taken as the buyer's; type missing: read as text from its content; "
        "created missing: the time of receipt"
    )
    nameless = avito_webhook("m-2")
    del nameless["payload"]["value"]["id"]
    unnamed = avito.normalise(nameless, "{}")
    assert unnamed.message_id == "evt:evt-m-2"
    # The poll would find it under its real id: answered by the bot, it could be answered
    # twice. A person gets it, whatever the account's policy.
    assert unnamed.for_a_person("answer").status == "needs_review"
    chatless = avito_webhook("m-3")
    del chatless["payload"]["value"]["chat_id"]
    lost = avito.normalise(chatless, "{}")
    assert lost.chat_id is None and lost.unreadable and "names no chat" in lost.unreadable
    assert lost.for_a_person("answer").status == "needs_review"  # nothing can answer it


TELEGRAM_ALLOWED = ("message", "edited_message", "business_message", "edited_business_message")


def telegram_messages() -> list[tuple[str, dict[str, Any]]]:
    """Messages Telegram's document allows: the smallest, then with each optional field."""
    schema = telegram_spec().schema("Message")
    resolve = Resolver(schema)
    return [(label, value) for label, value in variants(schema, resolve)]


@pytest.mark.parametrize("kind", TELEGRAM_ALLOWED)
def test_every_telegram_update_of_an_allowed_kind_the_documents_allow_is_stored_never_refused(
    kind: str,
) -> None:
    refused = []
    for label, message in telegram_messages():
        chat = {"id": 42, "type": "private"}
        update = {"update_id": 1, kind: {**message, "chat": chat}}
        assert telegram_spec().check_type("Update", update) == [], label
        try:
            intake = telegram.normalise(update, json.dumps(update), "4242")
        except ApiError as exc:
            refused.append(f"{label}: {exc}")
            continue
        assert intake.message_id or intake.event_id
    assert refused == []


def test_every_business_connection_update_the_documents_allow_is_stored_never_refused() -> None:
    schema = telegram_spec().schema("BusinessConnection")
    resolve = Resolver(schema)
    for label, connection in variants(schema, resolve):
        update = {"update_id": 2, "business_connection": connection}
        assert telegram_spec().check_type("Update", update) == [], label
        intake = telegram.normalise(update, json.dumps(update), "4242")
        assert intake.business_connection is not None and intake.event_id == "2", label


def telegram_content(kind: str) -> Any:
    """The smallest value of a Message's ``kind`` field that Telegram's document allows."""
    schema = telegram_spec().schema("Message")
    resolve = Resolver(schema)
    return minimal(resolve(schema)["properties"][kind], resolve)


@pytest.mark.parametrize(
    ("kind", "value", "placeholder", "unreadable"),
    [
        ("photo", None, "[the buyer sent a photo]", False),
        ("sticker", {"emoji": "👍"}, "[sticker 👍]", False),
        ("location", {"latitude": 55.75, "longitude": 37.61}, "[location: 55.75, 37.61]", False),
        ("venue", {"title": "Shop", "address": "Tverskaya 1"}, "[place: Shop, Tverskaya 1]", False),
        (
            "contact",
            {"first_name": "Anna", "phone_number": "+79001234567"},
            "[contact: Anna, +79001234567]",
            False,
        ),
        ("voice", {"duration": 12}, "[voice message, 12 s]", True),
        ("video_note", {"duration": 8}, "[video message, 8 s]", True),
        ("audio", {"title": "demo", "duration": 185}, "[audio file: demo, 3 min 5 s]", True),
        ("document", {"file_name": "specs.pdf"}, "[file: specs.pdf]", True),
        ("video", {"duration": 30}, "[the buyer sent a video, 30 s]", True),
    ],
)
def test_a_telegram_message_without_text_is_a_typed_placeholder_never_silence(
    kind: str, value: dict | None, placeholder: str, unreadable: bool
) -> None:
    content = telegram_content(kind)
    if isinstance(content, dict) and value:
        content = {**content, **value}
    update = telegram_update(7, text=None, **{kind: content})
    assert telegram_spec().check_type("Update", update) == []
    intake = telegram.normalise(update, "{}", "4242")
    assert intake.ignored_reason is None
    assert intake.text == placeholder
    assert (intake.unreadable is not None) is unreadable
    if unreadable:
        assert intake.for_a_person("person").status == "needs_review"
        assert intake.for_a_person("answer").status == "accepted"
    # With the buyer's words, the bot answers them, told what came with them.
    if kind in ("photo", "voice", "video", "audio", "document"):
        captioned = telegram.normalise(
            telegram_update(8, text=None, caption="Is this one OK?", **{kind: content}), "{}", "4242"
        )
        assert captioned.text == f"{placeholder} Is this one OK?" and captioned.unreadable is None


@pytest.mark.parametrize(
    ("kind", "placeholder", "unreadable"),
    [
        ("image", "[the buyer sent a photo]", False),
        ("voice", "[voice message]", True),
        ("file", "[the buyer sent a file]", True),
        ("video", "[the buyer sent a video]", True),
        ("location", "[location: Москва, Варшавское шоссе (55.5998, 37.60395)]", False),
        ("item", "[listing: Велосипед, 12 000 ₽, https://avito.ru/item_url]", False),
        ("call", "[the buyer tried to call: a missed call]", False),
        ("appCall", "[the buyer tried to call: a missed call]", False),
    ],
)
def test_an_avito_message_without_text_is_a_typed_placeholder_never_silence(
    kind: str, placeholder: str, unreadable: bool
) -> None:
    intake = message_intake(
        account_id=ME,
        chat_id="c",
        message_id="m",
        author_id=555,
        kind=kind,
        chat_type="u2i",
        content=avito_content(kind),
        created=1,
        raw="{}",
    )
    assert intake.ignored_reason is None
    assert intake.text == placeholder
    assert (intake.unreadable is not None) is unreadable


def test_the_words_avito_puts_in_a_link_are_the_buyers_and_answered() -> None:
    content = {"link": {"text": "Is this the same as yours?", "url": "https://avito.ru/other"}}
    intake = message_intake(
        account_id=ME,
        chat_id="c",
        message_id="m",
        author_id=555,
        kind="link",
        chat_type="u2i",
        content=content,
        created=1,
        raw="{}",
    )
    assert intake.text == "[link: https://avito.ru/other] Is this the same as yours?"
    assert intake.unreadable is None


@pytest.mark.parametrize("kind", ["system", "image", "voice", "item", "link", "location", "file"])
def test_a_message_of_the_account_that_nobody_typed_is_not_the_seller_taking_over(kind: str) -> None:
    intake = message_intake(
        account_id=ME,
        chat_id="c",
        message_id="m",
        author_id=int(ME),
        kind=kind,
        chat_type="u2i",
        content=avito_content(kind),
        created=1,
        raw="{}",
    )
    assert intake.ignored_reason is not None
    assert not intake.written_by_seller
    typed = message_intake(
        account_id=ME,
        chat_id="c",
        message_id="m",
        author_id=int(ME),
        kind="text",
        chat_type="u2i",
        content={"text": "Hello, yes it is"},
        created=1,
        raw="{}",
    )
    assert typed.written_by_seller


def test_a_business_away_message_is_not_the_owner_taking_over() -> None:
    away = telegram_business_update(5, author=9009, text="We are closed until Monday", is_from_offline=True)
    assert telegram_spec().check_type("Update", away) == []
    intake = telegram.normalise(away, "{}", "4242")
    assert intake.ignored_reason is not None and "is_from_offline" in intake.ignored_reason
    assert not intake.written_by_seller
    by_hand = telegram.normalise(telegram_business_update(6, author=9009, text="Yes, it is"), "{}", "4242")
    assert by_hand.written_by_seller


def test_a_business_connection_update_says_whether_its_chats_may_be_answered() -> None:
    from tests.fakes.world import FakeWorld

    world = FakeWorld()
    for enabled, can_reply, paused in ((True, True, False), (False, True, True), (True, False, True)):
        update = {
            "update_id": 9,
            "business_connection": world.business_connection("biz-1", enabled=enabled, can_reply=can_reply),
        }
        assert telegram_spec().check_type("Update", update) == []
        intake = telegram.normalise(update, "{}", "4242")
        assert intake.ignored_reason is not None and intake.event_id == "9"
        assert intake.business_connection is not None
        assert (intake.business_connection.paused_reason is not None) is paused
    assert "business_connection" in telegram.ANSWERED_UPDATES


def test_a_message_in_a_topic_is_its_own_chat_answered_in_that_topic() -> None:
    topic = telegram_update(
        3, chat_id=-100500, chat_type="supergroup", message_thread_id=17, is_topic_message=True
    )
    assert telegram_spec().check_type("Update", topic) == []
    intake = telegram.normalise(topic, "{}", "4242", frozenset({"supergroup"}))
    assert intake.chat_id == "-100500#17"
    # A reply thread in a group without topics is the group's chat.
    reply = telegram_update(4, chat_id=-100500, chat_type="supergroup", message_thread_id=17)
    assert telegram.normalise(reply, "{}", "4242", frozenset({"supergroup"})).chat_id == "-100500"


def test_content_of_a_kind_this_release_does_not_know_goes_to_a_person_not_ignored() -> None:
    # A newer Bot API's message content (rich_message in 10.1): the bot cannot read it.
    update = telegram_update(
        1, text=None, rich_message={"blocks": [{"type": "paragraph", "text": "Still for sale?"}]}
    )
    intake = telegram.normalise(update, "{}", "bot")
    assert intake.ignored_reason is None
    assert intake.text == "[the buyer sent a rich message]"
    assert intake.for_a_person("person").status == "needs_review"


def test_an_avito_message_that_names_no_account_is_the_webhook_paths_account() -> None:
    hook = avito_webhook("m-9", author_id=777, text="Yes, it is available.")
    del hook["payload"]["value"]["user_id"]
    ours = avito.normalise(hook, "{}", account_hint="777")
    assert ours.account_id == "777" and ours.written_by_seller  # decided at storage: echo or seller
    assert ours.received_detail == "defaults: user_id missing: taken as account 777, the webhook path's"
    nobody = avito.normalise(avito_webhook("m-10") | {}, "{}")
    assert nobody.account_id == "777"
    unnamed = avito_webhook("m-11")
    del unnamed["payload"]["value"]["user_id"]
    lost = avito.normalise(unnamed, "{}")  # no path account, no environment account
    assert lost.for_a_person("answer").status == "needs_review"
