-- Operations for a person: how a failed or needs_review operation was resolved, how
-- often it was retried, and the built-in sandbox chat's bot replies.

ALTER TABLE operations
    ADD COLUMN resolution  text CHECK (resolution IN ('replied_manually', 'dismissed')),
    ADD COLUMN resolved_by text,
    ADD COLUMN resolved_at timestamptz,
    ADD COLUMN note        text,
    ADD COLUMN retries     integer NOT NULL DEFAULT 0 CHECK (retries >= 0),
    ADD CONSTRAINT operations_resolution_complete CHECK (
        (resolution IS NULL AND resolved_at IS NULL)
        OR (resolution IS NOT NULL AND resolved_by IS NOT NULL AND resolved_at IS NOT NULL));

-- The sandbox platform's "chat server": the bot's replies, one per job at most, so a
-- re-send of the same job is a no-op and a lost answer can be looked up.
CREATE TABLE sandbox_replies (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    job_id      uuid NOT NULL UNIQUE,
    account_id  text NOT NULL,
    chat_id     text NOT NULL,
    text        text NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX sandbox_replies_chat ON sandbox_replies (account_id, chat_id, id);

CREATE INDEX reply_jobs_created ON reply_jobs (created_at);
CREATE INDEX operations_received ON operations (received_at);
