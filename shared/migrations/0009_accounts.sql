-- Keep platform accounts working (issue 15): an account the platform refuses as a whole
-- (a revoked bot token, wrong client credentials, no paid Messenger plan) is paused, its
-- jobs wait instead of failing, and a probe resumes it; and one Avito access token is
-- shared by every replica instead of each fetching (and invalidating) its own.

CREATE TABLE accounts (
    platform      text NOT NULL CHECK (platform IN ('telegram', 'avito', 'generic', 'sandbox')),
    account_id    text NOT NULL CHECK (account_id <> ''),
    state         text NOT NULL DEFAULT 'active'
                  CHECK (state IN ('active', 'paused_by_platform', 'paused_by_person')),
    -- Why it is paused, in words a person reads, and what fixes it.
    state_reason  text,
    state_since   timestamptz NOT NULL DEFAULT now(),
    -- When the platform is asked again whether the account works (paused by the platform).
    next_probe_at timestamptz,
    PRIMARY KEY (platform, account_id),
    CONSTRAINT accounts_paused_has_reason CHECK (state = 'active' OR state_reason IS NOT NULL)
);
CREATE INDEX accounts_to_probe ON accounts (next_probe_at) WHERE state = 'paused_by_platform';

-- Access tokens a platform hands out for credentials (Avito's client credentials), shared
-- by every process; refreshed ahead of expiry by one process at a time.
CREATE TABLE platform_tokens (
    platform     text NOT NULL,
    credential   text NOT NULL,  -- whose token (the Avito client id), never the secret
    token        text NOT NULL,
    expires_at   timestamptz NOT NULL,
    refreshed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (platform, credential)
);

-- A job waiting for its paused account says so.
ALTER TABLE reply_jobs DROP CONSTRAINT reply_jobs_error_kind_check;
ALTER TABLE reply_jobs ADD CONSTRAINT reply_jobs_error_kind_check
    CHECK (error_kind IN ('transient', 'permanent', 'unknown', 'exhausted', 'account'));
