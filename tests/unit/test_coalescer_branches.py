"""The coalescer's filing and emission decisions on the in-memory store
(stores/windows/fake.py): opening and growing a window, redeliveries, messages not in the
inbox, due and not due, blocked chats, messages in transit, the cap on a job, empty
windows, a refused window set aside alone, and giving up on an unfiled message. The same
decisions against Postgres: tests/integration/test_coalescer.py and test_chat_identity.py."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest

from services.coalescer.service import Coalescer, job_id_for
from shared.broker.consumer import Reject
from shared.messages import InboundMessage, JobCaps
from shared.state.operation import OperationStatus
from stores.windows.fake import InMemoryWindows
from stores.windows.protocol import Filing
from stores.windows.window import WindowPolicy, open_window

pytestmark = pytest.mark.unit

#: A reply 5 s after a chat's first message, 2 s after its last, never past 8 s.
POLICY = WindowPolicy(quiet=2, delay_min=5, delay_max=5, max_wait=8)


def coalescer(store: InMemoryWindows, caps: JobCaps | None = None) -> Coalescer:
    return Coalescer(store, POLICY, draw=lambda: 0.0, caps=caps)


@pytest.fixture
def store() -> InMemoryWindows:
    return InMemoryWindows()


async def test_a_chats_first_message_opens_a_window_due_after_the_reply_delay_and_waits(
    store: InMemoryWindows,
) -> None:
    m = store.receive()
    filed = await coalescer(store).file(m)
    assert filed is not None and filed.opened
    assert filed.due_at == store.clock + timedelta(seconds=5)
    assert store.operation(m).status == OperationStatus.WAITING
    assert store.events(m) == ["filed"]


async def test_a_burst_grows_one_window_pushed_out_by_quiet_but_never_past_max_wait(
    store: InMemoryWindows,
) -> None:
    c = coalescer(store)
    first = await c.file(store.receive(text="a"))
    store.advance(4)
    second = await c.file(store.receive(text="b"))
    store.advance(3)
    third = await c.file(store.receive(text="c"))
    assert first and second and third
    assert second.window_id == third.window_id == first.window_id and not second.opened
    assert second.due_at == first.due_at + timedelta(seconds=1)  # 4 s + quiet 2 s
    assert third.due_at == store.clock - timedelta(seconds=7) + timedelta(seconds=8)  # max wait


async def test_a_redelivered_message_is_filed_once(store: InMemoryWindows) -> None:
    c = coalescer(store)
    m = store.receive()
    assert await c.file(m) is not None
    assert await c.file(m) is None
    assert store.events(m) == ["filed"]


async def test_a_message_not_in_the_inbox_is_rejected_and_nothing_is_written(store: InMemoryWindows) -> None:
    stranger = store.receive().model_copy(update={"operation_id": uuid.uuid4()})
    with pytest.raises(Reject, match="not in the inbox"):
        await coalescer(store).file(stranger)
    assert await store.open_windows() == 0


async def test_a_due_window_becomes_one_job_with_its_messages_in_platform_order(
    store: InMemoryWindows,
) -> None:
    c = coalescer(store)
    later = store.receive(text="second", message_id="10")
    earlier = store.receive(text="first", message_id="9", sent_at=store.clock - timedelta(seconds=1))
    filed = await c.file(later)
    await c.file(earlier)
    assert await c.emit_due() == 0
    store.advance(5)
    assert await c.emit_due() == 1
    (job,) = store.state.outbox
    assert [m.text for m in job.messages] == ["first", "second"]
    assert filed and job.job_id == job_id_for(filed.window_id)
    assert store.operation(later).job_id == job.job_id
    assert store.events(later) == ["filed", "emitted"]
    assert await store.open_windows() == 0


async def test_telegram_ids_order_as_numbers_when_the_times_tie(store: InMemoryWindows) -> None:
    c = coalescer(store)
    for mid in ("10", "9"):
        await c.file(store.receive(text=mid, message_id=mid))
    store.advance(5)
    await c.emit_due()
    assert [m.text for m in store.state.outbox[0].messages] == ["9", "10"]


async def test_the_scheduler_is_told_when_the_next_window_falls_due(store: InMemoryWindows) -> None:
    c = coalescer(store)
    assert await c.seconds_to_next_due() is None
    await c.file(store.receive())
    store.advance(1.5)
    assert await c.seconds_to_next_due() == 3.5


async def test_a_window_opened_while_its_chats_job_is_in_flight_waits_for_that_job(
    store: InMemoryWindows,
) -> None:
    c = coalescer(store)
    await c.file(store.receive(text="a"))
    store.advance(5)
    await c.emit_due()
    job = store.state.outbox[0]
    await c.file(store.receive(text="b"))
    store.advance(10)
    assert await c.emit_due() == 0
    store.end_job(job.job_id)
    assert await c.emit_due() == 1
    assert [m.text for m in store.state.outbox[1].messages] == ["b"]


async def test_a_window_waits_while_an_earlier_message_of_its_chat_is_in_transit(
    store: InMemoryWindows,
) -> None:
    c = coalescer(store)
    in_transit = store.receive(text="a")
    store.advance(0.1)
    await c.file(store.receive(text="b"))
    store.advance(5)
    assert await c.emit_due() == 0
    await c.file(in_transit)
    store.advance(2)
    assert await c.emit_due() == 1
    assert [m.text for m in store.state.outbox[0].messages] == ["a", "b"]


async def test_a_window_filed_late_waits_for_a_later_message_of_its_burst_still_in_transit(
    store: InMemoryWindows,
) -> None:
    """The pause counts from receipt, so a window filed behind a backlog is due at once; a
    message of its burst received after its last one (before it fell due) is still on its
    way and would be answered by a second reply if the window went without it."""
    c = coalescer(store)
    a = store.receive(text="a")
    store.advance(0.1)
    b = store.receive(text="b")
    store.advance(30)  # the backlog: both wait 30 s to be filed
    await c.file(a)
    assert await c.emit_due() == 0, "b belongs to the burst and is on its way"
    await c.file(b)
    assert await c.emit_due() == 1
    assert [[m.text for m in j.messages] for j in store.state.outbox] == [["a", "b"]]


async def test_a_message_in_transit_received_after_the_window_fell_due_does_not_hold_it(
    store: InMemoryWindows,
) -> None:
    c = coalescer(store)
    await c.file(store.receive(text="a"))
    store.advance(6)  # due after 5 s
    store.receive(text="b")  # the next burst, not yet filed
    assert await c.emit_due() == 1
    assert [m.text for m in store.state.outbox[0].messages] == ["a"]


async def test_a_window_past_the_cap_is_answered_in_parts_and_the_rest_waits_for_the_first_job(
    store: InMemoryWindows,
) -> None:
    c = coalescer(store, JobCaps(messages=2, chars=10_000))
    messages = [store.receive(text=t) for t in "abc"]
    for m in messages:
        await c.file(m)
    store.advance(8)
    assert await c.emit_due() == 1
    (first,) = store.state.outbox
    assert [m.text for m in first.messages] == ["a", "b"]
    rest = store.open_window(messages[0].chat_key)
    assert rest is not None and rest.blocked and rest.window.message_count == 1
    store.end_job(first.job_id)
    assert await c.emit_due() == 1
    assert [m.text for m in store.state.outbox[1].messages] == ["c"]


async def test_a_window_left_empty_closes_without_a_job(store: InMemoryWindows) -> None:
    c = coalescer(store)
    m = store.receive()
    filed = await c.file(m)
    assert filed
    del store.state.filed[m.operation_id]  # its message went to a reply's fold-in
    store.advance(5)
    assert await c.emit_due() == 1
    assert store.state.outbox == [] and filed.window_id not in store.state.windows


async def test_a_window_whose_rows_are_refused_is_set_aside_alone_and_the_other_chats_get_replies(
    store: InMemoryWindows,
) -> None:
    c = coalescer(store)
    bad, good = store.receive(chat_id="bad"), store.receive(chat_id="good")
    await c.file(bad)
    await c.file(good)
    store.refuse.add(bad.chat_key)
    store.advance(5)
    assert await c.emit_due() == 2
    assert [j.chat_key for j in store.state.outbox] == [good.chat_key]
    failed = store.operation(bad)
    assert failed.status == OperationStatus.FAILED and failed.owner == "on-call"
    assert failed.reason and "could not be emitted" in failed.reason
    assert store.open_window(bad.chat_key) is None
    assert store.operation(good).status == OperationStatus.WAITING and store.operation(good).job_id


async def test_a_message_filed_while_the_seller_holds_the_chat_is_recorded_as_held_and_waits(
    store: InMemoryWindows,
) -> None:
    c = coalescer(store)
    m = store.receive()
    store.held.add(m.chat_key)
    await c.file(m)
    store.advance(60)
    assert await c.emit_due() == 0
    assert store.events(m) == ["held"]


async def test_giving_up_fails_an_unfiled_message_and_leaves_a_filed_one_to_its_reply(
    store: InMemoryWindows,
) -> None:
    c = coalescer(store)
    unfiled, filed = store.receive(), store.receive(chat_id="c2")
    await c.file(filed)
    for m in (unfiled, filed):
        await c.give_up(Delivery(m), "exhausted", "the database refused it")
    assert store.operation(unfiled).status == OperationStatus.FAILED
    assert store.operation(filed).status == OperationStatus.WAITING


async def test_a_failed_transaction_leaves_nothing_behind(store: InMemoryWindows) -> None:
    m = store.receive()
    with pytest.raises(RuntimeError):
        async with store.transaction() as tx:
            (chat,) = await tx.lock_chats([(m.chat_key, m.operation_id)])
            assert chat.window is None
            await tx.file([Filing(uuid.uuid4(), m, open_window(chat.now, POLICY, lambda: 0.0), opened=True)])
            raise RuntimeError("the connection broke")
    assert await store.open_windows() == 0
    assert store.operation(m).status == OperationStatus.QUEUED


class Delivery:
    """What the consumer's give-up hook reads of a delivery."""

    def __init__(self, m: InboundMessage) -> None:
        self.message_id = str(m.operation_id)


async def test_an_account_at_its_fair_share_waits_while_another_accounts_window_goes_out(
    store: InMemoryWindows,
) -> None:
    c = Coalescer(store, POLICY, draw=lambda: 0.0, account_jobs=1)
    first, second = store.receive(chat_id="a1"), store.receive(chat_id="a2")
    other = store.receive(chat_id="b1", account_id="shop")
    for m in (first, second, other):
        await c.file(m)
    store.advance(5)
    await c.emit_due()
    assert sorted(j.chat_key for j in store.state.outbox) == sorted([first.chat_key, other.chat_key])
    store.end_job(next(j.job_id for j in store.state.outbox if j.chat_key == first.chat_key))
    await c.emit_due()
    assert store.state.outbox[-1].chat_key == second.chat_key


async def test_a_message_filed_late_counts_its_pause_from_receipt_yet_waits_quiet_seconds_after_filing(
    store: InMemoryWindows,
) -> None:
    m = store.receive()
    store.advance(4)  # behind a backlog in the inbound queue
    filed = await coalescer(store).file(m)
    assert filed is not None
    # From receipt the reply is due at 5 s; the buyer's next messages get QUIET (2 s) more.
    assert filed.due_at == store.clock + timedelta(seconds=2)


async def test_an_account_is_not_alone_while_another_accounts_due_window_waits_for_a_message_in_transit(
    store: InMemoryWindows,
) -> None:
    """As the claim in Postgres (_CLAIM_DUE: ready_accounts before the in-transit check):
    another account's window that is due counts, even while it waits for an earlier
    message of its chat still on its way; the first account keeps its share, not the
    larger share of an account alone (tests/integration/test_scheduler_cost.py)."""
    c = Coalescer(store, POLICY, draw=lambda: 0.0, account_jobs=1, alone_jobs=3)
    for n in range(3):
        await c.file(store.receive(chat_id=f"a{n}"))
    store.receive(chat_id="s1", account_id="shop", text="in transit")
    store.advance(0.1)
    await c.file(store.receive(chat_id="s1", account_id="shop", text="filed"))
    store.advance(5)
    assert await c.emit_due() == 1, "the shop's due window counts: the bot keeps its share of 1"


async def test_a_window_waiting_for_a_message_in_transit_takes_a_place_of_its_accounts_share(
    store: InMemoryWindows,
) -> None:
    """As the claim in Postgres: an account's due windows take its places in due order,
    and only then is the in-transit check made (on the few placed); a window that waits
    for a message of its chat on its way holds its place, and the window behind it waits
    for the next round rather than overtaking the share."""
    c = Coalescer(store, POLICY, draw=lambda: 0.0, account_jobs=1)
    store.receive(chat_id="c1", text="in transit")
    store.advance(0.1)
    await c.file(store.receive(chat_id="c1", text="filed"))
    store.advance(0.1)
    await c.file(store.receive(chat_id="c2"))
    store.advance(5)
    assert await c.emit_due() == 0
