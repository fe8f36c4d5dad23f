-- chatq:release 3 sha256:e5e18eaa9b4974a2
-- A chat's last answered message: a marker only ever moved forward in platform order
-- (chatq_order), and never past the database's clock, so a message stamped in the future
-- cannot put the marker out of reach. Used for the history the reply writer sees; it
-- never decides whether a message is answered (reply_coverage does).
CREATE OR REPLACE FUNCTION chatq_advance_last_answered(
    p_chat_key text, p_platform text, p_sent_at timestamptz, p_message_id text, p_received_at timestamptz,
    p_reply_at timestamptz, p_job_id uuid
) RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    at timestamptz := least(p_sent_at, clock_timestamp());
BEGIN
    INSERT INTO chats (chat_key, last_answered_sent_at, last_answered_message_id, last_answered_received_at,
                       last_reply_at, last_job_id)
    VALUES (p_chat_key, at, p_message_id, p_received_at, p_reply_at, p_job_id)
    ON CONFLICT (chat_key) DO UPDATE
    SET last_answered_sent_at = EXCLUDED.last_answered_sent_at,
        last_answered_message_id = EXCLUDED.last_answered_message_id,
        last_answered_received_at = EXCLUDED.last_answered_received_at,
        last_reply_at = EXCLUDED.last_reply_at, last_job_id = EXCLUDED.last_job_id
    WHERE chatq_order(p_platform, chats.last_answered_sent_at, chats.last_answered_message_id,
                      chats.last_answered_received_at)
        < chatq_order(p_platform, EXCLUDED.last_answered_sent_at, EXCLUDED.last_answered_message_id,
                      EXCLUDED.last_answered_received_at);
END
$$;

-- A chat's key, as shared.messages.chat_key: platform:account:chat with '%' and ':'
-- escaped in the parts, so no two chats share a key (a test keeps the two equal).
CREATE OR REPLACE FUNCTION chatq_chat_key(p_platform text, p_account_id text, p_chat_id text)
RETURNS text LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT p_platform || ':' || replace(replace(p_account_id, '%', '%25'), ':', '%3A')
                      || ':' || replace(replace(p_chat_id, '%', '%25'), ':', '%3A')
$$;

-- A message's text as echoes are compared: line endings as \n, runs of whitespace as one
-- space, no leading or trailing space (a platform may give our reply back so changed).
CREATE OR REPLACE FUNCTION chatq_text_norm(p_text text) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT btrim(regexp_replace(replace(p_text, E'\r\n', E'\n'), '\s+', ' ', 'g'))
$$;

-- Whether a message the account itself sent (author = the account) is our own reply coming
-- back: its id is recorded for a reply of the chat, or its text is a reply (or a part of
-- one) of the chat sent in the last ten minutes, or of one whose outcome is still unknown
-- however long ago (its echo can arrive before the send's answer is recorded, or long
-- after it was lost), compared as chatq_text_norm reads them. Otherwise a person wrote
-- it: the seller.
CREATE OR REPLACE FUNCTION chatq_is_echo(p_chat_key text, p_message_id text, p_text text)
RETURNS boolean LANGUAGE sql STABLE AS $$
    SELECT EXISTS (
        SELECT 1 FROM reply_jobs r WHERE r.chat_key = p_chat_key AND r.platform_message_id = p_message_id)
    OR EXISTS (
        SELECT 1 FROM reply_jobs r JOIN delivery_parts p ON p.job_id = r.id
        WHERE r.chat_key = p_chat_key AND p.platform_message_id = p_message_id)
    OR EXISTS (
        SELECT 1 FROM reply_jobs r JOIN deliveries d ON d.job_id = r.id
        WHERE r.chat_key = p_chat_key
          AND (d.started_at > clock_timestamp() - interval '10 minutes'
               OR chatq_delivery_may_have_sent(d.status, d.maybe_sent))
          AND (chatq_text_norm(d.text) = chatq_text_norm(p_text)
               OR EXISTS (SELECT 1 FROM delivery_parts p WHERE p.job_id = r.id
                          AND chatq_text_norm(p.text) = chatq_text_norm(p_text))))
$$;

-- The seller answered the chat in person (a message written by the account's owner, not
-- the bot). Under the chat's lock, in the transaction that stores the seller's message:
-- - every buyer message not yet answered and not in a reply already being sent ends
--   'replied', "answered by the seller": the chat's open window, messages still in transit,
--   and reply jobs nobody works on (pending, with no send that may have happened), which
--   are withdrawn (superseded). A job a responder is working on is withdrawn by its own
--   before-send check (chatq_before_send); one past its delivery intent is not (the reply
--   may be on the platform);
-- - the chat's last-answered marker moves to the seller's message;
-- - the bot steps back: the chat is held for p_hold_seconds (0: not held), its next
--   windows blocked until then.
-- Returns the operations it marked answered.
CREATE OR REPLACE FUNCTION chatq_seller_wrote(
    p_platform text, p_account_id text, p_chat_id text, p_message_id text, p_sent_at timestamptz,
    p_hold_seconds double precision
) RETURNS uuid[] LANGUAGE plpgsql AS $$
DECLARE
    ck text := chatq_chat_key(p_platform, p_account_id, p_chat_id);
    at timestamptz := clock_timestamp();
    why text := 'answered by the seller (message ' || p_message_id || ')';
    w uuid;
    j record;
    answered uuid[] := '{}';
    done uuid[];
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended(ck, 0));
    INSERT INTO chats (chat_key, last_answered_sent_at, last_answered_message_id, last_answered_received_at,
                       last_reply_at, last_job_id, seller_wrote_at, seller_message_id, held_until)
    VALUES (ck, least(p_sent_at, at), p_message_id, at, at, NULL, at, p_message_id,
            CASE WHEN p_hold_seconds > 0 THEN at + make_interval(secs => p_hold_seconds) END)
    ON CONFLICT (chat_key) DO UPDATE
    SET last_answered_sent_at = EXCLUDED.last_answered_sent_at,
        last_answered_message_id = EXCLUDED.last_answered_message_id,
        last_answered_received_at = EXCLUDED.last_answered_received_at,
        last_reply_at = EXCLUDED.last_reply_at, last_job_id = NULL,
        seller_wrote_at = EXCLUDED.seller_wrote_at, seller_message_id = EXCLUDED.seller_message_id,
        held_until = EXCLUDED.held_until;

    SELECT cw.id INTO w FROM chat_windows cw WHERE cw.chat_key = ck AND cw.status = 'open' FOR UPDATE;
    IF FOUND THEN
        WITH del AS (DELETE FROM window_messages wm WHERE wm.window_id = w RETURNING wm.operation_id)
        SELECT answered || coalesce(array_agg(del.operation_id), '{}') INTO answered FROM del;
        DELETE FROM chat_windows WHERE id = w;
    END IF;
    answered := answered || ARRAY(
        SELECT o.id FROM operations o
        WHERE o.platform = p_platform AND o.account_id = p_account_id AND o.chat_id = p_chat_id
          AND o.status IN ('accepted', 'queued')
          AND o.received_at IS NOT NULL);  -- states the in-transit index's predicate (0029)
    FOR j IN
        SELECT r.id, r.operation_ids FROM reply_jobs r LEFT JOIN deliveries d ON d.job_id = r.id
        WHERE r.chat_key = ck AND r.status = 'pending'
          AND NOT chatq_delivery_may_have_sent(d.status, d.maybe_sent)
        FOR UPDATE OF r
    LOOP
        UPDATE reply_jobs SET status = 'superseded', error_message = 'withdrawn: ' || why, updated_at = now()
        WHERE id = j.id;
        DELETE FROM reply_coverage WHERE job_id = j.id;
        answered := answered || j.operation_ids;
    END LOOP;
    done := chatq_answered_by_seller(answered, why, why);
    RETURN done;
END
$$;

-- A person hands a held chat back to the bot: the hold ends now and the chat's waiting
-- window goes on (unless a job still holds it). Returns whether the chat was held.
CREATE OR REPLACE FUNCTION chatq_resume_chat(p_chat_key text) RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended(p_chat_key, 0));
    UPDATE chats SET held_until = NULL WHERE chat_key = p_chat_key AND held_until > clock_timestamp();
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    UPDATE chat_windows SET blocked = false
    WHERE chat_key = p_chat_key AND status = 'open' AND blocked AND NOT chatq_chat_blocked(p_chat_key);
    RETURN true;
END
$$;
