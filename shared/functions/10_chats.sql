-- A chat's last answered message: a marker only ever moved forward in platform order
-- (chatq_order), and never past the database's clock, so a message stamped in the future
-- cannot put the marker out of reach. Used for the history the reply writer sees; it
-- never decides whether a message is answered (reply_coverage does).
DROP FUNCTION IF EXISTS chatq_advance_last_answered(text, timestamptz, text, timestamptz, uuid);
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
