-- chatq:release 2 sha256:374ddcb7d7f815a7
-- Our own replies as the platform echoes them back (reply_echoes, migration 0030): an
-- echo proves the reply is in the chat. The receiver records each echo as it stores it;
-- the responder asks for one before it calls a send's outcome unknown (chatq_echo_of);
-- and a reply already handed to a person as unknown (needs_review) that is echoed later is
-- settled here: sent, its messages replied.

-- How many replies of the chat with this text may be on the platform without their id
-- recorded (a delivery 'sending' or 'unknown', or one that may have sent once): an echo of
-- the text proves one of them went out, but says which only when there is one.
CREATE OR REPLACE FUNCTION chatq_echo_candidates(p_chat_key text, p_text text) RETURNS bigint
LANGUAGE sql STABLE AS $$
    SELECT count(*) FROM reply_jobs r JOIN deliveries d ON d.job_id = r.id
    WHERE r.chat_key = p_chat_key AND r.status IN ('pending', 'processing', 'needs_review')
      AND chatq_delivery_may_have_sent(d.status, d.maybe_sent)
      AND chatq_text_norm(d.text) = chatq_text_norm(p_text)
$$;

-- The platform's id of an echo of p_text in the chat seen since p_since that is not one of
-- p_exclude (replies already recorded), or NULL; NULL too when another reply of the chat
-- with the same text may also be on the platform (the echo could be its).
CREATE OR REPLACE FUNCTION chatq_echo_of(p_chat_key text, p_text text, p_since timestamptz, p_exclude text[])
RETURNS text LANGUAGE sql STABLE AS $$
    SELECT e.platform_message_id FROM reply_echoes e
    WHERE e.chat_key = p_chat_key AND e.text_norm = chatq_text_norm(p_text) AND e.seen_at >= p_since
      AND e.platform_message_id <> ALL(coalesce(p_exclude, '{}'))
      AND chatq_echo_candidates(p_chat_key, p_text) <= 1
    ORDER BY e.seen_at
    LIMIT 1
$$;

-- Record an echo of our reply (p_message_id: its id on the platform). The one reply of the
-- chat that went to a person because its send's outcome was unknown, with this text and
-- no parts (when no other reply of the chat with the text may be out), is settled by it: the job sent, its delivery sent, its messages replied ("the
-- platform echoed the reply"), the chat's last answered message moved. Returns the job it
-- settled, or NULL.
CREATE OR REPLACE FUNCTION chatq_record_echo(p_chat_key text, p_message_id text, p_text text)
RETURNS uuid LANGUAGE plpgsql AS $$
DECLARE
    j record;
    o record;
    v uuid;
    at timestamptz := clock_timestamp();
    replied uuid[] := '{}';
    latest chatq_order;
BEGIN
    -- The chat's lock first, as every writer of the chat's operations takes it (a person's
    -- retry or resolve included), then the job and its operations.
    PERFORM pg_advisory_xact_lock(hashtextextended(p_chat_key, 0));
    INSERT INTO reply_echoes (chat_key, platform_message_id, text_norm, seen_at)
    VALUES (p_chat_key, p_message_id, chatq_text_norm(p_text), at)
    ON CONFLICT DO NOTHING;
    IF EXISTS (SELECT 1 FROM reply_jobs r WHERE r.chat_key = p_chat_key AND r.platform_message_id = p_message_id)
    THEN
        RETURN NULL;  -- the echo of a reply already recorded
    END IF;
    SELECT r.id, r.platform, r.operation_ids, d.text INTO j
    FROM reply_jobs r JOIN deliveries d ON d.job_id = r.id
    WHERE r.chat_key = p_chat_key AND r.status = 'needs_review' AND chatq_delivery_may_have_sent(d.status, false)
      AND chatq_text_norm(d.text) = chatq_text_norm(p_text)
      AND NOT EXISTS (SELECT 1 FROM delivery_parts p WHERE p.job_id = r.id)
    ORDER BY d.started_at DESC
    LIMIT 1
    FOR UPDATE OF r;
    IF NOT FOUND OR chatq_echo_candidates(p_chat_key, p_text) > 1 THEN
        RETURN NULL;  -- none, or more than one reply the echo could be
    END IF;
    UPDATE reply_jobs SET status = 'sent', reply_text = j.text, platform_message_id = p_message_id, sent_at = at,
           error_kind = NULL, error_message = NULL, updated_at = now()
    WHERE id = j.id;
    UPDATE deliveries SET status = 'sent', platform_message_id = p_message_id, finished_at = at, error = NULL
    WHERE job_id = j.id;
    FOREACH v IN ARRAY j.operation_ids LOOP
        UPDATE operations x SET status = 'replied', status_reason = NULL, owner = NULL, updated_at = at
        WHERE x.id = v AND x.job_id = j.id AND x.status = 'needs_review'
        RETURNING x.sent_at, x.message_id, x.received_at INTO o;
        IF FOUND THEN
            replied := replied || v;
            IF latest IS NULL OR latest < chatq_order(j.platform, o.sent_at, o.message_id, o.received_at) THEN
                latest := chatq_order(j.platform, o.sent_at, o.message_id, o.received_at);
            END IF;
        END IF;
    END LOOP;
    IF latest IS NOT NULL THEN
        PERFORM chatq_advance_last_answered(p_chat_key, j.platform, latest.sent_at, latest.message_id,
                                            latest.received_at, at, j.id);
    END IF;
    PERFORM chatq_log(replied, 'replied', 'the platform echoed the reply back (message ' || p_message_id
                      || '): it is in the chat; no review needed', j.id);
    RETURN j.id;
END
$$;
