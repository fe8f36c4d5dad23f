-- A chat's next window waits while a reply job of the chat is in flight (pending or
-- processing): it is opened blocked (the coalescer's filing checks, under the chat's lock)
-- and this trigger unblocks it when the job ends, whoever ends it (a reply recorded, a
-- give-up, a supersede). It takes the same chat lock as filing, so a window opened while
-- the job ends is either seen here or sees the job ended. The scheduler reads ready
-- windows from an index and never scans blocked ones.
CREATE OR REPLACE FUNCTION chatq_unblock_chat_window() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended(NEW.chat_key, 0));
    UPDATE chat_windows SET blocked = false
    WHERE chat_key = NEW.chat_key AND status = 'open' AND blocked;
    RETURN NULL;
END
$$;

CREATE OR REPLACE TRIGGER reply_jobs_unblock_chat_window
    AFTER UPDATE OF status ON reply_jobs
    FOR EACH ROW
    WHEN (OLD.status IN ('pending', 'processing') AND NEW.status NOT IN ('pending', 'processing'))
    EXECUTE FUNCTION chatq_unblock_chat_window();

-- The backstop, run by the job sweeper: any window blocked with no job of its chat in
-- flight is unblocked (returns how many).
CREATE OR REPLACE FUNCTION chatq_unblock_orphan_windows() RETURNS integer LANGUAGE sql AS $$
    WITH u AS (
        UPDATE chat_windows w SET blocked = false
        WHERE w.status = 'open' AND w.blocked
          AND NOT EXISTS (SELECT 1 FROM reply_jobs j WHERE j.chat_key = w.chat_key AND j.status IN ('pending', 'processing'))
        RETURNING 1)
    SELECT count(*)::int FROM u
$$;
