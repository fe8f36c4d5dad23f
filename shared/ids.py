"""Identifiers of the rows the services create: time-ordered UUIDs (RFC 9562, version 7).

Every message, window and job is written at the end of its table's primary key and of each
index that holds the id (reply_coverage, window_messages, operation_events by operation),
instead of at a random page as a random (version 4) UUID lands: an insert dirties the
pages the last inserts dirtied, so fewer pages are written to the WAL in full after a
checkpoint and fewer are read back once a table outgrows memory. The ids stay opaque and
unique; nothing orders rows by them (events order by their own sequence, messages by
chatq_order).
"""

from __future__ import annotations

import uuid

import uuid6


def new_id() -> uuid.UUID:
    """A new UUIDv7: 48 bits of Unix milliseconds, then random bits (monotonic within this
    process)."""
    return uuid.UUID(int=uuid6.uuid7().int)


def derived_id(base: uuid.UUID, namespace: uuid.UUID) -> uuid.UUID:
    """An id made from ``base`` that is the same every time (a job's from its window's):
    ``base``'s first 8 bytes (its time, when it is a UUIDv7, so the derived ids keep their
    order too) and 8 bytes of the name-based UUID of ``base`` in ``namespace``, with the
    version and variant bits of a UUIDv8 (RFC 9562: custom layout)."""
    hashed = uuid.uuid5(namespace, str(base)).bytes
    raw = bytearray(base.bytes[:8] + hashed[8:])
    raw[6] = (raw[6] & 0x0F) | 0x80  # version 8
    raw[8] = (raw[8] & 0x3F) | 0x80  # RFC 9562 variant
    return uuid.UUID(bytes=bytes(raw))
