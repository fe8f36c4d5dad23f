"""The responder's branches on the in-memory store (stores/jobs/fake.py): fresh, final,
superseded, busy, interrupted send, fold-in and unknown outcome, each in milliseconds.
The same decisions against Postgres: tests/integration/test_job_claim.py,
test_responder.py and test_promise.py."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import httpx
import pytest

from platforms.base import Listing, Sent, SentQuery
from platforms.failures import Failure, Kind
from services.responder.handler import Responder
from shared.alerts import Alerter
from shared.broker.consumer import RetryLater
from shared.messages import JobMessage, ReplyJob
from shared.state.job import DeliveryStatus, JobStatus
from shared.state.operation import OperationStatus
from stores.jobs.fake import T0, FakeDelivery, InMemoryJobs
from stores.jobs.protocol import Turn

pytestmark = pytest.mark.unit


class Chat:
    """A platform: records sends, fails on demand, and finds sends when told to."""

    max_text = 4096

    def __init__(
        self, name: str = "telegram", *, idempotent: bool = False, can_reconcile: bool = False
    ) -> None:
        self.name, self.idempotent, self.can_reconcile = name, idempotent, can_reconcile
        self.sent: list[str] = []
        self.failures: list[Failure] = []
        self.shows: Sent | None = None

    async def send(
        self, account_id: str, chat_id: str, text: str, *, key: str, business_connection_id: str | None = None
    ) -> Sent:
        if self.failures:
            raise self.failures.pop(0)
        self.sent.append(text)
        return Sent(f"p-{len(self.sent)}")

    async def probe(self, account_id: str) -> None:
        return None

    async def find_sent(self, query: SentQuery) -> Sent | None:
        return self.shows

    async def aclose(self) -> None:
        return None


class Writer:
    """Answers each batch by joining it; counts the calls. A hook runs before each call
    (a message arriving while the reply is written)."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.before: list[Any] = []

    async def write(
        self,
        history: Sequence[Turn],
        batch: Sequence[str],
        listing: Listing | None = None,
        writing: object = None,
    ) -> str:
        if self.before:
            self.before.pop(0)()
        self.batches.append(list(batch))
        return "re: " + " / ".join(batch)

    def instructions(self) -> str:
        return ""

    async def aclose(self) -> None:
        return None


class Delivery:
    def __init__(self, job_id: uuid.UUID, attempt: int = 1) -> None:
        self.message_id = str(job_id)
        self.headers = {"chatq-attempt": attempt}
        self.body = ReplyJob(
            job_id=job_id,
            window_id=uuid.uuid4(),
            platform="telegram",
            account_id="bot",
            chat_id="77",
            messages=(
                JobMessage(
                    operation_id=uuid.uuid4(),
                    message_id="1",
                    author_id=None,
                    text="hi",
                    sent_at=T0,
                    received_at=T0,
                ),
            ),
            created_at=T0,
        ).to_bytes()


#: No alert sink configured: nothing is posted (one client for every test: building one
#: loads the TLS certificates, tens of milliseconds).
ALERTER = Alerter(None, None, httpx.AsyncClient())


def responder(store: InMemoryJobs, chat: Chat, writer: Writer | None = None) -> Responder:
    return Responder(store, {chat.name: chat}, writer or Writer(), ALERTER, fold_max_rounds=2)


async def test_a_fresh_job_is_sent_once_and_its_messages_are_replied() -> None:
    store, chat = InMemoryJobs(), Chat()
    a, b = store.message("1", "Do you deliver?"), store.message("2", "And to Riga?")
    job_id = store.job(a, b)
    await responder(store, chat).handle(Delivery(job_id))  # type: ignore[arg-type]
    assert chat.sent == ["re: Do you deliver? / And to Riga?"]
    assert store.jobs[job_id].status is JobStatus.SENT
    assert store.jobs[job_id].delivery.status is DeliveryStatus.SENT  # type: ignore[union-attr]
    assert {store.operations[o].status for o in (a, b)} == {OperationStatus.REPLIED}
    assert not store.locked


async def test_a_job_already_final_is_skipped_without_a_send() -> None:
    store, chat = InMemoryJobs(), Chat()
    job_id = store.job(store.message("1"))
    store.jobs[job_id].status = JobStatus.SENT
    await responder(store, chat).handle(Delivery(job_id))  # type: ignore[arg-type]
    assert chat.sent == []


async def test_a_job_whose_messages_another_reply_holds_is_superseded_without_a_send() -> None:
    store, chat = InMemoryJobs(), Chat()
    op = store.message("1")
    other, job_id = store.job(op), store.job(op)
    store.coverage[op] = other
    await responder(store, chat).handle(Delivery(job_id))  # type: ignore[arg-type]
    assert chat.sent == []
    assert store.jobs[job_id].status is JobStatus.SUPERSEDED


async def test_a_copy_of_a_job_another_handler_holds_waits_without_spending_an_attempt() -> None:
    store, chat = InMemoryJobs(), Chat()
    job_id = store.job(store.message("1"))
    store.locked.add(job_id)  # the first copy's handler
    with pytest.raises(RetryLater) as waiting:
        await responder(store, chat).handle(Delivery(job_id))  # type: ignore[arg-type]
    assert waiting.value.kind == "busy" and waiting.value.counts is False
    assert chat.sent == [] and store.jobs[job_id].status is JobStatus.PENDING


async def test_an_interrupted_send_the_platform_shows_is_recorded_and_not_sent_again() -> None:
    store, chat = InMemoryJobs(), Chat("avito", can_reconcile=True)
    job_id = store.job(store.message("1"), platform="avito")
    store.jobs[job_id].status = JobStatus.PROCESSING
    store.jobs[job_id].delivery = FakeDelivery(DeliveryStatus.SENDING, "re: message 1", T0)
    chat.shows = Sent("p-found")
    await responder(store, chat).handle(Delivery(job_id, attempt=2))  # type: ignore[arg-type]
    assert chat.sent == []
    assert store.jobs[job_id].status is JobStatus.SENT
    assert store.jobs[job_id].platform_message_id == "p-found"


async def test_an_interrupted_send_the_platform_cannot_check_goes_to_a_person() -> None:
    store, chat = InMemoryJobs(), Chat("telegram")
    op = store.message("1")
    job_id = store.job(op)
    store.jobs[job_id].status = JobStatus.PROCESSING
    store.jobs[job_id].delivery = FakeDelivery(DeliveryStatus.SENDING, "re: message 1", T0)
    await responder(store, chat).handle(Delivery(job_id, attempt=2))  # type: ignore[arg-type]
    assert chat.sent == []
    assert store.jobs[job_id].status is JobStatus.NEEDS_REVIEW
    assert store.operations[op].status is OperationStatus.NEEDS_REVIEW


async def test_a_message_arriving_while_the_reply_is_written_is_folded_in_and_answered_by_the_one_reply() -> (
    None
):
    store, chat, writer = InMemoryJobs(), Chat(), Writer()
    first = store.message("1", "Is it available?")
    job_id = store.job(first)
    late = store.message("2", "In blue?")
    writer.before.append(lambda: store.arrive_in_window(job_id, late))
    await responder(store, chat, writer).handle(Delivery(job_id))  # type: ignore[arg-type]
    assert writer.batches == [["Is it available?"], ["Is it available?", "In blue?"]]
    assert chat.sent == ["re: Is it available? / In blue?"]
    assert {store.operations[o].status for o in (first, late)} == {OperationStatus.REPLIED}


async def test_a_send_whose_answer_was_lost_on_telegram_goes_to_a_person_and_is_never_sent_again() -> None:
    store, chat = InMemoryJobs(), Chat("telegram")
    op = store.message("1")
    job_id = store.job(op)
    chat.failures.append(Failure(Kind.UNKNOWN, "request sent but the answer was lost (ReadTimeout)"))
    await responder(store, chat).handle(Delivery(job_id))  # type: ignore[arg-type]
    assert chat.sent == []
    assert store.jobs[job_id].status is JobStatus.NEEDS_REVIEW
    assert store.jobs[job_id].delivery.status is DeliveryStatus.UNKNOWN  # type: ignore[union-attr]
    assert store.operations[op].status is OperationStatus.NEEDS_REVIEW


async def test_a_send_whose_answer_was_lost_on_an_idempotent_platform_is_retried_then_sent_under_its_key() -> (
    None
):
    store, chat = InMemoryJobs(), Chat("telegram", idempotent=True)
    job_id = store.job(store.message("1"))
    chat.failures.append(Failure(Kind.UNKNOWN, "504 from the gateway"))
    with pytest.raises(RetryLater) as retry:
        await responder(store, chat).handle(Delivery(job_id))  # type: ignore[arg-type]
    assert retry.value.kind == "unknown_outcome"
    assert store.jobs[job_id].status is JobStatus.PENDING
    await responder(store, chat).handle(Delivery(job_id, attempt=2))  # type: ignore[arg-type]
    assert chat.sent == ["re: message 1"]
    assert store.jobs[job_id].status is JobStatus.SENT
