-- Avito access tokens are credentials (issue 39): stored sealed (Fernet, the accounts' key
-- or, without one, a key made from the client credentials), keyed by the account and a
-- digest of its client id and secret rather than the client id alone (an account given
-- another's client id with a wrong secret reused that account's token), and deleted with
-- their account.
ALTER TABLE platform_tokens ADD COLUMN account_id text;
ALTER TABLE platform_tokens ADD COLUMN sealed bytea;
-- The previous release still writes the plain column during a rollout; this release never
-- reads it and clears it whenever it stores a token.
ALTER TABLE platform_tokens ALTER COLUMN token DROP NOT NULL;
-- chatq:destructive the plain tokens are a cache of Avito's answers (asked for again at the next send) and must not stay readable
DELETE FROM platform_tokens WHERE sealed IS NULL;
CREATE INDEX platform_tokens_of_account ON platform_tokens (platform, account_id);
