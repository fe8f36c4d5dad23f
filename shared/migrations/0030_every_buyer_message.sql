-- Every buyer message the platforms can send gets a seller's answer (issue 38).

-- A message that names no chat (Avito's document requires no field of a message) is
-- stored and handed to a person, who finds it in the app: needs_review without a chat.
ALTER TABLE operations DROP CONSTRAINT operations_answerable;
ALTER TABLE operations ADD CONSTRAINT operations_answerable CHECK (
    status IN ('ignored', 'needs_review')
    OR (chat_id IS NOT NULL AND message_id IS NOT NULL AND text IS NOT NULL)) NOT VALID;

-- Per account: what the bot does with a message it cannot read alone (a voice note, a
-- file): 'person' hands it over, 'answer' answers its placeholder (NULL: the global
-- CHATQ_UNREADABLE_MESSAGES).
ALTER TABLE accounts ADD COLUMN unreadable_messages text CHECK (unreadable_messages IN ('person', 'answer'));

-- Telegram Business connections as Telegram last described them (business_connection
-- updates, getBusinessConnection): a connection turned off, or without the right to
-- reply, pauses its chats' replies with the reason until it works again.
CREATE TABLE telegram_business_connections (
    account_id     text NOT NULL CHECK (account_id <> ''),  -- the bot
    connection_id  text NOT NULL CHECK (connection_id <> ''),
    owner_id       text,                                    -- the business account's user
    is_enabled     boolean NOT NULL,
    can_reply      boolean NOT NULL,
    -- Why its replies wait (NULL: they go): what Telegram said, in words a person reads.
    paused_reason  text,
    -- When Telegram is asked again (getBusinessConnection) while paused.
    next_probe_at  timestamptz,
    updated_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (account_id, connection_id),
    CONSTRAINT telegram_business_paused_has_probe CHECK (paused_reason IS NULL OR next_probe_at IS NOT NULL)
);

-- The Avito poll's progress, kept so a round that stops early (a 429, a 5xx, a restart)
-- does not send the next one back a day: per account, when a complete listing of its
-- chats last started (the next lists back to it, less a margin) and when it was first
-- polled (its connection: older messages are left to the seller); per chat, the
-- 'updated' Avito gave it when its messages were last read (a chat not updated since is
-- not read again).
CREATE TABLE avito_poll_accounts (
    account_id       text PRIMARY KEY CHECK (account_id <> ''),
    connected_at     timestamptz NOT NULL DEFAULT now(),
    listed_since     double precision,
    updated_at       timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE avito_poll_chats (
    account_id  text NOT NULL CHECK (account_id <> ''),
    chat_id     text NOT NULL CHECK (chat_id <> ''),
    updated     double precision NOT NULL,
    read_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (account_id, chat_id)
);
CREATE INDEX avito_poll_chats_read ON avito_poll_chats (read_at);  -- retention

-- One request budget per platform account, shared by every process that calls the
-- platform for it (the Avito poll in the receiver, the sends in every responder): the
-- requests counted in the current minute (Avito counts per minute), the limit the
-- platform last stated (X-RateLimit-Limit), and a pause the platform asked for (429, or
-- no request left in the window) that every process honours.
CREATE TABLE platform_budgets (
    platform      text NOT NULL,
    account_id    text NOT NULL,
    window_start  timestamptz NOT NULL,
    used          integer NOT NULL CHECK (used >= 0),
    per_minute    integer CHECK (per_minute > 0),
    paused_until  timestamptz,
    PRIMARY KEY (platform, account_id)
);

-- Our own replies as the platform echoed them back (an Avito webhook of the account's
-- message, a Telegram business message our bot sent): proof a reply is in the chat, which
-- settles a send whose answer was lost (its echo may come before, or after, the answer).
CREATE TABLE reply_echoes (
    chat_key            text NOT NULL CHECK (chat_key <> ''),
    platform_message_id text NOT NULL CHECK (platform_message_id <> ''),
    text_norm           text NOT NULL,
    seen_at             timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (chat_key, platform_message_id)
);
CREATE INDEX reply_echoes_text ON reply_echoes (chat_key, text_norm, seen_at);
CREATE INDEX reply_echoes_seen ON reply_echoes (seen_at);  -- retention
