-- Function files no longer drop functions (design invariant I10, forward only: the previous
-- release's processes call what its files defined). Until now 10_chats.sql and 30_jobs.sql
-- dropped the shapes migration 0006 created, on every apply; on a fresh database they still
-- exist when the function files first run, so the drops move here, once. No release since
-- 0019 calls any of them.
-- chatq:destructive 0006's shapes, replaced by 10_chats.sql and 30_jobs.sql since 0019
DROP FUNCTION IF EXISTS chatq_advance_last_answered(text, timestamptz, text, timestamptz, uuid);
-- chatq:destructive 0006's shape, replaced by 30_jobs.sql's chatq_before_send
DROP FUNCTION IF EXISTS chatq_before_send(uuid, text, text, integer, boolean);
-- chatq:destructive a later shape, replaced by 30_jobs.sql's chatq_before_send
DROP FUNCTION IF EXISTS chatq_before_send(uuid, text, text, integer, boolean, integer, integer);
-- chatq:destructive 0006's shape, replaced by 30_jobs.sql's chatq_record_sent
DROP FUNCTION IF EXISTS chatq_record_sent(uuid, text, text, timestamptz, text, bigint);
-- 0006's chatq_claim_job returned a table; 30_jobs.sql's returns chatq_claim_result under
-- the same signature, which CREATE OR REPLACE cannot change: drop the old shape only.
DO $$
BEGIN
    IF to_regprocedure('chatq_claim_job(uuid, integer, bigint, integer)') IS NOT NULL
       AND pg_get_function_result('chatq_claim_job(uuid, integer, bigint, integer)'::regprocedure)
           <> 'chatq_claim_result' THEN
        -- chatq:destructive 0006's shape; every release since 0019 calls the chatq_claim_result one
        DROP FUNCTION chatq_claim_job(uuid, integer, bigint, integer);
    END IF;
END
$$;
