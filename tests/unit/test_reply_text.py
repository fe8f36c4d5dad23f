"""What the reply writer sees of a job: Telegram bot commands are greeted, not written to."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest

from services.responder.handler import for_the_writer, is_command
from stores.jobs.protocol import Job, Message, Turn

pytestmark = pytest.mark.unit

NOW = datetime(2025, 1, 1, tzinfo=UTC)


def job(platform: str, *texts: str, history: tuple[Turn, ...] = ()) -> Job:
    messages = tuple(Message(uuid.uuid4(), str(i), t, NOW, NOW) for i, t in enumerate(texts, 1))
    return Job(uuid.uuid4(), platform, "4242", "1001", messages, history)


@pytest.mark.parametrize("text", ["/start", "/start ref-42", "/help@shop4242_bot", "/price please"])
def test_a_message_that_begins_with_a_slash_is_a_command(text: str) -> None:
    assert is_command(text)


@pytest.mark.parametrize("text", ["Hello /start", " /start", "Is it 1/2 price?", "Start"])
def test_a_slash_anywhere_but_the_start_is_not_a_command(text: str) -> None:
    assert not is_command(text)


def test_a_telegram_job_of_commands_only_leaves_nothing_for_the_writer() -> None:
    # Nothing to write about: the responder sends the greeting and asks no model.
    assert for_the_writer(job("telegram", "/start", "/help"))[1] == []


def test_commands_are_dropped_from_what_the_writer_sees_of_a_job_and_of_its_history() -> None:
    history = (Turn("buyer", "/start"), Turn("bot", "Hello! Write your question"), Turn("buyer", "Hi"))
    seen_history, batch = for_the_writer(job("telegram", "/start", "Do you deliver?", history=history))
    assert batch == ["Do you deliver?"]
    assert seen_history == [Turn("bot", "Hello! Write your question"), Turn("buyer", "Hi")]


def test_other_platforms_have_no_commands_and_their_texts_go_to_the_writer_as_written() -> None:
    assert for_the_writer(job("avito", "/start", "Price?")) == ([], ["/start", "Price?"])
