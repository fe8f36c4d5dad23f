"""A person's commands on operations the pipeline handed over (failed, needs_review):
retry and resolve, decided here and written through an ``OperationStore`` (stores.py), so
each branch runs as a unit test on the in-memory store and against Postgres alike."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Literal

from platforms.inbound import ApiError
from shared.state import operation as operation_state
from shared.state.operation import OperationStatus
from stores.operations.protocol import Closing, Locked, OperationSession, OperationStore

Resolution = Literal["replied_manually", "dismissed"]


@dataclass(frozen=True)
class Retried:
    operation_id: uuid.UUID
    retried: list[uuid.UUID]
    #: A needs_review operation sent again on the person's confirmation.
    resend: bool


@dataclass(frozen=True)
class Resolved:
    operation_id: uuid.UUID
    status: OperationStatus
    resolved: list[uuid.UUID]


async def retry(store: OperationStore, op_id: uuid.UUID, *, resend: bool, by: str, note: str) -> Retried:
    """Put a failed operation (with the rest of its reply job) back to work through the
    outbox. A needs_review operation's reply may already be in the chat: it is put back
    only with ``resend``, the person's confirmation that sending again is right, and that
    confirmation is recorded. A message a sent reply already covers is never answered
    again."""
    async with store.transaction() as tx:
        row = await _lock_actionable(tx, op_id, "not_retryable", "retried")
        if row.chat_id is None or row.nameless:
            raise ApiError(
                409,
                "not_answerable_by_the_bot",
                "the platform sent this message without its chat or its id: the bot cannot answer it safely "
                "(a copy of it may be answered already); answer it in the platform's app, then resolve it",
            )
        # A reply of a needs_review job may be in the chat; one handed to a person as it
        # was stored (a voice note the bot cannot listen to) has none.
        confirmed = row.status == OperationStatus.NEEDS_REVIEW and row.job_id is not None
        if confirmed and not resend:
            raise ApiError(
                409,
                "resend_not_confirmed",
                "the reply to this message may already be in the chat (the send's outcome is unknown): "
                "check the chat, then resolve it, or retry with resend=true to send a reply again",
            )
        await tx.lock_chat(row.chat_key)
        # The rest of its reply job goes back with it: the job's messages in the same state
        # and still the job's own (a message listed on the job but settled by another, say
        # needs_review elsewhere, is not this person's decision).
        siblings = await tx.siblings(row.job_operation_ids or [op_id], row.status, op_id, row.job_id)
        messages = await tx.retry(siblings)
        ids = [m.operation_id for m in messages]
        if row.job_id is not None and confirmed:
            await tx.supersede_for_resend(row.job_id, by)
        await tx.record(
            ids,
            "retried",
            actor=by,
            detail=("re-send confirmed" if confirmed else "retried")
            + f" by {by}"
            + (f": {note}" if note else ""),
            job_id=row.job_id,
        )
        await tx.publish(messages)
    return Retried(op_id, ids, resend=confirmed)


async def resolve(
    store: OperationStore, op_id: uuid.UUID, resolution: Resolution, *, owner: str, note: str
) -> Resolved:
    """A person closes a failed or needs_review operation (and the rest of its job):
    replied manually, or dismissed."""
    manually = resolution == "replied_manually"
    status = OperationStatus.REPLIED if manually else OperationStatus.IGNORED
    reason = (
        ("replied manually" if manually else "dismissed") + f" by {owner}" + (f": {note}" if note else "")
    )
    async with store.transaction() as tx:
        row = await _lock_actionable(tx, op_id, "not_resolvable", "resolved")
        closing = Closing(status, reason, resolution, owner, note or None)
        resolved = await tx.resolve(row.job_operation_ids or [op_id], closing)
        await tx.record(resolved, "resolved", actor=owner, detail=reason, job_id=row.job_id)
        if manually and row.job_id is not None and row.job_chat_key is not None and resolved:
            # A person answered: the chat's history must know.
            await tx.mark_answered(row.job_chat_key, resolved, row.job_id)
    return Resolved(op_id, status, resolved)


async def _lock_actionable(tx: OperationSession, op_id: uuid.UUID, code: str, verb: str) -> Locked:
    """Lock a failed or needs_review operation (404 if missing, 409 if in another state)."""
    row = await tx.lock(op_id)
    if row is None:
        raise ApiError(404, "operation_not_found", f"no operation {op_id}")
    if row.status not in operation_state.ACTIONABLE:
        raise ApiError(
            409,
            code,
            f"only failed or needs_review operations can be {verb}; this one is {row.shown or row.status}",
        )
    return row
