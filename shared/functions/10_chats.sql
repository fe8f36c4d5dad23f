-- A chat's last answered message: a marker only ever moved forward in platform order
-- (timestamp, then message id, numeric ids by length), and never past the database's
-- clock, so a message stamped in the future cannot put the marker out of reach. Used for
-- the history the reply writer sees; it never decides whether a message is answered
-- (reply_coverage does).
CREATE OR REPLACE FUNCTION chatq_advance_last_answered(
    p_chat_key text, p_sent_at timestamptz, p_message_id text, p_reply_at timestamptz, p_job_id uuid
) RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    at timestamptz := least(p_sent_at, clock_timestamp());
BEGIN
    INSERT INTO chats (chat_key, last_answered_sent_at, last_answered_message_id, last_reply_at, last_job_id)
    VALUES (p_chat_key, at, p_message_id, p_reply_at, p_job_id)
    ON CONFLICT (chat_key) DO UPDATE
    SET last_answered_sent_at = EXCLUDED.last_answered_sent_at,
        last_answered_message_id = EXCLUDED.last_answered_message_id,
        last_reply_at = EXCLUDED.last_reply_at, last_job_id = EXCLUDED.last_job_id
    WHERE (chats.last_answered_sent_at, length(chats.last_answered_message_id), chats.last_answered_message_id)
        < (EXCLUDED.last_answered_sent_at, length(EXCLUDED.last_answered_message_id),
           EXCLUDED.last_answered_message_id);
END
$$;
