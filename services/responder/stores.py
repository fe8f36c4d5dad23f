"""What the responder needs from its state, as Protocols: ``JobStorage`` (the store) and
``JobSession`` (one job held for its handling). ``idempotency.JobStore`` and
``idempotency.PgJobSession`` are the Postgres implementations, proven by the integration
tests; ``tests/fakes/jobs.py`` is an in-memory one under the same transition tables
(shared/state), on which the handler's branches run as unit tests in milliseconds."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from datetime import datetime
from typing import Protocol

from platforms.base import Attempts
from services.responder.idempotency import Job, Part, Reconcile, Settled, Skip
from shared.messages import Row
from shared.state.job import DeliveryStatus

__all__ = ["JobSession", "JobStorage", "Row"]


class JobSession(Protocol):
    """A job's state changes while this handler holds it (its lock)."""

    async def claim(self, job_id: uuid.UUID, attempt: int) -> Job | Skip | Reconcile:
        """Decide before any side effect: raises JobBusy (another handler holds it) or
        Reject (no such job); Skip (final, withdrawn, superseded); Reconcile (a send may
        have happened); else the job, processing, with the messages it keeps."""
        ...

    async def before_send(self, job: Job, text: str, attempt: int, *, fold: bool = True) -> Job:
        """The grown job when messages were folded in (write again); else the delivery
        intent is recorded and the same job returned. Raises JobWithdrawn."""
        ...

    async def record_sent(self, job: Job, text: str, platform_message_id: str) -> datetime: ...

    async def recorded_message_ids(self, job: Job, limit: int = 200) -> list[str]: ...

    async def part_intent(self, job_id: uuid.UUID, number: int, text: str) -> None: ...

    async def part_done(
        self, job_id: uuid.UUID, number: int, status: DeliveryStatus, message_id: str | None = None
    ) -> None: ...

    async def delivery_parts(self, job_id: uuid.UUID) -> dict[int, Part]: ...

    async def unknown_rivals(self, job: Job) -> list[Attempts]: ...

    async def record_delivery(self, job_id: uuid.UUID, status: DeliveryStatus, error: str) -> None: ...

    async def record_retry(self, job_id: uuid.UUID, kind: str, reason: str) -> None: ...

    async def give_up(self, job_id: uuid.UUID, kind: str, reason: str, owner: str) -> Settled: ...

    async def record_cut(self, job_id: uuid.UUID, detail: str) -> None:
        """On the record of each of the job's messages: what of the chat the model was not
        given (``llm.bound_prompt``)."""
        ...


class JobStorage(Protocol):
    """Where jobs are held and settled from outside a handling (the consumer's hooks,
    the account probe)."""

    def exclusive(self, job_id: uuid.UUID) -> AbstractAsyncContextManager[JobSession]: ...

    async def give_up(self, job_id: uuid.UUID, kind: str, reason: str, owner: str) -> Settled: ...

    async def retry_scheduled(self, job_id: uuid.UUID, attempt: int, delay: float) -> None: ...

    async def pause_account(self, platform: str, account_id: str, reason: str, probe_in: float) -> bool: ...

    async def resume_account(self, platform: str, account_id: str) -> bool: ...

    async def probe_later(self, platform: str, account_id: str, reason: str, probe_in: float) -> None: ...

    def accounts_to_probe(self, platforms: list[str]) -> AbstractAsyncContextManager[Sequence[Row]]: ...
