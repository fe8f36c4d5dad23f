-- Coalescing: one window of messages per chat burst, and the reply job emitted from it.
-- The coalescer owns chat_windows and window_messages; reply_jobs is created by the
-- coalescer and owned by the responder from then on.

CREATE TABLE chat_windows (
    id             uuid PRIMARY KEY,
    chat_key       text NOT NULL CHECK (chat_key <> ''),
    platform       text NOT NULL,
    account_id     text NOT NULL,
    chat_id        text NOT NULL,
    status         text NOT NULL CHECK (status IN ('open', 'closed')),
    first_at       timestamptz NOT NULL,
    last_at        timestamptz NOT NULL,
    -- first_at + MAX_WAIT when the window opened: due never passes it.
    deadline_at    timestamptz NOT NULL,
    due_at         timestamptz NOT NULL,
    delay_seconds  double precision NOT NULL CHECK (delay_seconds >= 0),
    message_count  integer NOT NULL CHECK (message_count >= 1),
    closed_at      timestamptz,
    job_id         uuid,
    CONSTRAINT chat_windows_due_bounds CHECK (due_at >= first_at AND due_at <= deadline_at),
    CONSTRAINT chat_windows_closed_has_job CHECK (
        (status = 'open' AND closed_at IS NULL AND job_id IS NULL)
        OR (status = 'closed' AND closed_at IS NOT NULL AND job_id IS NOT NULL))
);

-- One open window per chat, whatever the number of coalescer replicas.
CREATE UNIQUE INDEX chat_windows_one_open ON chat_windows (chat_key) WHERE status = 'open';
-- Exactly the scheduler's claim: open windows by due time.
CREATE INDEX chat_windows_due ON chat_windows (due_at) WHERE status = 'open';

-- Each message lands in exactly one window: the operation id is the key, which also
-- makes a redelivered inbound message a no-op.
CREATE TABLE window_messages (
    operation_id  uuid PRIMARY KEY REFERENCES operations (id),
    window_id     uuid NOT NULL REFERENCES chat_windows (id),
    added_at      timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX window_messages_window ON window_messages (window_id);

CREATE TABLE reply_jobs (
    id             uuid PRIMARY KEY,
    window_id      uuid NOT NULL UNIQUE REFERENCES chat_windows (id),
    chat_key       text NOT NULL,
    platform       text NOT NULL,
    account_id     text NOT NULL,
    chat_id        text NOT NULL,
    status         text NOT NULL CHECK (status IN (
                       'pending', 'processing', 'sent', 'failed', 'needs_review', 'superseded')),
    -- The window's messages in platform order.
    operation_ids  uuid[] NOT NULL CHECK (cardinality(operation_ids) >= 1),
    created_at     timestamptz NOT NULL DEFAULT now(),
    updated_at     timestamptz NOT NULL DEFAULT now()
);

-- At most one reply job per chat in flight (invariant I4), enforced by Postgres.
CREATE UNIQUE INDEX reply_jobs_one_in_flight ON reply_jobs (chat_key)
    WHERE status IN ('pending', 'processing');

ALTER TABLE operations ADD COLUMN job_id uuid REFERENCES reply_jobs (id);
CREATE INDEX operations_job ON operations (job_id) WHERE job_id IS NOT NULL;
