-- chatq:release 3 sha256:82fd5a1d20f70f1c
-- A chat's next window waits while a reply job of the chat is in flight (pending or
-- processing), and while the seller holds the chat (they answered in person: chats.
-- held_until): it is opened blocked (the coalescer's filing checks, under the chat's lock)
-- and unblocked when the last reason ends: this trigger when the job ends, whoever ends it
-- (a reply recorded, a give-up, a supersede), chatq_unblock_expired_holds when a hold
-- runs out, chatq_resume_chat when a person hands the chat back. Each takes the same chat
-- lock as filing, so a window opened meanwhile is either seen here or sees the change.
-- The scheduler reads ready windows from an index and never scans blocked ones.

-- Whether anything holds the chat's next window back. PL/pgSQL: as a SQL function it
-- could not be inlined (its EXISTS), so it parsed and planned its body at every call
-- (filing calls it for each window it opens); PL/pgSQL keeps the plan, both probes by a
-- unique key (pg_stat_user_functions under bench.responder: 0.08 -> 0.04 ms a call). Not
-- so for every such function: chatq_earlier_in_transit's generic plan walked every
-- message in transit (1 ms a call), so it stays planned for its values.
-- Filing (chatq_file_messages, 20_windows.sql) makes the same two checks inline, as probes
-- in its windows' INSERT: change both together (test_filing_cost.py holds them equal).
CREATE OR REPLACE FUNCTION chatq_chat_blocked(p_chat_key text) RETURNS boolean LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN EXISTS (SELECT 1 FROM reply_jobs j WHERE j.chat_key = p_chat_key AND j.status IN ('pending', 'processing'))
        OR EXISTS (SELECT 1 FROM chats c WHERE c.chat_key = p_chat_key AND c.held_until > clock_timestamp());
END
$$;

CREATE OR REPLACE FUNCTION chatq_unblock_chat_window() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended(NEW.chat_key, 0));
    UPDATE chat_windows SET blocked = false
    WHERE chat_key = NEW.chat_key AND status = 'open' AND blocked
      AND NOT EXISTS (SELECT 1 FROM chats c WHERE c.chat_key = NEW.chat_key AND c.held_until > clock_timestamp());
    RETURN NULL;
END
$$;

CREATE OR REPLACE TRIGGER reply_jobs_unblock_chat_window
    AFTER UPDATE OF status ON reply_jobs
    FOR EACH ROW
    WHEN (OLD.status IN ('pending', 'processing') AND NEW.status NOT IN ('pending', 'processing'))
    EXECUTE FUNCTION chatq_unblock_chat_window();

-- The backstop, run by the job sweeper: any window blocked with nothing holding it back
-- is unblocked (returns how many).
CREATE OR REPLACE FUNCTION chatq_unblock_orphan_windows() RETURNS integer LANGUAGE sql AS $$
    WITH u AS (
        UPDATE chat_windows w SET blocked = false
        WHERE w.status = 'open' AND w.blocked AND NOT chatq_chat_blocked(w.chat_key)
        RETURNING 1)
    SELECT count(*)::int FROM u
$$;

-- Holds that ran out: their chats' windows go on (unless a job still holds them). Cheap:
-- an index on the chats held now. Run by the scheduler on each pass; returns how many
-- windows it unblocked. The chats' locks are taken in the order of their lock keys, the
-- order the coalescer's batches take them in (chatq_lock_chats), so the two never wait
-- for each other in a cycle. The time is read once ((SELECT clock_timestamp())) so that it
-- bounds the scan of chats_held instead of filtering every chat.
CREATE OR REPLACE FUNCTION chatq_unblock_expired_holds() RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
    c record;
    n integer := 0;
    k integer;
BEGIN
    FOR c IN SELECT x.chat_key FROM (
                 SELECT chat_key FROM chats WHERE held_until <= (SELECT clock_timestamp())
                 ORDER BY held_until LIMIT 500
             ) x ORDER BY hashtextextended(x.chat_key, 0) LOOP
        PERFORM pg_advisory_xact_lock(hashtextextended(c.chat_key, 0));
        UPDATE chats SET held_until = NULL WHERE chat_key = c.chat_key AND held_until <= clock_timestamp();
        UPDATE chat_windows SET blocked = false
        WHERE chat_key = c.chat_key AND status = 'open' AND blocked AND NOT chatq_chat_blocked(c.chat_key);
        GET DIAGNOSTICS k = ROW_COUNT;
        n := n + k;
    END LOOP;
    RETURN n;
END
$$;
