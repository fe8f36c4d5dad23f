"""AmqpDelivery, the consumer's view of an aiormq delivery: what a handler reads of it, and
that it is settled at most once."""

from __future__ import annotations

from typing import Any

import pytest
from aiormq.abc import DeliveredMessage
from pamqp import commands as spec
from pamqp.header import ContentHeader

from shared.broker.delivery import AlreadySettled, AmqpDelivery


class Channel:
    """Records the settlements sent on it."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, int, Any]] = []

    async def basic_ack(self, tag: int, multiple: bool = False) -> None:
        self.sent.append(("ack", tag, multiple))

    async def basic_nack(self, tag: int, requeue: bool = True) -> None:
        self.sent.append(("nack", tag, requeue))

    async def basic_reject(self, tag: int, requeue: bool = False) -> None:
        self.sent.append(("reject", tag, requeue))


def delivery(channel: Channel, *, message_id: str | None = "m-1", headers: Any = None) -> AmqpDelivery:
    return AmqpDelivery(
        DeliveredMessage(
            delivery=spec.Basic.Deliver(consumer_tag="c", delivery_tag=7, routing_key="q"),
            header=ContentHeader(properties=spec.Basic.Properties(message_id=message_id, headers=headers)),
            body=b'{"a": 1}',
            channel=channel,  # type: ignore[arg-type]
        )
    )


def test_a_delivery_reads_its_body_id_tag_and_headers() -> None:
    d = delivery(Channel(), headers={"chatq-attempt": 2, "x-delivery-count": 1})
    assert (d.body, d.message_id, d.delivery_tag) == (b'{"a": 1}', "m-1", 7)
    assert d.headers == {"chatq-attempt": 2, "x-delivery-count": 1}


def test_a_delivery_without_headers_or_id_reads_none_of_either() -> None:
    assert delivery(Channel(), message_id=None).headers == {}
    assert delivery(Channel(), message_id="").message_id is None  # as aio-pika read it


@pytest.mark.parametrize("first", ["ack", "nack", "reject"])
@pytest.mark.parametrize("second", ["ack", "nack", "reject"])
async def test_a_delivery_is_settled_once_and_a_second_settlement_is_refused_unsent(
    first: str, second: str
) -> None:
    channel = Channel()
    d = delivery(channel)
    await getattr(d, first)()
    with pytest.raises(AlreadySettled):
        await getattr(d, second)()
    assert [s[0] for s in channel.sent] == [first]
    assert channel.sent[0][1] == 7


async def test_an_ack_with_multiple_is_sent_as_one() -> None:
    channel = Channel()
    await delivery(channel).ack(multiple=True)
    assert channel.sent == [("ack", 7, True)]
