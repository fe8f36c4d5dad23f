"""Normalising each platform's webhook to one Intake, without services."""

from __future__ import annotations

import pytest

from services.receiver.errors import ApiError
from services.receiver.webhooks import avito, generic, telegram
from tests.support.payloads import avito_webhook, generic_message, telegram_update

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
        (lambda: telegram_update(1, text=None, photo=[{"file_id": "p"}]), "unsupported message type (photo)"),
        (lambda: telegram_update(1, text="   "), "empty message"),
        (lambda: {"update_id": 1, "edited_message": {}}, "update kind edited_message is not answered"),
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


def test_connect_asks_telegram_for_exactly_the_update_kinds_the_receiver_answers() -> None:
    # chatq connect telegram sends ANSWERED_UPDATES as setWebhook's allowed_updates: a kind
    # the receiver would only store as ignored must not cost a delivery, and none it
    # answers may be left out.
    kinds = ("message", *telegram._KNOWN_KINDS)
    answered = {
        kind
        for kind in kinds
        if telegram.normalise(
            {"update_id": 1, kind: telegram_update(1)["message"]}, "{}", "bot"
        ).ignored_reason
        is None
    }
    assert answered == set(telegram.ANSWERED_UPDATES)
