-- The coalescer's first step in filing a message, inside its transaction: take the chat's
-- lock (serialises the chat's messages across replicas), then, under it and so with a
-- snapshot that sees every window committed before, read whether the message is a
-- duplicate for the coalescer (filed already, or past 'queued': taken by a reply — a fold
-- removes its window row —, answered, or with a person; a person's retry puts it back to
-- 'accepted' on purpose), whether it is in the inbox, the database clock, and the chat's
-- open window (locked for update; its columns are NULL when there is none).
CREATE OR REPLACE FUNCTION chatq_lock_chat_window(p_chat_key text, p_operation uuid)
RETURNS TABLE (duplicate boolean, known boolean, now timestamptz, id uuid, first_at timestamptz,
               last_at timestamptz, deadline_at timestamptz, due_at timestamptz, delay_seconds double precision,
               message_count integer)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    w record;
    st text;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended(p_chat_key, 0));
    SELECT cw.id, cw.first_at, cw.last_at, cw.deadline_at, cw.due_at, cw.delay_seconds, cw.message_count
    INTO w
    FROM chat_windows cw WHERE cw.chat_key = p_chat_key AND cw.status = 'open'
    FOR UPDATE;
    SELECT o.status INTO st FROM operations o WHERE o.id = p_operation;
    RETURN QUERY SELECT coalesce(st NOT IN ('accepted', 'queued'), false)
                            OR EXISTS (SELECT 1 FROM window_messages wm WHERE wm.operation_id = p_operation),
                        st IS NOT NULL,
                        clock_timestamp(), w.id, w.first_at, w.last_at, w.deadline_at, w.due_at,
                        w.delay_seconds, w.message_count;
END
$$;

-- A message of the chat received before p_before that is still in transit: stored, not yet
-- filed in a window (in the outbox, or on the broker: behind a backlog, redelivered after
-- a consumer died, or behind a cut connection). The scheduler passes a window's due_at: a
-- message received before the window falls due belongs to it (or to an earlier one), and
-- emitting without it would answer the burst twice, or answer a late message after a
-- later one. The fold-in passes the open window's last_at. Waited for at most 60 s (then
-- the chat goes on and the late message is answered by its next reply).
CREATE OR REPLACE FUNCTION chatq_earlier_in_transit(
    p_platform text, p_account_id text, p_chat_id text, p_before timestamptz
) RETURNS boolean LANGUAGE sql STABLE AS $$
    SELECT EXISTS (
        SELECT 1 FROM operations t
        WHERE t.platform = p_platform AND t.account_id = p_account_id AND t.chat_id = p_chat_id
          AND t.status IN ('accepted', 'queued')
          AND t.received_at < p_before
          AND t.received_at > clock_timestamp() - interval '60 seconds')
$$;
