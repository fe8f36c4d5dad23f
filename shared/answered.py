"""Each chat's last answered message: the responder's cheap already-answered guard.
Written when a reply is recorded and when a person resolves as replied manually; it only
ever moves forward in platform order (timestamp, then message id, numeric ids by length)."""

UPSERT_LAST_ANSWERED = """
INSERT INTO chats (chat_key, last_answered_sent_at, last_answered_message_id, last_reply_at, last_job_id)
VALUES ($1, $2, $3, $4, $5)
ON CONFLICT (chat_key) DO UPDATE
SET last_answered_sent_at = EXCLUDED.last_answered_sent_at,
    last_answered_message_id = EXCLUDED.last_answered_message_id,
    last_reply_at = EXCLUDED.last_reply_at, last_job_id = EXCLUDED.last_job_id
WHERE (chats.last_answered_sent_at, length(chats.last_answered_message_id), chats.last_answered_message_id)
    < (EXCLUDED.last_answered_sent_at, length(EXCLUDED.last_answered_message_id),
       EXCLUDED.last_answered_message_id)
"""
