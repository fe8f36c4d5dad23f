-- Every process keeps the accounts (credentials decrypted) in memory: a change to the
-- table tells them to read it again now (LISTEN chatq_accounts), not at their next
-- periodic read. One notification a statement, whatever it changed.
CREATE OR REPLACE FUNCTION chatq_accounts_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('chatq_accounts', '');
    RETURN NULL;
END $$;

CREATE OR REPLACE TRIGGER accounts_changed AFTER INSERT OR UPDATE OR DELETE ON accounts
    FOR EACH STATEMENT EXECUTE FUNCTION chatq_accounts_changed();
