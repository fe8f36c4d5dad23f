-- Many sellers, one deployment (issue 21): accounts as data. Each account (a Telegram bot,
-- an Avito account, a generic sender) has a name, its own credentials, encrypted with
-- CHATQ_SECRETS_KEY (Fernet; never stored in the clear), its own webhook, and settings
-- that override the global ones. Rows made before this (an account the platform paused)
-- stay, as source 'seen'.

ALTER TABLE accounts
    ADD COLUMN name text CHECK (name <> '' AND length(name) <= 200),
    -- Who made the row: 'seen' (the first message or a refusal named it), 'environment'
    -- (the CHATQ_* single-account settings, at start), 'admin' (chatq accounts add).
    ADD COLUMN source text NOT NULL DEFAULT 'seen' CHECK (source IN ('seen', 'environment', 'admin')),
    -- A Fernet token of the account's credentials as JSON; only the services decrypt it.
    ADD COLUMN credentials bytea,
    -- The SHA-256 (hex) of an Avito account's webhook path secret: which account a delivery
    -- is for, without keeping the secret where it can be read.
    ADD COLUMN webhook_key text UNIQUE CHECK (webhook_key ~ '^[0-9a-f]{64}$'),
    -- Overrides of the global settings (NULL: the global one).
    ADD COLUMN facts text CHECK (length(facts) BETWEEN 1 AND 100000),
    ADD COLUMN facts_file text CHECK (facts_file <> ''),
    ADD COLUMN llm_model text CHECK (llm_model <> '' AND length(llm_model) <= 200),
    ADD COLUMN prompt text CHECK (length(prompt) BETWEEN 1 AND 20000),
    ADD COLUMN reply_delay_min_seconds double precision CHECK (reply_delay_min_seconds BETWEEN 0 AND 86400),
    ADD COLUMN reply_delay_max_seconds double precision CHECK (reply_delay_max_seconds BETWEEN 0 AND 86400),
    ADD COLUMN takeover_seconds double precision CHECK (takeover_seconds BETWEEN 0 AND 30 * 86400),
    ADD COLUMN rate_per_second double precision CHECK (rate_per_second > 0 AND rate_per_second <= 1000),
    ADD COLUMN created_at timestamptz NOT NULL DEFAULT now(),
    ADD COLUMN updated_at timestamptz NOT NULL DEFAULT now(),
    -- Removed by a person: its webhooks answer 404, its jobs are not sent, its credentials
    -- are wiped; its messages and their record stay. Adding it again brings it back.
    ADD COLUMN removed_at timestamptz,
    ADD CONSTRAINT accounts_pause_range CHECK (
        reply_delay_min_seconds IS NULL OR reply_delay_max_seconds IS NULL
        OR reply_delay_min_seconds <= reply_delay_max_seconds),
    ADD CONSTRAINT accounts_added_have_credentials CHECK (
        source <> 'admin' OR removed_at IS NOT NULL OR credentials IS NOT NULL),
    ADD CONSTRAINT accounts_removed_have_no_credentials CHECK (
        removed_at IS NULL OR (credentials IS NULL AND webhook_key IS NULL));

-- Fair share: each account's reply jobs emitted and unfinished, counted at each emission.
CREATE INDEX reply_jobs_account_in_flight ON reply_jobs (platform, account_id)
    WHERE status IN ('pending', 'processing');
