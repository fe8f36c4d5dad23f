"""Long replies as parts: in order, within the platform's limit, cut where a reader pauses."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.responder.parts import split_reply

pytestmark = pytest.mark.unit


def test_a_reply_within_the_limit_is_one_part() -> None:
    assert split_reply("Yes, it is available.", 4096) == ["Yes, it is available."]


def test_a_long_reply_is_cut_after_a_sentence_not_inside_one() -> None:
    text = "First sentence here. " * 10 + "Last one."
    parts = split_reply(text, 50)
    assert all(len(p) <= 50 for p in parts)
    assert all(p.endswith(".") for p in parts)
    assert " ".join(parts) == text.strip()


def test_line_breaks_come_before_sentences_as_cut_points() -> None:
    text = "Delivery: 2-5 days. Pick-up by appointment.\n" + "x" * 30
    assert split_reply(text, 60) == ["Delivery: 2-5 days. Pick-up by appointment.", "x" * 30]


def test_a_word_longer_than_a_part_is_cut_hard() -> None:
    assert split_reply("a" * 25, 10) == ["a" * 10, "a" * 10, "a" * 5]


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=3000), st.integers(20, 400))
def test_parts_are_never_empty_never_too_long_and_keep_every_word_in_order(text: str, limit: int) -> None:
    parts = split_reply(text, limit)
    assert all(0 < len(p) <= limit for p in parts)
    assert "".join(parts).split() == text.split() or "".join("".join(parts).split()) == "".join(text.split())
    assert split_reply(text, limit) == parts  # deterministic: a resumed reply sends the same parts
