"""What reaches the model is bounded (issue 39, point 4): each turn, the history and the
whole prompt, in characters, and what was cut is said; and the model's answer is read
before it is sent (point 11): a long run of the seller's instructions, or a secret, holds
it for a person."""

from __future__ import annotations

import pytest

from services.responder.llm import CUT_MARK, SYSTEM_PROMPT, bound_prompt
from services.responder.reply_check import ReplyCheck, repeated_run, secret_in
from shared.messages import PromptBounds
from stores.accounts.registry import Account
from stores.jobs.protocol import Turn

pytestmark = pytest.mark.unit

BOUNDS = PromptBounds(turn=4000, history=8000, prompt=32000)


def size(system: str, history: list[Turn], said: str) -> int:
    return len(system) + sum(len(t.text) for t in history) + len(said)


def test_a_200000_character_buyer_message_reaches_the_model_cut_to_the_turn_bound_and_the_cut_is_said() -> (
    None
):
    system, history, said, cuts = bound_prompt("Answer buyers.", [], ["x" * 200_000], BOUNDS)
    assert len(said) == 4000 and said.endswith(CUT_MARK)
    assert cuts == ["1 message(s) longer than 4000 characters cut to that"]
    assert system == "Answer buyers." and history == []


def test_the_history_keeps_its_newest_turns_within_its_bound() -> None:
    turns = [Turn("buyer" if i % 2 == 0 else "bot", f"{i:04d}" + "h" * 2996) for i in range(10)]
    _, history, _, cuts = bound_prompt("S", turns, ["and now?"], BOUNDS)
    assert [t.text[:4] for t in history] == ["0008", "0009"]  # 6,000 of 8,000; a third would pass it
    assert cuts == ["8 older turn(s) of the chat left out"]


def test_the_buyers_latest_messages_and_the_sellers_instructions_first_are_kept_within_the_whole_prompt() -> (
    None
):
    batch = [f"message {i}: " + "m" * 3900 for i in range(50)]  # 50 x ~3,911: a job's most
    facts = SYSTEM_PROMPT.replace("{facts}", "f" * 100_000)
    turns = [Turn("buyer", "t" * 3000)] * 12
    system, history, said, cuts = bound_prompt(facts, turns, batch, BOUNDS)
    assert size(system, history, said) <= BOUNDS.prompt
    assert said.endswith(batch[-1]) and len(said) == BOUNDS.prompt // 2
    assert system.startswith(SYSTEM_PROMPT.split("{facts}")[0]) and system.endswith(CUT_MARK)
    assert history == []
    assert cuts == [
        "the buyer's messages cut to their last 16000 characters",
        f"the seller's instructions and facts cut from {len(facts)} to 16000 characters",
        "12 older turn(s) of the chat left out",
    ]


@pytest.mark.parametrize("turns", [0, 3, 40])
@pytest.mark.parametrize("message", [10, 5000, 300_000])
def test_the_whole_prompt_never_passes_its_bound(turns: int, message: int) -> None:
    system, history, said, _ = bound_prompt(
        "s" * 30_000, [Turn("bot", "b" * 5000)] * turns, ["q" * message, "and?"], BOUNDS
    )
    assert size(system, history, said) <= BOUNDS.prompt


def test_a_prompt_within_its_bounds_reaches_the_model_whole_and_nothing_is_said() -> None:
    turns = [Turn("buyer", "Hi"), Turn("bot", "Hello!")]
    assert bound_prompt("Answer.", turns, ["Price?", "Delivery?"], BOUNDS) == (
        "Answer.",
        turns,
        "Price?\nDelivery?",
        [],
    )


INSTRUCTIONS = (
    "You are Olga from Bike Shop. Never mention our supplier Velomir or the 30% markup; if asked about "
    "wholesale say we do not do it.\n\nFacts:\n{facts}"
)


def test_a_reply_that_repeats_sixty_characters_of_the_sellers_instructions_is_held() -> None:
    reply = "Sure! I was told: you are Olga from Bike Shop. Never mention our supplier Velomir or the 30% markup. Ok?"
    why = ReplyCheck([], None).why_held("generic", "shop-1", INSTRUCTIONS, reply)
    assert why == (
        "held for a person: the written reply repeats 81 characters of the seller's instructions to the "
        "model verbatim"
    )


def test_a_reply_that_repeats_the_facts_meant_for_buyers_or_a_short_phrase_is_sent() -> None:
    facts_reply = (
        "We ship across the country; delivery takes 2-5 days, and pick-up is possible by appointment."
    )
    assert ReplyCheck([], None).why_held("generic", "s", INSTRUCTIONS, facts_reply) is None
    assert repeated_run(INSTRUCTIONS, "We do not do wholesale, sorry: Bike Shop sells retail.", 60) == 0
    # Line breaks and capitals do not hide a run.
    assert (
        repeated_run(
            INSTRUCTIONS, "YOU ARE OLGA FROM BIKE SHOP.\nNEVER MENTION OUR SUPPLIER VELOMIR or so", 60
        )
        >= 60
    )


def test_a_reply_that_holds_a_secret_is_held_and_the_reason_never_names_it() -> None:
    api_key = "llm-key-5e2b9c7d1a"
    check = ReplyCheck([api_key, "short"], None)
    why = check.why_held("generic", "s", "", f"Here is what I was given: {api_key}")
    assert why == ("held for a person: the written reply holds a secret of this deployment's configuration")
    assert api_key not in why
    assert check.why_held("generic", "s", "", "a short answer") is None  # "short" is too short to look for


@pytest.mark.parametrize(
    ("reply", "what"),
    [
        ("use whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw to sign", "a Standard Webhooks secret (whsec_…)"),
        ("the key is sk-proj-abcdefghijklmnopqrstuvwx", "an API key (sk-…)"),
        ("token 123456789:AAHdqTcvCH1vGWJxfSeofSAs0K5PALDsaw0", "a Telegram bot token"),
        ("-----BEGIN RSA PRIVATE KEY-----\nMIIE...", "a private key"),
        ("AKIAIOSFODNN7EXAMPLE", "an AWS access key id"),
    ],
)
def test_a_secret_shaped_string_is_found_whoever_it_belongs_to(reply: str, what: str) -> None:
    assert secret_in(reply, []) == what


def test_an_ordinary_reply_holds_no_secret() -> None:
    assert secret_in("Ask for a desk-top model, sk-8 is out of stock; call +7 900 123-45-67.", []) is None


class Accounts:
    """The registry's one method the check reads."""

    def __init__(self, *accounts: Account) -> None:
        self._accounts = {(a.platform, a.account_id): a for a in accounts}

    def get(self, platform: str, account_id: str) -> Account | None:
        return self._accounts.get((platform, account_id))


def test_a_reply_that_holds_the_accounts_own_credential_is_held_but_its_reply_url_may_be_named() -> None:
    shop = Account(
        "generic",
        "shop-1",
        "Shop",
        "active",
        None,
        "admin",
        False,
        {},
        {"webhook_secret": "whsec_c2hvcC0xLXNlY3JldA==", "reply_url": "https://shop.example/replies"},
    )
    check = ReplyCheck([], Accounts(shop))  # type: ignore[arg-type]
    # The secret without its prefix is the secret too.
    held = check.why_held("generic", "shop-1", "", "my secret is c2hvcC0xLXNlY3JldA== ok")
    assert held is not None and "c2hvcC0x" not in held
    assert check.why_held("generic", "shop-1", "", "write to https://shop.example/replies") is None
    # Another account's replies are read for their own credentials, not this one's.
    assert check.why_held("generic", "shop-2", "", "my secret is c2hvcC0xLXNlY3JldA== ok") is None
