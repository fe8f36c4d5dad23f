-- Behave like a careful seller's assistant (issue 16).

-- Telegram Business: a reply to a business chat is sent through the business connection.
ALTER TABLE operations ADD COLUMN business_connection_id text CHECK (business_connection_id <> '');

-- The seller answered in person (seller_wrote_at, with their message): replies built before
-- are withdrawn, and the bot steps back from the chat until held_until (NULL: not held).
ALTER TABLE chats
    ALTER COLUMN last_job_id DROP NOT NULL,
    ADD COLUMN seller_wrote_at timestamptz,
    ADD COLUMN seller_message_id text,
    ADD COLUMN held_until timestamptz,
    -- The chat's listing (Avito: title, price, url), for the reply writer; cached.
    ADD COLUMN listing jsonb,
    ADD COLUMN listing_fetched_at timestamptz,
    ADD CONSTRAINT chats_held_by_the_seller CHECK (held_until IS NULL OR seller_wrote_at IS NOT NULL);
-- Chats held now (a hold that runs out is cleared), for the scheduler and the ops page.
CREATE INDEX chats_held ON chats (held_until) WHERE held_until IS NOT NULL;

-- A reply longer than the platform takes goes out as parts, in order; each part's send is
-- recorded like a whole reply's, so a retry never sends a delivered part again.
CREATE TABLE delivery_parts (
    job_id               uuid NOT NULL REFERENCES reply_jobs (id),
    part                 integer NOT NULL CHECK (part >= 1),
    text                 text NOT NULL CHECK (text <> ''),
    status               text NOT NULL CHECK (status IN ('sending', 'sent', 'unknown', 'not_sent')),
    platform_message_id  text,
    started_at           timestamptz NOT NULL,
    finished_at          timestamptz,
    PRIMARY KEY (job_id, part),
    CONSTRAINT delivery_parts_sent_has_id CHECK (status <> 'sent' OR platform_message_id IS NOT NULL)
);
