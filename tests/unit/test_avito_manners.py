"""The pure parts of the Avito manners (issue 16): paging through Avito's lists, which listed
messages are a buyer's still unanswered, the listing a chat is about, the buyer's language
and the facts responder's answer in it, and which Avito messages are never answered."""

from __future__ import annotations

from pathlib import Path

import pytest

from platforms.avito.adapter import listing_of, message_list, next_offset, since_last_answer
from platforms.avito.webhook import message_intake
from platforms.base import Listing, segment
from platforms.failures import Failure, Kind
from services.responder.llm import (
    DEFAULT_FACTS,
    FactsWriter,
    account_facts_path,
    buyer_language,
    listing_text,
    parse_facts,
)

pytestmark = pytest.mark.unit

ME = "777"


def msg(id_: str, created: int, *, direction: str = "in", author: int = 555, **extra: object) -> dict:
    return {
        "id": id_,
        "created": created,
        "direction": direction,
        "author_id": int(ME) if direction == "out" else author,
        "type": "text",
        "content": {"text": f"text of {id_}"},
        **extra,
    }


def test_the_message_list_is_read_as_a_bare_array_or_as_an_object_with_meta() -> None:
    items = [msg("a", 2), msg("b", 1)]
    assert message_list(items) == items
    assert message_list({"messages": items, "meta": {"has_more": False}}) == items
    assert message_list({"messages": []}) == []
    for unknown in ({"items": items}, {"messages": "a"}, [1, 2], "x", None):
        assert message_list(unknown) is None


def test_a_full_page_asks_for_the_next_and_a_short_one_ends_the_list() -> None:
    assert next_offset(0, 100) == 100
    assert next_offset(100, 100) == 200
    assert next_offset(200, 37) is None
    assert next_offset(0, 0) is None


def test_paging_stops_at_the_furthest_offset_avito_takes() -> None:
    assert next_offset(900, 100) == 1000
    assert next_offset(1000, 100) is None


def test_the_buyers_messages_since_the_accounts_latest_are_found_oldest_first() -> None:
    items = [msg("b3", 130), msg("b2", 120), msg("r1", 110, direction="out"), msg("b1", 100)]
    found, reached = since_last_answer(items, ME, since=0)
    assert [m["id"] for m in found] == ["b2", "b3"]
    assert reached  # older pages need not be read


def test_a_list_in_any_order_is_read_newest_first() -> None:
    items = [msg("b1", 100), msg("r1", 110, direction="out"), msg("b3", 130), msg("b2", 120)]
    assert [m["id"] for m in since_last_answer(items, ME, since=0)[0]] == ["b2", "b3"]


def test_a_message_the_seller_wrote_by_hand_answers_those_before_it() -> None:
    seller = msg("s1", 110, author=int(ME))  # listed as the account's, whatever its direction says
    found, _ = since_last_answer([msg("b2", 120), seller, msg("b1", 100)], ME, since=0)
    assert [m["id"] for m in found] == ["b2"]


def test_messages_older_than_the_horizon_are_left_alone() -> None:
    found, reached = since_last_answer([msg("b2", 120), msg("b1", 100)], ME, since=110)
    assert [m["id"] for m in found] == ["b2"] and reached


def test_a_chat_of_buyer_messages_only_asks_for_the_older_page() -> None:
    found, reached = since_last_answer([msg("b2", 120), msg("b1", 100)], ME, since=0)
    assert [m["id"] for m in found] == ["b1", "b2"] and not reached


def test_listed_items_without_an_id_or_a_time_are_skipped() -> None:
    items = [
        msg("b2", 120),
        {"direction": "in", "created": 115},
        msg("", 112),
        {**msg("b1", 100), "created": "x"},
    ]
    assert [m["id"] for m in since_last_answer(items, ME, since=0)[0]] == ["b2"]


def test_the_listing_is_read_from_the_chats_item_context() -> None:
    chat = {
        "id": "u2i-1",
        "context": {
            "type": "item",
            "value": {
                "id": 1,
                "user_id": 141906442,
                "title": "Mazda 3 2008",
                "price_string": "300 000 ₽",
                "url": "https://avito.ru/x",
            },
        },
    }
    assert listing_of(chat, "141906442") == Listing("Mazda 3 2008", "300 000 ₽", "https://avito.ru/x")
    assert listing_text(Listing("Mazda 3 2008", "300 000 ₽", "https://avito.ru/x")) == (
        "“Mazda 3 2008”, 300 000 ₽, https://avito.ru/x"
    )
    assert listing_text(Listing("Mazda 3 2008")) == "“Mazda 3 2008”"


@pytest.mark.parametrize("author", [555, "555", None, True])
def test_a_listing_that_is_not_the_sellers_own_is_not_given_to_the_writer(author: object) -> None:
    # The account asked about another seller's listing (or the chat names no author): the
    # writer, speaking for this seller, is told nothing about it.
    value = {"id": 1, "title": "Someone else's car", "price_string": "1 ₽", "url": "https://avito.ru/y"}
    if author is not None:
        value["user_id"] = author
    assert listing_of({"context": {"type": "item", "value": value}}, "141906442") is None


@pytest.mark.parametrize(
    "chat",
    [
        {"id": "u2u-1"},
        {"context": {"type": "user", "value": {"title": "not a listing"}}},
        {"context": {"type": "item", "value": {"id": 1}}},
        {"context": {"type": "item", "value": "garbage"}},
        [],
    ],
)
def test_a_chat_about_no_listing_has_none(chat: object) -> None:
    assert listing_of(chat, "141906442") is None


def test_a_placeholder_of_ours_does_not_make_a_russian_buyer_english() -> None:
    assert buyer_language(["[the buyer sent a photo] Это ещё продаётся?"]) == "ru"
    assert buyer_language(["[voice message, 12 s]", "Есть доставка?"]) == "ru"


def test_the_buyers_language_is_the_script_they_write_in() -> None:
    assert buyer_language(["Здравствуйте! Велосипед ещё продаёте?"]) == "ru"
    assert buyer_language(["Is it still available?"]) == "en"
    assert buyer_language(["iPhone 12 ещё в наличии?"]) == "ru"
    assert buyer_language(["👍"]) == "en"


def test_the_built_in_facts_answer_in_english_and_in_russian() -> None:
    books = parse_facts(DEFAULT_FACTS)
    assert set(books) == {"en", "ru"}
    assert books["ru"].facts and books["ru"].refusals


async def test_a_russian_speaking_buyer_is_answered_in_russian_about_the_listing() -> None:
    writer = FactsWriter(DEFAULT_FACTS)
    listing = Listing("Велосипед Stels", "12 000 ₽", "https://avito.ru/1")
    reply = await writer.write([], ["Здравствуйте, велосипед ещё актуален? Какая цена?"], listing)
    assert reply == (
        "Здравствуйте! По объявлению «Велосипед Stels» (12 000 ₽): Да, в наличии. Цена в объявлении окончательная."
    )
    assert await writer.write([], ["Можно обменять на самокат?"]) == "Здравствуйте! Обмен не рассматриваем."


async def test_an_english_speaking_buyer_hears_the_listings_title_and_price() -> None:
    writer = FactsWriter(DEFAULT_FACTS)
    reply = await writer.write([], ["Is it still available?"], Listing("Bicycle", "12 000 ₽"))
    assert reply == "Hello! About “Bicycle” (12 000 ₽): Yes, it is available."
    assert await writer.write([], ["Is it still available?"]) == "Hello! Yes, it is available."


async def test_a_facts_file_without_the_buyers_language_answers_in_its_own() -> None:
    writer = FactsWriter("[facts]\nцена, price: The price is final.\n")
    assert await writer.write([], ["Какая цена?"]) == "Hello! The price is final."
    assert await writer.write([], ["Что-то ещё"]) == FactsWriter.FALLBACK


def intake(**changes: object):
    values: dict = {
        "account_id": ME,
        "chat_id": "c1",
        "message_id": "m1",
        "author_id": 555,
        "kind": "text",
        "chat_type": "u2i",
        "content": {"text": "Still there?"},
        "created": 1_700_000_000,
        "raw": "{}",
    }
    values.update(changes)
    return message_intake(**values)


def test_a_chat_with_avito_itself_is_never_answered_nor_taken_for_the_seller() -> None:
    a2u = intake(chat_type="a2u", author_id=int(ME))
    assert a2u.ignored_reason == "a chat with Avito itself (a2u): not answered"
    assert not a2u.written_by_seller
    assert intake(chat_type="a2u").ignored_reason == "a chat with Avito itself (a2u): not answered"


def test_system_messages_and_the_accounts_own_are_stored_as_ignored_with_the_reason() -> None:
    assert intake(kind="system").ignored_reason == "Avito system message"
    own = intake(author_id=int(ME))
    assert own.written_by_seller and own.ignored_reason == "written by the account"
    image = intake(kind="image", content={"image": {"sizes": {}}})
    assert (image.ignored_reason, image.text) == (None, "[the buyer sent a photo]")
    assert intake().ignored_reason is None
    assert intake(chat_type=None).ignored_reason is None  # the poll does not know the type


def test_our_own_reply_answers_nothing_the_inbox_did_not_hold_but_the_sellers_message_does() -> None:
    ours = {"id": "r1", "author_id": int(ME), "direction": "out", "created": 110}
    items = [msg("b2", 105), ours, msg("b3", 120), msg("b1", 100)]
    found, reached = since_last_answer(items, ME, since=0, ours=frozenset({"r1"}))
    assert [m["id"] for m in found] == ["b1", "b2", "b3"] and reached is False
    # The same message written by the seller in person answers what came before it.
    found, reached = since_last_answer(items, ME, since=0)
    assert [m["id"] for m in found] == ["b3"] and reached is True


def test_an_accounts_facts_file_is_read_only_from_the_facts_folder(tmp_path: Path) -> None:
    folder = tmp_path / "facts"
    folder.mkdir()
    (folder / "shop.txt").write_text("x")
    (tmp_path / "secret.key").write_text("k")
    (folder / "leak.txt").symlink_to(tmp_path / "secret.key")
    assert account_facts_path(str(folder), "shop.txt") == (folder / "shop.txt").resolve()
    for name in ("../secret.key", "/etc/passwd", ".env", "a/b", "leak.txt", "shop.txt\n"):
        with pytest.raises(ValueError, match="CHATQ_FACTS_DIR"):
            account_facts_path(str(folder), name)
    with pytest.raises(ValueError, match="not set"):
        account_facts_path(None, "shop.txt")


async def test_a_fact_answers_when_any_of_its_keywords_starts_a_word_taken_literally() -> None:
    writer = FactsWriter("[facts]\nship, deliver: We ship daily.\nc++, a.b: Literal keys.\n")
    assert "We ship daily." in await writer.write([], ["Do you DELIVER to Kazan?"])
    assert "We ship daily." in await writer.write([], ["shipping?"]), "a keyword starts a word"
    assert "We ship daily." not in await writer.write([], ["relationship?"]), "not inside a word"
    assert "Literal keys." in await writer.write([], ["is c++ ok"])
    assert "Literal keys." not in await writer.write([], ["axb", "c+"]), "keywords are not patterns"


@pytest.mark.parametrize(
    ("chat_id", "sent_as"),
    [
        ("../../../core/v1/accounts/self", "..%2F..%2F..%2Fcore%2Fv1%2Faccounts%2Fself"),
        ("u2i-a/b?x=1#y", "u2i-a%2Fb%3Fx%3D1%23y"),
        ("u2i-%2E%2E", "u2i-%252E%252E"),
        ("u2i-Ok_1", "u2i-Ok_1"),
    ],
)
def test_a_platform_id_goes_into_a_url_as_one_percent_encoded_segment(chat_id: str, sent_as: str) -> None:
    assert segment(chat_id) == sent_as
    assert "/" not in segment(chat_id)


@pytest.mark.parametrize("chat_id", ["", ".", ".."])
def test_an_id_that_would_be_a_dot_segment_or_nothing_is_refused_for_good(chat_id: str) -> None:
    # yarl (under aiohttp) decodes %2E and resolves dot segments: no encoding keeps them ids.
    with pytest.raises(Failure) as refused:
        segment(chat_id)
    assert refused.value.kind is Kind.PERMANENT
