-- Intake: the inbox (one row per inbound platform message = one operation) and the
-- transactional outbox shared by every process that publishes to RabbitMQ.

CREATE TABLE operations (
    id             uuid PRIMARY KEY,
    platform       text NOT NULL CHECK (platform IN ('telegram', 'avito', 'generic', 'sandbox')),
    account_id     text NOT NULL CHECK (account_id <> ''),
    -- The platform's id of the delivery (Telegram update_id, Standard Webhooks webhook-id).
    event_id       text CHECK (event_id <> ''),
    chat_id        text CHECK (chat_id <> ''),
    message_id     text CHECK (message_id <> ''),
    author_id      text,
    text           text,
    sent_at        timestamptz,
    status         text NOT NULL CHECK (status IN (
                       'accepted', 'queued', 'waiting', 'replying', 'replied',
                       'failed', 'needs_review', 'ignored')),
    -- Why an operation was ignored, failed or needs review, in words a person reads.
    status_reason  text,
    received_at    timestamptz NOT NULL DEFAULT now(),
    updated_at     timestamptz NOT NULL DEFAULT now(),
    -- The body as received (json keeps it verbatim), for forensics and replays.
    payload        json NOT NULL,
    -- Anything the bot will answer has a chat, a message and a text.
    CONSTRAINT operations_answerable CHECK (
        status = 'ignored' OR (chat_id IS NOT NULL AND message_id IS NOT NULL AND text IS NOT NULL)),
    CONSTRAINT operations_ignored_has_reason CHECK (status <> 'ignored' OR status_reason IS NOT NULL)
);

-- Dedupe keys. NULLs are distinct, so events without an event id or without a message
-- are deduplicated by the other key alone.
CREATE UNIQUE INDEX operations_message_key ON operations (platform, account_id, chat_id, message_id);
CREATE UNIQUE INDEX operations_event_key ON operations (platform, account_id, event_id);
CREATE INDEX operations_status_received ON operations (status, received_at);

CREATE TABLE outbox (
    id               bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    exchange         text NOT NULL CHECK (exchange <> ''),
    routing_key      text NOT NULL,
    message_id       text NOT NULL CHECK (message_id <> ''),
    -- Rows of one ordering key (a chat) are never marked published past a failed one.
    ordering_key     text NOT NULL,
    -- Set for inbound messages: the operation moves to 'queued' once the broker confirms.
    operation_id     uuid,
    headers          jsonb NOT NULL DEFAULT '{}'::jsonb,
    body             bytea NOT NULL,
    created_at       timestamptz NOT NULL DEFAULT clock_timestamp(),
    published_at     timestamptz,
    publish_attempts integer NOT NULL DEFAULT 0 CHECK (publish_attempts >= 0),
    last_error       text,
    CONSTRAINT outbox_published_after_created CHECK (published_at IS NULL OR published_at >= created_at)
);

-- Exactly the relay's claim: unpublished rows in id order.
CREATE INDEX outbox_unpublished ON outbox (id) WHERE published_at IS NULL;
-- Exactly the purge: published rows by age.
CREATE INDEX outbox_published ON outbox (published_at) WHERE published_at IS NOT NULL;
