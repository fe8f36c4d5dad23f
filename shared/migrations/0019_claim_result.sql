-- What chatq_claim_job (shared/functions/30_jobs.sql) returns: one composite value read
-- by name, its messages and the chat's history as arrays of rows, instead of a table of
-- nineteen columns whose message fields came as five parallel arrays.
CREATE TYPE chatq_job_message AS (
    operation_id uuid,
    message_id   text,
    text         text,
    sent_at      timestamptz,
    received_at  timestamptz
);

CREATE TYPE chatq_turn AS (
    role text,  -- buyer or bot
    text text
);

-- The attempt of a job that may have reached the platform (a claim's reconcile).
CREATE TYPE chatq_claimed_delivery AS (
    status      text,  -- sending or unknown
    text        text,
    started_at  timestamptz,
    maybe_since timestamptz
);

CREATE TYPE chatq_claim_result AS (
    outcome                text,  -- busy, missing, skip, reconcile or claimed
    reason                 text,
    platform               text,
    account_id             text,
    chat_id                text,
    chat_key               text,
    account_paused         text,
    business_connection_id text,
    delivery               chatq_claimed_delivery,
    history                chatq_turn[],
    messages               chatq_job_message[]
);
