import uuid

from hypothesis import given
from hypothesis import strategies as st

from shared.ids import derived_id, new_id

NS = uuid.UUID("6f1d3c2e-8a43-4e0b-9f55-3c1a2b7d9e10")


def test_new_ids_are_version_7_and_each_sorts_after_the_one_made_before_it() -> None:
    ids = [new_id() for _ in range(5000)]
    assert all(i.version == 7 and i.variant == uuid.RFC_4122 for i in ids)
    assert ids == sorted(ids)
    assert len(set(ids)) == len(ids)


def test_a_derived_id_is_the_same_every_time_and_differs_from_its_base() -> None:
    base = new_id()
    assert derived_id(base, NS) == derived_id(base, NS)
    assert derived_id(base, NS) != base
    assert derived_id(base, NS) != derived_id(base, uuid.UUID(int=NS.int ^ 1))


def test_derived_ids_keep_the_order_of_their_bases_time() -> None:
    bases = [new_id() for _ in range(2000)]
    derived = [derived_id(b, NS) for b in bases]
    # Ordered by the millisecond (and sub-millisecond counter) their bases carry.
    assert [d.bytes[:6] for d in derived] == [b.bytes[:6] for b in bases]
    assert sorted(derived, key=lambda d: d.bytes[:6]) == derived


@given(st.uuids())
def test_a_derived_id_is_a_valid_version_8_uuid_whatever_its_base(base: uuid.UUID) -> None:
    d = derived_id(base, NS)
    assert d.version == 8 and d.variant == uuid.RFC_4122
    assert d.bytes[:6] == base.bytes[:6]


def test_two_bases_sharing_their_first_eight_bytes_derive_different_ids() -> None:
    a = uuid.UUID("01a22eaf-273a-7e97-8000-000000000001")
    b = uuid.UUID("01a22eaf-273a-7e97-8000-000000000002")
    assert derived_id(a, NS) != derived_id(b, NS)
