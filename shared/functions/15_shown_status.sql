-- chatq:release 1 sha256:525d459a3fb43fa3
-- An operation's status as a person reads it. Two states are read, not written, each
-- update of the message's row saved (not HOT: status is indexed, so each wrote eight
-- index entries) for a state that is already in another row:
--   queued    an operation still 'accepted' whose inbound outbox row is no longer
--             unpublished (the relay published it); a probe of outbox_unpublished_head.
--   replying  an operation 'waiting' that a reply holds (its reply_coverage row, taken
--             by the job's claim); a probe of reply_coverage's primary key.
-- Statuses written 'queued' or 'replying' (earlier releases; a fold-in, a claim of a
-- message not yet filed) read as they are.
CREATE OR REPLACE FUNCTION chatq_shown_status(
    p_status text, p_id uuid, p_platform text, p_account_id text, p_chat_id text
) RETURNS text LANGUAGE sql STABLE AS $$
    SELECT CASE
        WHEN p_status = 'accepted' AND NOT EXISTS (
                SELECT 1 FROM outbox b
                WHERE b.exchange = 'chatq.inbound' AND b.published_at IS NULL
                  AND b.ordering_key = chatq_chat_key(p_platform, p_account_id, p_chat_id)
                  AND b.operation_id = p_id)
            THEN 'queued'
        WHEN p_status = 'waiting' AND EXISTS (SELECT 1 FROM reply_coverage rc WHERE rc.operation_id = p_id)
            THEN 'replying'
        ELSE p_status END
$$;
