"""A person's commands (services/receiver/commands.py) on the in-memory store
(stores/operations/fake.py): retry and resolve, with the rest of the reply job, the
confirmation a needs_review re-send needs, and the refusals. The same commands against
Postgres, through the admin API: tests/integration/test_admin_api.py."""

from __future__ import annotations

import uuid

import pytest

from platforms.inbound import ApiError
from services.receiver.admin import commands
from shared.state.job import JobStatus
from shared.state.operation import OperationStatus
from stores.operations.fake import InMemoryOperations

pytestmark = pytest.mark.unit
S = OperationStatus


@pytest.fixture
def store() -> InMemoryOperations:
    return InMemoryOperations()


async def retry(store: InMemoryOperations, op: uuid.UUID, resend: bool = False) -> commands.Retried:
    return await commands.retry(store, op, resend=resend, by="ann", note="")


async def test_retrying_an_operation_that_does_not_exist_is_404(store: InMemoryOperations) -> None:
    with pytest.raises(ApiError) as refused:
        await retry(store, uuid.uuid4())
    assert (refused.value.status, refused.value.code) == (404, "operation_not_found")


@pytest.mark.parametrize("status", [S.ACCEPTED, S.WAITING, S.REPLYING, S.REPLIED, S.IGNORED])
async def test_only_failed_or_needs_review_operations_are_retried_or_resolved(
    store: InMemoryOperations, status: OperationStatus
) -> None:
    op = store.message(status)
    with pytest.raises(ApiError) as refused:
        await retry(store, op, resend=True)
    assert (refused.value.status, refused.value.code) == (409, "not_retryable")
    with pytest.raises(ApiError) as refused:
        await commands.resolve(store, op, "dismissed", owner="ann", note="")
    assert (refused.value.status, refused.value.code) == (409, "not_resolvable")
    assert store.op(op).status == status and store.state.events == []


async def test_a_failed_operation_goes_back_to_work_with_the_rest_of_its_job_and_is_published_again(
    store: InMemoryOperations,
) -> None:
    a, b, settled = store.message(S.FAILED), store.message(S.FAILED), store.message(S.REPLIED)
    job = store.job(JobStatus.FAILED, a, b, settled)
    store.state.in_window.update({a, b})
    done = await retry(store, b)
    assert sorted(done.retried) == sorted([a, b]) and not done.resend
    assert [store.op(i).status for i in (a, b, settled)] == [S.ACCEPTED, S.ACCEPTED, S.REPLIED]
    assert store.op(a).retries == 1 and store.op(a).job_id is None
    assert store.state.in_window == set()
    assert sorted(m.operation_id for m in store.state.outbox) == sorted([a, b])
    assert store.events(a) == ["retried by ann"]
    assert store.state.jobs[job].status == JobStatus.FAILED


async def test_a_failed_message_with_no_job_is_retried_alone(store: InMemoryOperations) -> None:
    op, other = store.message(S.FAILED), store.message(S.FAILED)
    assert (await retry(store, op)).retried == [op]
    assert store.op(other).status == S.FAILED


async def test_a_needs_review_operation_is_not_sent_again_without_the_persons_confirmation(
    store: InMemoryOperations,
) -> None:
    op = store.message(S.NEEDS_REVIEW)
    store.job(JobStatus.NEEDS_REVIEW, op)
    with pytest.raises(ApiError) as refused:
        await retry(store, op)
    assert (refused.value.status, refused.value.code) == (409, "resend_not_confirmed")
    assert store.op(op).status == S.NEEDS_REVIEW and store.state.outbox == []


async def test_a_confirmed_resend_supersedes_the_unknown_job_and_records_who_confirmed(
    store: InMemoryOperations,
) -> None:
    op = store.message(S.NEEDS_REVIEW)
    job = store.job(JobStatus.NEEDS_REVIEW, op)
    store.state.covered.add(op)
    done = await commands.retry(store, op, resend=True, by="ann", note="chat checked")
    assert done.resend and done.retried == [op]
    assert store.state.jobs[job].status == JobStatus.SUPERSEDED
    assert "re-send confirmed by ann" in store.state.jobs[job].error
    assert store.state.covered == set()
    assert store.events(op) == ["re-send confirmed by ann: chat checked"]


async def test_resolving_as_replied_manually_closes_the_jobs_operations_and_tells_the_chats_history(
    store: InMemoryOperations,
) -> None:
    a, b = store.message(S.NEEDS_REVIEW), store.message(S.NEEDS_REVIEW)
    job = store.job(JobStatus.NEEDS_REVIEW, a, b)
    done = await commands.resolve(store, a, "replied_manually", owner="ann", note="")
    assert done.status == S.REPLIED and sorted(done.resolved) == sorted([a, b])
    assert store.op(b).status == S.REPLIED and store.op(b).reason == "replied manually by ann"
    assert store.state.answered == [(store.state.jobs[job].chat_key, done.resolved, job)]


async def test_dismissing_ends_the_operation_ignored_and_the_chats_history_is_untouched(
    store: InMemoryOperations,
) -> None:
    op = store.message(S.FAILED)
    store.job(JobStatus.FAILED, op)
    done = await commands.resolve(store, op, "dismissed", owner="ann", note="spam")
    assert done.status == S.IGNORED and store.op(op).resolution == "dismissed"
    assert store.op(op).reason == "dismissed by ann: spam" and store.op(op).note == "spam"
    assert store.state.answered == []
    assert store.events(op) == ["dismissed by ann: spam"]
