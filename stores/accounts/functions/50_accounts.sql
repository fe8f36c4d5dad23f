-- chatq:release 1 sha256:50155fec397950bb
-- Every process keeps the accounts (credentials decrypted) in memory: a change to the
-- table tells them at once which account changed (LISTEN chatq_accounts, the payload
-- the JSON array [platform, account_id]), and each reads that account's row again, not
-- the whole table (shared/accounts.py). One notification per changed row; an UPDATE
-- that changes nothing sends none. An empty payload (an id too long for a notification)
-- means: read every account.
CREATE OR REPLACE FUNCTION chatq_account_notify(p_platform text, p_account_id text) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    payload text := json_build_array(p_platform, p_account_id)::text;
BEGIN
    -- A notification's payload must be shorter than 8000 bytes.
    PERFORM pg_notify('chatq_accounts', CASE WHEN octet_length(payload) < 7900 THEN payload ELSE '' END);
END $$;

CREATE OR REPLACE FUNCTION chatq_accounts_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP IN ('UPDATE', 'DELETE') THEN
        PERFORM chatq_account_notify(OLD.platform, OLD.account_id);
    END IF;
    IF TG_OP = 'INSERT' OR (TG_OP = 'UPDATE'
            AND (NEW.platform, NEW.account_id) IS DISTINCT FROM (OLD.platform, OLD.account_id)) THEN
        PERFORM chatq_account_notify(NEW.platform, NEW.account_id);
    END IF;
    RETURN NULL;
END $$;

-- (Replaces the statement-level trigger of before, whose every notification made every
-- process read and decrypt every account: adding N accounts cost O(N^2).)
CREATE OR REPLACE TRIGGER accounts_changed AFTER INSERT OR DELETE ON accounts
    FOR EACH ROW EXECUTE FUNCTION chatq_accounts_changed();
CREATE OR REPLACE TRIGGER accounts_updated AFTER UPDATE ON accounts
    FOR EACH ROW WHEN (OLD.* IS DISTINCT FROM NEW.*) EXECUTE FUNCTION chatq_accounts_changed();
