-- Responder: reply state on the job, the delivery intent recorded before each platform
-- call, and each chat's last answered message (the cheap already-answered guard).

ALTER TABLE reply_jobs
    ADD COLUMN attempts            integer NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    ADD COLUMN reply_text          text,
    ADD COLUMN platform_message_id text,
    ADD COLUMN sent_at             timestamptz,
    ADD COLUMN error_kind          text CHECK (error_kind IN ('transient', 'permanent', 'unknown', 'exhausted')),
    ADD COLUMN error_message       text,
    ADD COLUMN owner               text,
    ADD COLUMN folded              integer NOT NULL DEFAULT 0 CHECK (folded >= 0),
    ADD CONSTRAINT reply_jobs_sent_has_reply CHECK (
        status <> 'sent' OR (reply_text IS NOT NULL AND sent_at IS NOT NULL)),
    ADD CONSTRAINT reply_jobs_failed_has_reason CHECK (
        status NOT IN ('failed', 'needs_review') OR error_message IS NOT NULL),
    ADD CONSTRAINT reply_jobs_review_has_owner CHECK (status <> 'needs_review' OR owner IS NOT NULL);

-- One row per job: the latest attempt's intent and outcome. 'sending' is written and
-- committed before the platform is called, so a crash mid-call leaves evidence that the
-- send may have happened, and the job is reconciled instead of re-sent blindly.
CREATE TABLE deliveries (
    job_id               uuid PRIMARY KEY REFERENCES reply_jobs (id),
    status               text NOT NULL CHECK (status IN ('sending', 'sent', 'unknown', 'not_sent')),
    text                 text NOT NULL,
    attempt              integer NOT NULL CHECK (attempt >= 1),
    started_at           timestamptz NOT NULL,
    finished_at          timestamptz,
    platform_message_id  text,
    error                text,
    CONSTRAINT deliveries_sent_has_id CHECK (status <> 'sent' OR finished_at IS NOT NULL)
);

CREATE TABLE chats (
    chat_key                 text PRIMARY KEY,
    last_answered_sent_at    timestamptz NOT NULL,
    last_answered_message_id text NOT NULL,
    last_reply_at            timestamptz NOT NULL,
    last_job_id              uuid NOT NULL REFERENCES reply_jobs (id)
);

CREATE INDEX operations_chat_recent ON operations (platform, account_id, chat_id, received_at DESC);
CREATE INDEX reply_jobs_chat_sent ON reply_jobs (chat_key, sent_at DESC) WHERE status = 'sent';
