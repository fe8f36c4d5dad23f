"""The validator the fakes apply: it refuses what Telegram's and Avito's documents do not
allow, and accepts what they do. (If it accepted everything, every "spec-valid" test
would pass for nothing.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from shared.settings import TELEGRAM_CHAT_TYPES
from tests.fakes.spec import ReferenceMissing, avito_spec, reference_dir, telegram_spec

pytestmark = pytest.mark.unit

AUTH = {"Authorization": "Bearer t", "Content-Type": "application/json"}
SEND = "/messenger/v1/accounts/777/chats/u2i-1/messages"


def avito_problems(method: str, path: str, body: object = None, query: str = "", **headers: str) -> list[str]:
    raw = b"" if body is None else json.dumps(body).encode()
    return avito_spec().check_request(method, path, query, {**AUTH, **headers}, raw).problems


def test_a_telegram_send_as_the_responder_makes_it_is_allowed() -> None:
    assert telegram_spec().check_call("sendMessage", {"chat_id": 1001, "text": "Yes, it is available."}) == []
    assert telegram_spec().check_call("sendMessage", {"chat_id": "@shop", "text": "x" * 4096}) == []


def test_telegram_refuses_a_field_of_the_wrong_type() -> None:
    problems = telegram_spec().check_call("sendMessage", {"chat_id": 1.5, "text": "hi"})
    assert problems and "chat_id" in problems[0]
    assert telegram_spec().check_call("sendMessage", {"chat_id": 1, "text": 42})
    assert telegram_spec().check_call(
        "setWebhook", {"url": "https://a.example", "allowed_updates": "message"}
    )


def test_telegram_refuses_a_missing_required_field() -> None:
    assert telegram_spec().check_call("sendMessage", {"chat_id": 1}) == [
        "sendMessage: 'text' is a required property"
    ]
    assert "'url' is a required property" in telegram_spec().check_call("setWebhook", {})[0]


def test_telegram_refuses_a_text_of_4097_characters_and_an_empty_one() -> None:
    assert telegram_spec().check_call("sendMessage", {"chat_id": 1, "text": "x" * 4097}) == [
        "sendMessage.text: <str of length 4097> is too long"
    ]
    assert telegram_spec().check_call("sendMessage", {"chat_id": 1, "text": ""})


def test_telegram_refuses_an_unknown_method_and_an_unknown_parameter() -> None:
    assert telegram_spec().method("sendMesage") is None
    assert telegram_spec().method("sendmessage") == "sendMessage"  # the Bot API ignores case
    assert telegram_spec().check_call("sendMessage", {"chat_id": 1, "text": "hi", "reply_to": 3})


def test_telegram_refuses_a_webhook_secret_or_update_kind_its_description_rules_out() -> None:
    spec = telegram_spec()
    assert spec.check_call("setWebhook", {"url": "https://a.example", "secret_token": "has space"})
    assert spec.check_call("setWebhook", {"url": "https://a.example", "secret_token": "x" * 257})
    assert spec.check_call("setWebhook", {"url": "https://a.example", "allowed_updates": ["mesage"]})
    assert spec.check_call("setWebhook", {"url": "https://a.example", "max_connections": 0})
    assert (
        spec.check_call(
            "setWebhook",
            {"url": "https://a.example", "secret_token": "Ab_9-x", "allowed_updates": ["message"]},
        )
        == []
    )


def test_telegram_answers_are_checked_against_what_each_method_returns() -> None:
    spec = telegram_spec()
    info = {"url": "", "has_custom_certificate": False, "pending_update_count": 0}
    assert spec.check_answer("getWebhookInfo", {"ok": True, "result": info}) == []
    assert spec.check_answer("getWebhookInfo", {"ok": True, "result": {"url": ""}})
    assert spec.check_answer("sendMessage", {"ok": True, "result": {"message_id": 1}})
    assert (
        spec.check_answer("setWebhook", {"ok": True, "result": True, "description": "Webhook was set"}) == []
    )
    blocked = {"ok": False, "error_code": 403, "description": "Forbidden: bot was blocked by the user"}
    assert spec.check_answer("sendMessage", blocked) == []
    assert spec.check_answer("sendMessage", {"ok": False, "error": "blocked"})


def test_an_avito_send_as_the_responder_makes_it_is_allowed() -> None:
    assert avito_problems("POST", SEND, {"message": {"text": "Yes"}, "type": "text"}) == []


def test_avito_refuses_a_text_over_1000_characters() -> None:
    problems = avito_problems("POST", SEND, {"message": {"text": "x" * 1001}, "type": "text"})
    assert problems == [
        "POST /messenger/v1/accounts/{user_id}/chats/{chat_id}/messages: body.message.text: "
        "<str of length 1001> is too long"
    ]


def test_avito_refuses_a_missing_field_a_wrong_type_and_a_wrong_path_parameter() -> None:
    assert avito_problems("POST", SEND, {"type": "text"})  # no message (see AVITO_ERRATA)
    assert avito_problems("POST", SEND, {"message": {"text": 5}, "type": "text"})
    assert avito_problems("POST", SEND, {"message": {"text": "hi"}, "type": "image"})
    assert avito_problems(
        "POST", "/messenger/v1/accounts/me/chats/u2i-1/messages", {"message": {"text": "hi"}}
    )
    assert avito_problems("POST", "/messenger/v3/webhook", {"url": 7})
    assert avito_problems("POST", "/messenger/v3/webhook", {})


def test_avito_refuses_an_unknown_path_or_method_but_takes_the_token_path_with_its_slash() -> None:
    assert avito_problems("POST", "/messenger/v9/webhook", {"url": "https://a.example"})
    assert avito_problems("GET", "/messenger/v3/webhook")
    form_body = b"grant_type=client_credentials&client_id=a&client_secret=b"
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    spec = avito_spec()
    assert spec.check_request("POST", "/token", "", form, form_body).problems == []
    # Avito's guides and its clients post to /token/ (avito-observed-openapi.json): the
    # fake takes it as the live API does, and no other path gains a slash that way.
    assert spec.check_request("POST", "/token/", "", form, form_body).problems == []
    assert avito_problems("POST", "/messenger/v3/webhook/", {"url": "https://a.example"})


def test_the_message_list_may_be_a_bare_array_or_an_object_with_meta_and_nothing_else() -> None:
    spec = avito_spec()
    op = spec.check_request("GET", "/messenger/v3/accounts/7/chats/c/messages/", "", AUTH, b"").operation
    assert op is not None
    item = {
        "id": "m1",
        "author_id": 5,
        "created": 1,
        "direction": "in",
        "type": "text",
        "content": {"text": "hi"},
    }
    assert spec.check_response(op, 200, [item]) == []
    assert spec.check_response(op, 200, {"messages": [item], "meta": {"has_more": False}}) == []
    assert spec.check_response(op, 200, {"items": [item]})
    assert spec.check_response(op, 200, {"messages": [item], "next": 2})


def test_the_account_behind_a_token_is_a_path_of_avitos_user_api() -> None:
    spec = avito_spec()
    check = spec.check_request("GET", "/core/v1/accounts/self", "", AUTH, b"")
    assert check.operation is not None and check.problems == []
    assert (
        spec.check_response(
            check.operation, 200, {"id": 777, "name": "Shop", "profile_url": "https://avito.ru/u"}
        )
        == []
    )
    assert spec.check_response(check.operation, 200, {"id": "777"})


def test_avito_refuses_missing_authorization_and_out_of_range_or_unknown_query_parameters() -> None:
    listing = "/messenger/v3/accounts/777/chats/u2i-1/messages/"
    check = avito_spec().check_request("GET", listing, "limit=100", {}, b"")
    assert check.unauthenticated and check.problems
    assert avito_problems("GET", listing, query="limit=101")
    assert avito_problems("GET", listing, query="offset=-1")
    assert avito_problems("GET", listing, query="page=2")
    assert avito_problems("GET", listing, query="limit=100&offset=0") == []


def test_avito_answers_are_checked_against_the_documented_schemas() -> None:
    spec = avito_spec()
    op = spec.check_request("POST", "/messenger/v1/subscriptions", "", AUTH, b"").operation
    assert op is not None
    assert (
        spec.check_response(op, 200, {"subscriptions": [{"url": "https://a.example", "version": "3"}]}) == []
    )
    assert spec.check_response(op, 200, {"subscriptions": [{"url": "https://a.example"}]})
    assert spec.check_response(op, 403, {"error": {"code": 403, "message": "Forbidden"}}) == []
    assert spec.check_response(op, 403, {"ok": False})
    assert spec.check_response(op, 201, {})  # an answer the document does not give


def test_the_validator_fails_loudly_when_the_reference_documents_are_missing(tmp_path: Path) -> None:
    with pytest.raises(ReferenceMissing, match=r"telegram-bot-api\.json"):
        reference_dir(tmp_path)


def test_the_chat_types_the_settings_accept_are_the_ones_telegram_documents() -> None:
    # CHATQ_TELEGRAM_CHAT_TYPES is checked against TELEGRAM_CHAT_TYPES: Chat.type's values.
    (chat_type,) = (f for f in telegram_spec().type_fields("Chat") if f["name"] == "type")
    assert tuple(re.findall(r'"(\w+)"', chat_type["description"])) == TELEGRAM_CHAT_TYPES
