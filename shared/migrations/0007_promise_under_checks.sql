-- Keeping the promise under independent checks (issue 13): relays claim a chat's head row
-- only, the coalescer holds a window while an earlier message of its chat is in transit,
-- dead letters are recorded, stuck jobs are found, a person's decisions are recorded, and
-- finished rows can be purged. The functions live in shared/functions/.

-- A relay claims only the first unpublished row of each (exchange, ordering key): a
-- chat's rows reach the broker in order whatever the number of relays.
CREATE INDEX outbox_unpublished_head ON outbox (exchange, ordering_key, id) WHERE published_at IS NULL;

-- Messages received but not yet filed in a window (in transit through the outbox and the
-- broker), by chat: a window is not emitted while an earlier one of its chat is here.
CREATE INDEX operations_in_transit ON operations (platform, account_id, chat_id, received_at)
    WHERE status IN ('accepted', 'queued');

-- Jobs in flight by age, for the sweeper that re-drives a job nobody holds.
CREATE INDEX reply_jobs_in_flight_age ON reply_jobs (updated_at) WHERE status IN ('pending', 'processing');

-- Whatever reaches a dead-letter queue, recorded where a person can see it.
CREATE TABLE dead_letters (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    queue        text NOT NULL CHECK (queue <> ''),
    message_id   text,
    reason       text NOT NULL,
    headers      jsonb NOT NULL DEFAULT '{}'::jsonb,
    body         bytea NOT NULL,
    recorded_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX dead_letters_recorded ON dead_letters (recorded_at);

-- What people decided about an operation (retried, with or without a confirmed re-send;
-- resolved), in order; append-only.
CREATE TABLE operation_events (
    id            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    operation_id  uuid NOT NULL REFERENCES operations (id) ON DELETE CASCADE,
    at            timestamptz NOT NULL DEFAULT clock_timestamp(),
    kind          text NOT NULL CHECK (kind <> ''),
    actor         text,
    detail        text,
    job_id        uuid
);
CREATE INDEX operation_events_operation ON operation_events (operation_id, id);

-- A chat's last-answered marker outlives the job that set it (finished jobs are purged).
ALTER TABLE chats DROP CONSTRAINT chats_last_job_id_fkey;

-- Finished rows by age, for retention.
CREATE INDEX operations_updated ON operations (updated_at);
CREATE INDEX reply_jobs_updated ON reply_jobs (updated_at);
CREATE INDEX chat_windows_closed ON chat_windows (closed_at) WHERE status = 'closed';
CREATE INDEX sandbox_replies_created ON sandbox_replies (created_at);

-- Who decides a failed job: like needs_review, failed carries an owner.
ALTER TABLE reply_jobs ADD CONSTRAINT reply_jobs_failed_has_owner CHECK (status <> 'failed' OR owner IS NOT NULL) NOT VALID;

-- Every operation a person must act on names who: failed and needs_review carry an owner.
ALTER TABLE operations ADD COLUMN owner text;
ALTER TABLE operations ADD CONSTRAINT operations_actionable_has_owner
    CHECK (status NOT IN ('failed', 'needs_review') OR (owner IS NOT NULL AND status_reason IS NOT NULL)) NOT VALID;

-- A delivery row holds the latest attempt; whether ANY attempt of the job may have reached
-- the platform must outlive the next attempt's intent, so an unknown outcome is never
-- forgotten by a later attempt that clearly did not send.
ALTER TABLE deliveries
    ADD COLUMN maybe_sent boolean NOT NULL DEFAULT false,
    -- When the first attempt that may have sent began: reconciling looks back to it.
    ADD COLUMN maybe_since timestamptz,
    ADD CONSTRAINT deliveries_maybe_since CHECK (NOT maybe_sent OR maybe_since IS NOT NULL);

-- A chat's replies that may be on the platform unrecorded (jobs a person must look at):
-- reconciling another job of the chat must not take one of them for its own.
CREATE INDEX reply_jobs_chat_review ON reply_jobs (chat_key) WHERE status = 'needs_review';
