"""The responder's handler: one reply job in, at most one reply out.

Order of work for a job (each step's state is committed before the next side effect):
claim (skip / reconcile / supersede / processing) -> generate -> fold in messages that
arrived meanwhile and regenerate (bounded) -> record the intent (delivery 'sending') ->
send -> record the result with the job, its operations and the chat's last answered
message in one transaction. The handler signals outcomes by raising (RetryLater,
Reject); the consumer wrapper acks.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta

from prometheus_client import Counter
from pydantic import ValidationError

from platforms.accounts import AccountPlatforms, FixedPlatforms, Incomplete, Unserved
from platforms.base import Listing, Platform, Sent, SentQuery, TooEarly, chat_manners
from platforms.failures import Failure, Kind
from platforms.telegram.adapter import TelegramPlatform
from services.responder.connections import BusinessConnections
from services.responder.echoes import CLOCK_SKEW_SECONDS, Echoes
from services.responder.listings import Listings
from services.responder.llm import ReplyWriter, Writing
from services.responder.parts import split_reply
from services.responder.reply_check import ReplyCheck
from services.responder.writers import AccountWriters
from shared import metrics
from shared.alerts import Alerter
from shared.broker.consumer import Reject, RetryLater
from shared.broker.delivery import Delivery
from shared.faults import fault_point
from shared.messages import ReplyJob
from shared.retry import attempt_of
from shared.settings import DEFAULT_GREETING
from shared.state.job import DeliveryStatus
from stores.jobs.protocol import (
    AccountStopped,
    Attempts,
    Job,
    JobBusy,
    JobSession,
    JobStorage,
    JobWithdrawn,
    Part,
    Reconcile,
    Skip,
    Turn,
)

logger = logging.getLogger(__name__)

CHAT_READ_FAILURES = Counter(
    "chatq_chat_read_failures_total",
    "Chats that could not be marked read after a reply was sent (the reply stands), by platform.",
    ["platform"],
)
ACCOUNTS_PAUSED = Counter(
    "chatq_accounts_paused_total",
    "Platform accounts paused because the platform refused them, by platform.",
    ["platform"],
)


class Held(Exception):
    """The written reply must not be sent (``reply_check``): a person reads why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def is_command(text: str) -> bool:
    """A Telegram bot command: a message that begins with one (/start, /help@shop_bot).
    Telegram marks it with a ``bot_command`` entity at offset 0, which it gives only to
    text that begins with "/"."""
    return text.startswith("/")


def for_the_writer(job: Job) -> tuple[list[Turn], list[str]]:
    """The chat's history and the job's messages, as the reply writer sees them. Telegram
    bot commands (/start) are not questions: they are left out, and a job with nothing
    else gets the greeting instead of a written reply."""
    history, batch = list(job.history), [m.text for m in job.messages]
    if job.platform == "telegram":
        history = [t for t in history if t.role != "buyer" or not is_command(t.text)]
        batch = [text for text in batch if not is_command(text)]
    return history, batch


class Responder:
    def __init__(
        self,
        store: JobStorage,
        platforms: Mapping[str, Platform] | AccountPlatforms | FixedPlatforms,
        writer: ReplyWriter | AccountWriters,
        alerter: Alerter,
        *,
        fold_max_rounds: int = 2,
        review_owner: str = "on-call",
        account_probe_seconds: float = 60.0,
        greeting: str = DEFAULT_GREETING,
        account_metrics: bool = False,
        listings: Listings | None = None,
        connections: BusinessConnections | None = None,
        echoes: Echoes | None = None,
        echo_wait_seconds: float = 30.0,
        reply_check: ReplyCheck | None = None,
    ) -> None:
        self._account_metrics = account_metrics
        self._check = reply_check
        self._store = store
        # Each account's own adapter and writer (platforms/accounts.py, services/responder/writers.py); a plain
        # mapping or writer serves every account alike.
        self._platforms = FixedPlatforms(platforms) if isinstance(platforms, Mapping) else platforms
        self._writers = writer if isinstance(writer, AccountWriters) else None
        self._writer: ReplyWriter = writer.default if isinstance(writer, AccountWriters) else writer
        self._alerter = alerter
        self._fold_max_rounds = fold_max_rounds
        self._owner = review_owner
        self._probe_seconds = account_probe_seconds
        self._greeting = greeting
        self._listings = listings
        self._connections = connections
        self._echoes = echoes
        self._echo_wait = echo_wait_seconds
        #: Jobs refused for their account (or connection) as a whole, and how often: a job
        #: refused again once its account was paused is refused for itself (a 403 about
        #: one chat on a generic endpoint), not for its account, and fails alone instead
        #: of pausing the account again and again. Bounded: the oldest are forgotten.
        self._refused: dict[uuid.UUID, int] = {}

    async def handle(self, message: Delivery) -> None:
        try:
            wire = ReplyJob.from_bytes(message.body)
        except ValidationError as exc:
            raise Reject(f"not a chatq.job.v1 message: {exc.error_count()} error(s)") from None
        attempt = attempt_of(message.headers)
        try:
            async with self._store.exclusive(wire.job_id) as db:
                await self._handle(db, wire.job_id, attempt)
        except JobBusy as busy:
            # Another copy is being handled now; its holder decides the outcome. Waiting
            # for it is not an attempt of this job.
            raise RetryLater(str(busy), kind="busy", counts=False) from None

    async def _handle(self, db: JobSession, job_id: uuid.UUID, attempt: int) -> None:
        try:
            await self._handle_claimed(db, job_id, attempt)
        except JobWithdrawn as withdrawn:
            logger.info("%s", withdrawn)

    async def _handle_claimed(self, db: JobSession, job_id: uuid.UUID, attempt: int) -> None:
        state = await db.claim(job_id, attempt)
        if isinstance(state, Skip):
            logger.info(
                "job %s skipped: %s", job_id, state.reason, extra={"job_id": job_id, "attempt": attempt}
            )
            return
        job = state.job if isinstance(state, Reconcile) else state
        await self._platforms.learn(job.platform, job.account_id)
        try:
            platform = self._platforms.for_account(job.platform, job.account_id)
        except Unserved as unserved:
            if isinstance(unserved, Incomplete) and job.account_paused is not None:
                # Paused until a person gives the account what it lacks: wait, like any pause.
                await self._wait_for_account(db, job, job.account_paused)
            await self._give_up(db, job.job_id, "permanent", str(unserved))
            raise Reject(str(unserved)) from None
        if platform is None:
            await self._give_up(db, job.job_id, "permanent", f"{job.platform} replies are not configured")
            raise Reject(f"{job.platform} replies are not configured in this responder")
        if job.account_paused is not None:
            await self._wait_for_account(db, job, job.account_paused)
        if job.business_connection_id is not None and self._connections is not None:
            why, removed = await self._connections.paused(job.account_id, job.business_connection_id)
            if removed:
                # Telegram no longer knows the connection: nothing will ever send this reply.
                reason = f"{why}: answer the customer in Telegram"
                await self._give_up(db, job.job_id, "permanent", reason)
                raise Reject(reason)
            if why is not None:
                await self._wait_for_connection(db, job, why)
        try:
            if isinstance(state, Reconcile):
                await self._reconcile(db, state, platform, attempt)
            else:
                await self._reply(db, job, platform, attempt)
        except AccountStopped as stopped:
            # Paused or removed while the reply was written: nothing was sent.
            if stopped.removed:
                await self._give_up(db, job.job_id, "permanent", stopped.reason)
                raise Reject(stopped.reason) from None
            await self._wait_for_account(db, job, stopped.reason)

    async def _reply(
        self,
        db: JobSession,
        job: Job,
        platform: Platform,
        attempt: int,
        text: str | None = None,
        sent_parts: dict[int, str] | None = None,
    ) -> None:
        """Write the reply (or resume ``text``, already committed to), record the intent and
        send it: one request, or parts in order when it is longer than the platform takes,
        each part's intent and outcome recorded so a part already sent is never sent again
        (``sent_parts``: number -> platform id, from an earlier attempt)."""
        if text is None:
            try:
                job, text = await self._generate(db, job, platform, attempt)
            except Failure as failure:
                await self._failed(db, job, failure, stage="model")
                return
            except Held as held:
                # Nothing was sent, nor its intent recorded: a person reads why.
                await self._give_up(db, job.job_id, "review", held.reason)
                raise Reject(held.reason) from None
        else:
            await db.before_send(job, text, attempt, fold=False)
        parts = split_reply(text, platform.max_text)
        many = len(parts) > 1
        done = dict(sent_parts or {})
        last = ""
        for number, part in enumerate(parts, start=1):
            if number in done:
                last = done[number]
                continue
            if many:
                await db.part_intent(job.job_id, number, part)
            started = datetime.now(UTC)
            try:
                sent = await platform.send(
                    job.account_id,
                    job.chat_id,
                    part,
                    key=f"{job.job_id}:{number}" if many else str(job.job_id),
                    business_connection_id=job.business_connection_id,
                )
            except Failure as failure:
                echoed = await self._echo(db, job, part, started) if failure.kind is Kind.UNKNOWN else None
                if echoed is None:
                    if many:
                        lost = (
                            DeliveryStatus.UNKNOWN
                            if failure.kind is Kind.UNKNOWN
                            else DeliveryStatus.NOT_SENT
                        )
                        await db.part_done(job.job_id, number, lost)
                    await self._send_failed(db, job, platform, failure)
                    return
                sent = echoed
            last = sent.message_id
            if many:
                await db.part_done(job.job_id, number, DeliveryStatus.SENT, last)
                if number < len(parts):
                    fault_point("responder.between_parts")
        fault_point("responder.after_send")
        await db.record_sent(job, text, last)
        fault_point("responder.after_record")
        if self._account_metrics:
            metrics.ACCOUNT_REPLIES.labels(platform=job.platform, account=job.account_id).inc()
        await self._mark_read(job, platform)
        logger.info(
            "job %s replied in %s with %d message(s) in %d part(s) (attempt %d)",
            job.job_id,
            job.chat_key,
            len(job.messages),
            len(parts),
            attempt,
            extra={"job_id": job.job_id, "chat": job.chat_key, "attempt": attempt},
        )

    async def _generate(self, db: JobSession, job: Job, platform: Platform, attempt: int) -> tuple[Job, str]:
        """Write the reply; fold in messages that arrived meanwhile and write again (at most
        fold_max_rounds times); return with the delivery intent recorded."""
        listing = await self._listing(job)
        text = await self._write(db, job, listing)
        fault_point("responder.after_generate")
        for round_ in range(self._fold_max_rounds + 1):
            folded = await db.before_send(job, text, attempt, fold=round_ < self._fold_max_rounds)
            if folded is job:
                break
            logger.info(
                "job %s: folded %d new message(s) in; regenerating",
                job.job_id,
                len(folded.messages) - len(job.messages),
                extra={"job_id": job.job_id, "chat": job.chat_key, "attempt": attempt},
            )
            job = folded
            text = await self._write(db, job, listing)
        return job, text

    async def _listing(self, job: Job) -> Listing | None:
        """The listing the chat is about, for the writer (best effort: None without)."""
        if self._listings is None:
            return None
        return await self._listings.of(job.platform, job.account_id, job.chat_id, job.chat_key)

    async def _write(self, db: JobSession, job: Job, listing: Listing | None) -> str:
        """The reply's text: the greeting for a job of bot commands only, without a model
        call; else the writer's. Either way the reply takes the same path to the chat (a
        reply longer than the platform takes goes out in parts). What the writer cut from
        the prompt goes on the job's record; the tokens it spent count for the account."""
        history, batch = for_the_writer(job)
        if not batch:
            return self._greeting
        writer = self._writers.for_account(job.platform, job.account_id) if self._writers else self._writer
        writing = Writing()
        try:
            text = await writer.write(history, batch, listing, writing)
            if self._check is not None:
                why = self._check.why_held(job.platform, job.account_id, writer.instructions(), text)
                if why is not None:
                    raise Held(why)
            return text
        finally:
            account = job.account_id if self._account_metrics else ""
            for kind, tokens in (
                ("prompt", writing.prompt_tokens),
                ("completion", writing.completion_tokens),
            ):
                if tokens:
                    metrics.LLM_TOKENS.labels(platform=job.platform, account=account, kind=kind).inc(tokens)
            if writing.cuts:
                await db.record_cut(
                    job.job_id, "the model was given less of the chat: " + "; ".join(writing.cuts)
                )

    async def _mark_read(self, job: Job, platform: Platform) -> None:
        """Mark the answered chat read in the seller's app (Avito), best effort: the reply
        is sent and recorded, and a failure here changes nothing about it."""
        manners = chat_manners(platform)
        if manners is None:
            return
        try:
            await manners.mark_read(job.account_id, job.chat_id)
        except Exception as exc:
            CHAT_READ_FAILURES.labels(platform=platform.name).inc()
            reason = exc.reason if isinstance(exc, Failure) else f"{type(exc).__name__}: {exc}"
            logger.warning(
                "job %s: replied, but %s was not marked read: %s",
                job.job_id,
                job.chat_key,
                reason,
                extra={"job_id": job.job_id, "chat": job.chat_key},
            )

    async def _failed(self, db: JobSession, job: Job, failure: Failure, *, stage: str) -> None:
        """A failure that left nothing on the platform: retry later, or give up for good."""
        reason = f"{stage}: {failure.reason}"
        if failure.kind is Kind.PERMANENT:
            await self._give_up(db, job.job_id, "permanent", reason)
            raise Reject(reason)
        await db.record_retry(job.job_id, "transient", reason)
        raise RetryLater(reason, kind=f"{stage}_{failure.kind}", retry_after=failure.retry_after)

    async def _echo(self, db: JobSession, job: Job, text: str, started: datetime) -> Sent | None:
        """The platform's echo of ``text`` sent since ``started`` (a send whose answer was
        lost: the echo shows it went out), or None."""
        if self._echoes is None:
            return None
        found = await self._echoes.of(
            job.chat_key,
            text,
            started - timedelta(seconds=CLOCK_SKEW_SECONDS),
            await db.recorded_message_ids(job),
        )
        if found is None:
            return None
        metrics.SETTLED_BY_ECHO.labels(platform=job.platform).inc()
        logger.info(
            "job %s: the send's answer was lost, but the platform echoed the reply (%s): it is in the chat",
            job.job_id,
            found,
            extra={"job_id": job.job_id, "chat": job.chat_key},
        )
        return Sent(found)

    async def _send_failed(self, db: JobSession, job: Job, platform: Platform, failure: Failure) -> None:
        if failure.kind is Kind.CONNECTION and job.business_connection_id is not None and self._connections:
            await db.record_delivery(job.job_id, DeliveryStatus.NOT_SENT, failure.reason)
            await self._connection_refused(db, job, failure.reason)
        if failure.kind is Kind.ACCOUNT:
            await db.record_delivery(job.job_id, DeliveryStatus.NOT_SENT, failure.reason)
            await self._account_refused(db, job, failure)
        if failure.kind is not Kind.UNKNOWN:
            await db.record_delivery(job.job_id, DeliveryStatus.NOT_SENT, failure.reason)
            await self._failed(db, job, failure, stage=platform.name)
            return
        await db.record_delivery(job.job_id, DeliveryStatus.UNKNOWN, failure.reason)
        if platform.idempotent or platform.can_reconcile:
            # Generic: re-sending with the same Idempotency-Key is safe. Avito: the next
            # attempt lists the chat for our reply before sending anything.
            await db.record_retry(job.job_id, "unknown", f"{platform.name}: {failure.reason}")
            raise RetryLater(f"{platform.name}: {failure.reason}", kind="unknown_outcome")
        if self._echo_may_come(job) and self._echo_wait > 0:
            # Telegram Business echoes our replies back: the next attempt looks for the echo
            # (``_reconcile``) before a person is asked.
            await self._wait_for_echo(db, job, f"{platform.name}: {failure.reason}", self._echo_wait)
        # Telegram: nothing can tell whether it went out. The delivery says unknown, so
        # giving up hands the job to a person (needs_review), never to "failed".
        await self._give_up(db, job.job_id, "unknown", f"{platform.name}: {failure.reason}")

    def _echo_may_come(self, job: Job) -> bool:
        """Whether the platform echoes this chat's replies back (Avito does in every chat;
        Telegram only in a business account's chats, by the business_message of our bot)."""
        return self._echoes is not None and (
            job.platform == "avito" or job.business_connection_id is not None
        )

    async def _wait_for_echo(self, db: JobSession, job: Job, reason: str, seconds: float) -> None:
        why = f"{reason}; waiting {seconds:.0f}s for the platform's echo of the reply before asking a person"
        await db.record_retry(job.job_id, "unknown", why)
        raise RetryLater(why, kind="echo_wait", retry_after=seconds, counts=False)

    async def _reconcile(self, db: JobSession, state: Reconcile, platform: Platform, attempt: int) -> None:
        job = state.job
        parts = await db.delivery_parts(job.job_id)
        if parts:
            await self._resume_parts(db, state, platform, attempt, parts)
            return
        echoed = await self._echo(db, job, state.text, state.since)
        if echoed is not None:
            await db.record_sent(job, state.text, echoed.message_id)
            await self._mark_read(job, platform)
            return
        if platform.idempotent:
            logger.info(
                "job %s: outcome unknown; re-sending with the same idempotency key",
                job.job_id,
                extra={"job_id": job.job_id, "attempt": attempt},
            )
            await self._reply(db, job, platform, attempt, text=state.text)
            return
        if platform.can_reconcile:
            found = await self._find(
                db,
                job,
                platform,
                key=str(job.job_id),
                attempts=Attempts(state.text, state.since, state.started_at),
            )
            if found is not None:
                logger.info(
                    "job %s: reconciled, our reply %s is in the chat",
                    job.job_id,
                    found.message_id,
                    extra={"job_id": job.job_id, "attempt": attempt},
                )
                await db.record_sent(job, state.text, found.message_id)
                await self._mark_read(job, platform)
                return
            logger.info(
                "job %s: our reply is not in the chat; sending it",
                job.job_id,
                extra={"job_id": job.job_id, "attempt": attempt},
            )
            await self._reply(db, job, platform, attempt, text=state.text)
            return
        if self._echo_may_come(job):
            waited = (datetime.now(UTC) - state.started_at).total_seconds()
            if waited < self._echo_wait:
                await self._wait_for_echo(
                    db, job, f"{platform.name}: a send was interrupted", self._echo_wait - waited
                )
        await self._give_up(
            db,
            job.job_id,
            "unknown",
            f"{platform.name} cannot tell whether the reply went out (a send was interrupted)",
        )

    async def _resume_parts(
        self, db: JobSession, state: Reconcile, platform: Platform, attempt: int, parts: dict[int, Part]
    ) -> None:
        """A long reply was cut short (a crash, a failure between parts). Parts recorded sent
        stay sent; a part whose send may have happened is settled first (Avito: found in
        the chat or not; generic: sent again under its key; Telegram cannot tell: a person
        decides); then the missing parts go out, in order, from the same text."""
        job = state.job
        sent = {n: p.message_id for n, p in parts.items() if p.status is DeliveryStatus.SENT and p.message_id}
        for number, part in sorted(parts.items()):
            if part.status not in (DeliveryStatus.SENDING, DeliveryStatus.UNKNOWN) or platform.idempotent:
                continue
            echoed = await self._echo(db, job, part.text, part.started_at)
            if echoed is not None:
                await db.part_done(job.job_id, number, DeliveryStatus.SENT, echoed.message_id)
                sent[number] = echoed.message_id
                continue
            if not platform.can_reconcile:
                await self._give_up(
                    db,
                    job.job_id,
                    "unknown",
                    f"{platform.name} cannot tell whether part {number} of the reply went out "
                    f"({len(sent)} part(s) are in the chat)",
                )
                return
            found = await self._find(db, job, platform, key=f"{job.job_id}:{number}", attempts=Attempts(
                part.text, part.started_at, part.started_at))  # fmt: skip
            if found is not None:
                await db.part_done(job.job_id, number, DeliveryStatus.SENT, found.message_id)
                sent[number] = found.message_id
        logger.info(
            "job %s: resuming a reply in parts (%d already in the chat)",
            job.job_id,
            len(sent),
            extra={"job_id": job.job_id, "chat": job.chat_key, "attempt": attempt},
        )
        await self._reply(db, job, platform, attempt, text=state.text, sent_parts=sent)

    async def _find(
        self, db: JobSession, job: Job, platform: Platform, *, key: str, attempts: Attempts
    ) -> Sent | None:
        """Look for a send whose outcome is unknown on the platform (see Platform.find_sent);
        a platform that cannot tell yet, or cannot answer, sends the job back to wait."""
        try:
            return await platform.find_sent(
                SentQuery(
                    account_id=job.account_id,
                    chat_id=job.chat_id,
                    key=key,
                    attempts=attempts,
                    exclude=frozenset(await db.recorded_message_ids(job)),
                    rivals=tuple(await db.unknown_rivals(job)),
                )
            )
        except TooEarly as early:
            await db.record_retry(job.job_id, "unknown", f"reconciling: {early}")
            raise RetryLater(
                f"reconciling with {platform.name}: {early}",
                kind="reconcile_wait",
                retry_after=early.seconds,
                counts=False,
            ) from None
        except Failure as failure:
            if failure.kind is Kind.ACCOUNT:
                await self._account_refused(db, job, failure)
            await db.record_retry(job.job_id, "unknown", f"reconciling: {failure.reason}")
            raise RetryLater(
                f"reconciling with {platform.name}: {failure.reason}", kind="reconcile"
            ) from None

    async def _refused_before(self, db: JobSession, job: Job, reason: str) -> None:
        """Fail the job alone when it was refused for its account (or connection) before:
        the probe found the account working, and the refusal came back for this job."""
        times = self._refused.pop(job.job_id, 0) + 1
        self._refused[job.job_id] = times
        while len(self._refused) > 10_000:
            del self._refused[next(iter(self._refused))]
        if times < 2:
            return
        self._refused.pop(job.job_id, None)
        why = (
            f"{reason}; refused again for this reply after the account was found working: "
            "the refusal is about this chat"
        )
        await self._give_up(db, job.job_id, "permanent", why)
        raise Reject(why)

    async def _account_refused(self, db: JobSession, job: Job, failure: Failure) -> None:
        """The platform refused the account as a whole: pause it (one alert, when it was
        active), and let this job wait with the others."""
        await self._refused_before(db, job, failure.reason)
        if await self._store.pause_account(job.platform, job.account_id, failure.reason, self._probe_seconds):
            logger.warning("%s account %s paused: %s", job.platform, job.account_id, failure.reason)
            ACCOUNTS_PAUSED.labels(platform=job.platform).inc()
            await self._alerter.announce(
                "account.paused",
                {"platform": job.platform, "account_id": job.account_id, "reason": failure.reason},
            )
        await self._wait_for_account(db, job, failure.reason)

    async def _connection_refused(self, db: JobSession, job: Job, reason: str) -> None:
        """Telegram refused the business connection the reply goes through: pause it (one
        alert, when it was not paused), and let this job wait with the connection's others."""
        assert self._connections is not None and job.business_connection_id is not None
        await self._refused_before(db, job, reason)
        if await self._connections.pause(
            job.account_id, job.business_connection_id, reason, self._probe_seconds
        ):
            logger.warning("Telegram Business connection %s paused: %s", job.business_connection_id, reason)
            await self._alerter.announce(
                "business_connection.paused",
                {
                    "platform": job.platform,
                    "account_id": job.account_id,
                    "business_connection_id": job.business_connection_id,
                    "reason": reason,
                },
            )
        await self._wait_for_connection(db, job, reason)

    async def _wait_for_connection(self, db: JobSession, job: Job, reason: str) -> None:
        """Nothing may be sent through a paused business connection: the job waits, without
        spending an attempt, until Telegram says it works again."""
        why = f"waiting: {reason}"
        await db.record_retry(job.job_id, "account", why)
        raise RetryLater(why, kind="connection_paused", retry_after=self._probe_seconds, counts=False)

    async def _wait_for_account(self, db: JobSession, job: Job, reason: str) -> None:
        """Nothing may be sent on a paused account: the job waits, without spending an
        attempt, until a probe resumes the account (``probe_accounts``)."""
        why = f"waiting: the {job.platform} account is paused: {reason}"
        await db.record_retry(job.job_id, "account", why)
        raise RetryLater(why, kind="account_paused", retry_after=self._probe_seconds, counts=False)

    async def probe_accounts(self) -> int:
        """Ask the platform whether each paused account due for a probe works again; resume
        the ones it accepts (their jobs go on at their next turn). One replica at a time.
        Returns how many were resumed."""
        resumed = 0
        async with self._store.accounts_to_probe(self._platforms.names()) as due:
            for account in due:
                await self._platforms.learn(account["platform"], account["account_id"])
                try:
                    platform = self._platforms.for_account(account["platform"], account["account_id"])
                except Unserved:
                    platform = None
                if platform is None:
                    continue
                try:
                    await platform.probe(account["account_id"])
                except Failure as failure:
                    reason = failure.reason if failure.kind is Kind.ACCOUNT else account["state_reason"]
                    await self._store.probe_later(
                        account["platform"], account["account_id"], reason, self._probe_seconds
                    )
                    continue
                if await self._store.resume_account(account["platform"], account["account_id"]):
                    resumed += 1
                    logger.warning(
                        "%s account %s works again: resumed", account["platform"], account["account_id"]
                    )
                    await self._alerter.announce(
                        "account.resumed",
                        {"platform": account["platform"], "account_id": account["account_id"]},
                    )
        return resumed + await self._probe_connections()

    async def _probe_connections(self) -> int:
        """Ask Telegram whether each paused business connection due for a probe works again
        (getBusinessConnection); resume the ones that do. Returns how many were resumed."""
        if self._connections is None:
            return 0
        resumed = 0
        async with self._connections.due_for_probe() as due:
            for row in due:
                account_id, connection_id = row["account_id"], row["connection_id"]
                try:
                    platform = self._platforms.for_account("telegram", account_id)
                except Unserved:
                    platform = None
                if not isinstance(platform, TelegramPlatform):
                    continue
                try:
                    enabled, can_reply = await platform.business_connection(account_id, connection_id)
                except Failure as failure:
                    if failure.kind is Kind.CONNECTION:
                        # Telegram does not know it any more: its waiting replies go to a person.
                        await self._connections.remove(
                            account_id,
                            connection_id,
                            f"Telegram Business connection {connection_id} is gone ({failure.reason})",
                        )
                        continue
                    enabled = can_reply = False
                if not (enabled and can_reply):
                    await self._connections.probe_later(account_id, connection_id, self._probe_seconds)
                    continue
                if await self._connections.resume(account_id, connection_id):
                    resumed += 1
                    logger.warning("Telegram Business connection %s works again: resumed", connection_id)
                    await self._alerter.announce(
                        "business_connection.resumed",
                        {
                            "platform": "telegram",
                            "account_id": account_id,
                            "business_connection_id": connection_id,
                        },
                    )
        return resumed

    async def _give_up(self, db: JobSession | JobStorage, job_id: uuid.UUID, kind: str, reason: str) -> None:
        """Give up under the job's lock (see chatq_give_up) and tell a person what changed."""
        settled = await db.give_up(job_id, kind, reason, self._owner)
        if settled.outcome == "busy":
            logger.info(
                "job %s: not giving up, another consumer holds it: %s",
                job_id,
                reason,
                extra={"job_id": job_id},
            )
            return
        if settled.outcome == "final":
            return
        logger.warning(
            "job %s %s (owner %s): %s",
            job_id,
            settled.outcome,
            self._owner,
            reason,
            extra={"job_id": job_id, "chat": settled.chat_key},
        )
        await self._alerter.announce(
            f"operation.{settled.outcome}",
            {
                "job_id": str(job_id),
                "chat": settled.chat_key,
                "operations": [str(o) for o in settled.operation_ids],
                "reason": reason,
                "kind": kind,
                "owner": self._owner,
            },
        )

    async def give_up(self, message: Delivery, kind: str, reason: str) -> None:
        """Consumer hook before a job is dead-lettered (permanent, exhausted, or at the
        broker's delivery limit): the job goes to a person, failed or needs_review."""
        try:
            job_id = uuid.UUID(message.message_id or "")
        except ValueError:
            return
        await self._give_up(self._store, job_id, kind, reason)

    async def retry_scheduled(self, message: Delivery, attempt: int, delay: float, _: str) -> None:
        """Consumer hook once a job is in its retry tier: the record says when it comes back."""
        try:
            job_id = uuid.UUID(message.message_id or "")
        except ValueError:
            return
        await self._store.retry_scheduled(job_id, attempt, delay)

    async def dead_lettered(self, message: Delivery, reason: str) -> None:
        """The dead-letter recorder's hook: a job that reached chatq.responder.dead without
        a give-up (the broker's delivery limit after crashes) goes to a person too."""
        await self.give_up(message, "exhausted", reason)
