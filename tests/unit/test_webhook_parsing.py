"""Normalising each platform's webhook to one Intake, without services."""

from __future__ import annotations

import pytest

from platforms.avito import webhook as avito
from platforms.generic import webhook as generic
from platforms.inbound import ApiError
from platforms.telegram import webhook as telegram
from shared.settings import TELEGRAM_CHAT_TYPES
from tests.fakes.spec import telegram_spec
from tests.support.payloads import (
    avito_webhook,
    bot_command,
    generic_message,
    telegram_business_update,
    telegram_document,
    telegram_edit,
    telegram_photo,
    telegram_update,
)

pytestmark = pytest.mark.unit


def test_a_telegram_text_message_becomes_an_answerable_intake_keyed_by_chat_and_message_only() -> None:
    # Not by update_id: Telegram may hand out update_ids again after a week of silence.
    intake = telegram.normalise(telegram_update(10, chat_id=5, message_id=3, text="Hi"), "{}", "4242")
    assert (intake.account_id, intake.event_id, intake.chat_id, intake.message_id, intake.text) == (
        "4242",
        None,
        "5",
        "3",
        "Hi",
    )
    assert intake.ignored_reason is None


def test_a_telegram_update_without_a_message_is_keyed_by_its_update_id() -> None:
    intake = telegram.normalise({"update_id": 11, "callback_query": {"id": "q"}}, "{}", "4242")
    assert (intake.event_id, intake.chat_id, intake.ignored_reason) == (
        "11",
        None,
        "update kind callback_query is not answered",
    )


@pytest.mark.parametrize(
    ("update", "reason"),
    [
        # Factories: an update carries a date, made when the test runs, not at collection.
        (
            lambda: telegram_update(
                1,
                text=None,
                pinned_message={"chat": {"id": 1, "type": "private"}, "message_id": 3, "date": 0},
            ),
            "a service message (pinned_message): not a buyer's message",
        ),
        (lambda: telegram_update(1, text="   "), "empty message"),
        (lambda: {"update_id": 1}, "update carries no message"),
    ],
)
def test_telegram_updates_the_bot_does_not_answer_are_ignored_with_a_reason(update, reason) -> None:
    assert telegram.normalise(update(), "{}", "bot").ignored_reason == reason


def test_a_message_from_a_bot_is_ignored() -> None:
    update = telegram_update(1)
    update["message"]["from"]["is_bot"] = True
    assert telegram.normalise(update, "{}", "bot").ignored_reason == "message from a bot"


def test_telegram_secret_is_compared_and_required() -> None:
    telegram.authenticate("s3cret", "s3cret")
    with pytest.raises(ApiError) as wrong:
        telegram.authenticate("s3cret", "s3cre")
    assert wrong.value.status == 401
    with pytest.raises(ApiError) as off:
        telegram.authenticate(None, "anything")
    assert off.value.code == "platform_not_configured"


def test_an_avito_buyer_message_is_keyed_by_account_chat_and_message() -> None:
    intake = avito.normalise(avito_webhook("m1", user_id=9, author_id=3, chat_id="c"), "{}")
    assert (intake.account_id, intake.chat_id, intake.message_id, intake.author_id) == ("9", "c", "m1", "3")
    assert intake.ignored_reason is None


def test_an_avito_event_that_is_not_a_message_is_ignored() -> None:
    body = {"id": "e1", "payload": {"type": "chat_read", "value": {"user_id": 9}}}
    intake = avito.normalise(body, "{}")
    assert intake.ignored_reason == "Avito event type chat_read is not answered"
    assert intake.event_id == "e1"


def test_generic_numeric_ids_are_taken_as_text_and_extra_fields_refused() -> None:
    msg = generic_message("m1")
    msg["chat_id"] = 12
    assert generic.normalise(msg, "{}", "wh1").chat_id == "12"
    with pytest.raises(ApiError):
        generic.normalise({**msg, "surprise": 1}, "{}", "wh1")


def test_generic_signature_failures_are_401s_whatever_the_header_garbage() -> None:
    verifier = generic.verifier("whsec_" + "QUJDREVGR0hJSktMTU5PUA==")
    for headers in (
        {},
        {"webhook-id": "x", "webhook-timestamp": "nan", "webhook-signature": "v1,AAAA"},
        {"webhook-id": "x", "webhook-timestamp": "1e300", "webhook-signature": "v1,AAAA"},
        {"webhook-id": "x", "webhook-timestamp": "1", "webhook-signature": "v1"},
    ):
        with pytest.raises(ApiError) as err:
            generic.authenticate(verifier, b"{}", headers)
        assert err.value.status == 401


def test_an_avito_event_with_an_empty_id_is_stored_without_an_event_id() -> None:
    # Found by the fuzzer: an empty id broke the event_id CHECK and answered 500.
    intake = avito.normalise({"id": "", "payload": {"type": "chat_read"}}, "{}")
    assert intake.event_id is None


def sample_updates(kind: str) -> list[dict]:
    """Updates of ``kind`` as Telegram sends them, one for each chat type the kind comes
    from: channel posts from a channel, business messages from a business account's
    customer, messages from a private chat, a group and a supergroup."""
    if kind in ("channel_post", "edited_channel_post"):
        return [telegram_update(1, kind=kind, chat_id=-100777, chat_type="channel")]
    if kind in ("business_message", "edited_business_message"):
        return [telegram_business_update(1, kind=kind)]
    if kind in ("message", "edited_message"):
        return [
            telegram_update(1, kind=kind, chat_id=chat_id, chat_type=chat_type, from_id=42)
            for chat_id, chat_type in ((42, "private"), (-500, "group"), (-100500, "supergroup"))
        ]
    if kind == "business_connection":
        from tests.fakes.world import FakeWorld

        return [{"update_id": 1, kind: FakeWorld().business_connection("biz-conn-1")}]
    return [{"update_id": 1, kind: telegram_update(1)["message"]}]


@pytest.mark.parametrize(
    "chat_types",
    [
        frozenset({"private"}),
        frozenset({"group"}),
        frozenset({"channel"}),
        frozenset({"private", "supergroup", "channel"}),
        frozenset(TELEGRAM_CHAT_TYPES),
    ],
)
def test_connect_asks_telegram_for_exactly_the_update_kinds_the_receiver_answers(chat_types) -> None:
    # chatq connect telegram sends answered_updates(CHATQ_TELEGRAM_CHAT_TYPES) as setWebhook's
    # allowed_updates: a kind the receiver would only store as ignored must not cost a
    # delivery, and none it answers may be left out. Every kind of Bot API 10.1 is tried.
    answered = {
        kind
        for kind in telegram_spec().update_kinds
        for update in sample_updates(kind)
        if telegram.normalise(update, "{}", "bot", chat_types).ignored_reason is None
    }
    asked = set(telegram.answered_updates(chat_types))
    # business_connection updates carry no message: they say whether business messages
    # may be answered, and are asked for with them.
    assert answered == asked - {"business_connection"}
    assert ("business_connection" in asked) == ("business_message" in asked)


def test_the_default_allowed_updates_are_messages_edits_and_business_messages() -> None:
    assert telegram.ANSWERED_UPDATES == (
        "message",
        "edited_message",
        "business_message",
        "edited_business_message",
        "business_connection",
    )
    assert telegram.answered_updates(frozenset({"channel"})) == ("channel_post", "edited_channel_post")


def test_every_telegram_update_these_tests_build_is_one_the_bot_api_documents() -> None:
    # The builders stand in for Telegram; were they to send what Telegram never does, the
    # tests below would prove nothing.
    updates = [u for kind in ("message", "channel_post", "business_message") for u in sample_updates(kind)]
    updates += [
        telegram_update(1, text="/start", **bot_command("/start")),
        telegram_update(1, text=None, caption="Is this one available?", photo=telegram_photo()),
        telegram_update(1, text=None, caption="Specs?", document=telegram_document()),
        telegram_update(1, chat_id=-100500, chat_type="group", from_id=42),
        telegram_edit(2, message_id=1, text="Hello, do you deliver?"),
        telegram_business_update(3, author=9009),
        telegram_business_update(4, sender_business_bot={"id": 4242, "is_bot": True, "first_name": "Shop"}),
    ]
    for update in updates:
        assert telegram_spec().check_type("Update", update) == [], update


def test_a_photo_or_document_with_a_caption_is_answered_from_its_caption() -> None:
    photo = telegram.normalise(
        telegram_update(1, text=None, caption="Is this one available?", photo=telegram_photo()), "{}", "bot"
    )
    document = telegram.normalise(
        telegram_update(2, text=None, caption="Do you have it in red?", document=telegram_document()),
        "{}",
        "bot",
    )
    assert (photo.ignored_reason, photo.text) == (None, "[the buyer sent a photo] Is this one available?")
    assert (document.ignored_reason, document.text) == (None, "[file: specs.pdf] Do you have it in red?")
    assert photo.unreadable is None and document.unreadable is None  # the buyer's words are there


def test_a_command_is_stored_as_its_text_for_the_responder_to_greet() -> None:
    intake = telegram.normalise(telegram_update(1, text="/start", **bot_command("/start")), "{}", "bot")
    assert (intake.ignored_reason, intake.text) == (None, "/start")


def test_a_group_message_is_ignored_with_the_reason_unless_groups_are_allowed() -> None:
    update = telegram_update(1, chat_id=-100500, chat_type="group", from_id=42, text="Price?")
    ignored = telegram.normalise(update, "{}", "bot")
    assert ignored.ignored_reason == "group chats are not answered (CHATQ_TELEGRAM_CHAT_TYPES: private)"
    allowed = telegram.normalise(update, "{}", "bot", frozenset({"private", "group"}))
    assert (allowed.ignored_reason, allowed.chat_id, allowed.author_id) == (None, "-100500", "42")


@pytest.mark.parametrize("chat_type", ["supergroup", "channel"])
def test_supergroups_and_channels_are_ignored_by_default(chat_type: str) -> None:
    update = telegram_update(1, chat_id=-100900, chat_type=chat_type)
    assert telegram.normalise(update, "{}", "bot").ignored_reason == (
        f"{chat_type} chats are not answered (CHATQ_TELEGRAM_CHAT_TYPES: private)"
    )


def test_a_channel_post_is_ignored_by_default_and_answered_where_channels_are_allowed() -> None:
    post = telegram_update(5, kind="channel_post", chat_id=-100777, chat_type="channel", text="New stock")
    assert telegram.normalise(post, "{}", "bot").ignored_reason == (
        "channel chats are not answered (CHATQ_TELEGRAM_CHAT_TYPES: private)"
    )
    allowed = telegram.normalise(post, "{}", "bot", frozenset({"channel"}))
    # A channel post has no sender but the channel itself.
    assert (allowed.ignored_reason, allowed.chat_id, allowed.author_id) == (None, "-100777", "-100777")


def test_an_edit_gets_its_own_key_and_time_and_is_left_to_the_store_to_fold_or_ignore() -> None:
    intake = telegram.normalise(
        telegram_edit(7, message_id=3, chat_id=5, text="Hi, do you deliver?", edit_date=1_700_000_100),
        "{}",
        "bot",
    )
    assert (intake.chat_id, intake.message_id, intake.text) == (
        "5",
        "3:edit:1700000100",
        "Hi, do you deliver?",
    )
    assert intake.sent_at is not None and intake.sent_at.timestamp() == 1_700_000_100
    assert intake.is_edit and intake.ignored_reason is None
    plain = telegram.normalise(telegram_update(6, chat_id=5, message_id=3), "{}", "bot")
    assert not plain.is_edit and plain.message_id == "3"


def test_two_edits_of_one_message_have_two_keys() -> None:
    first, second = (
        telegram.normalise(telegram_edit(u, message_id=3, text=t, edit_date=d), "{}", "bot")
        for u, t, d in ((8, "Hi!", 1_700_000_100), (9, "Hi!!", 1_700_000_160))
    )
    assert first.message_id != second.message_id


def test_a_business_customers_message_is_answered_through_its_connection_in_a_chat_of_its_own() -> None:
    intake = telegram.normalise(
        telegram_business_update(1, connection="biz-conn-1", customer=3003), "{}", "4242"
    )
    assert intake.ignored_reason is None and not intake.written_by_seller
    assert (intake.business_connection_id, intake.author_id) == ("biz-conn-1", "3003")
    # Telegram gives the business chat the customer's id, which the bot's own chat with
    # the same person has too (with message ids of its own): they are two chats here.
    own = telegram.normalise(telegram_update(1, chat_id=3003), "{}", "4242")
    assert intake.chat_id == "3003@biz-conn-1" and own.chat_id == "3003"
    assert own.business_connection_id is None


def test_a_business_message_the_owner_wrote_by_hand_is_the_sellers_and_is_flagged_for_takeover() -> None:
    intake = telegram.normalise(
        telegram_business_update(2, customer=3003, author=9009, text="I'll call you"), "{}", "bot"
    )
    assert intake.ignored_reason == "written by the seller"
    assert intake.written_by_seller
    assert (intake.chat_id, intake.message_id, intake.author_id) == ("3003@biz-conn-1", "2", "9009")


def test_an_edit_by_the_owner_is_ignored_without_counting_as_the_seller_writing() -> None:
    update = telegram_business_update(
        3, customer=3003, author=9009, kind="edited_business_message", edit_date=1_700_000_000
    )
    intake = telegram.normalise(update, "{}", "bot")
    assert intake.ignored_reason == "edited by the seller" and not intake.written_by_seller


def test_a_business_message_our_bot_sent_is_our_own_echo() -> None:
    bot = {"id": 4242, "is_bot": True, "first_name": "Shop"}
    update = telegram_business_update(4, customer=3003, author=9009, sender_business_bot=bot)
    intake = telegram.normalise(update, "{}", "4242")
    assert intake.ignored_reason == "sent by the bot on the business's behalf (our own reply)"
    assert not intake.written_by_seller


def test_an_edited_business_message_of_the_customer_is_an_edit_in_the_business_chat() -> None:
    update = telegram_business_update(
        5, customer=3003, kind="edited_business_message", edit_date=1_700_000_000
    )
    intake = telegram.normalise(update, "{}", "bot")
    assert intake.ignored_reason is None and intake.is_edit
    assert (intake.chat_id, intake.message_id) == ("3003@biz-conn-1", "5:edit:1700000000")
