-- The coalescer's first step in filing a message, inside its transaction: take the chat's
-- lock (serialises the chat's messages across replicas), then, under it and so with a
-- snapshot that sees every window committed before, read whether the message is filed
-- already, whether it is in the inbox, the database clock, and the chat's open window
-- (locked for update; its columns are NULL when there is none).
CREATE OR REPLACE FUNCTION chatq_lock_chat_window(p_chat_key text, p_operation uuid)
RETURNS TABLE (duplicate boolean, known boolean, now timestamptz, id uuid, first_at timestamptz,
               last_at timestamptz, deadline_at timestamptz, due_at timestamptz, delay_seconds double precision,
               message_count integer)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    w record;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended(p_chat_key, 0));
    SELECT cw.id, cw.first_at, cw.last_at, cw.deadline_at, cw.due_at, cw.delay_seconds, cw.message_count
    INTO w
    FROM chat_windows cw WHERE cw.chat_key = p_chat_key AND cw.status = 'open'
    FOR UPDATE;
    RETURN QUERY SELECT EXISTS (SELECT 1 FROM window_messages wm WHERE wm.operation_id = p_operation),
                        EXISTS (SELECT 1 FROM operations o WHERE o.id = p_operation),
                        clock_timestamp(), w.id, w.first_at, w.last_at, w.deadline_at, w.due_at,
                        w.delay_seconds, w.message_count;
END
$$;
