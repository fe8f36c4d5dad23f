"""Each chat's last answered message: the marker behind the history the reply writer
sees. Written when a reply is recorded and when a person resolves as replied manually;
it only ever moves forward in platform order (chatq_order), by the function in
shared/functions/10_chats.sql."""

#: A person answered these operations ($2) of a chat ($1) through job $3: the latest of
#: them in platform order becomes the marker, if later than the current one.
MARK_ANSWERED = """
SELECT chatq_advance_last_answered($1, o.platform, o.sent_at, o.message_id, o.received_at, now(), $3)
FROM operations o WHERE o.id = ANY($2::uuid[])
ORDER BY chatq_order(o.platform, o.sent_at, o.message_id, o.received_at) DESC
LIMIT 1
"""
