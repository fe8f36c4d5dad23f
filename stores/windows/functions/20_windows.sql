-- chatq:release 1 sha256:2be24ff61ddb4feb
-- The coalescer's one-message lock, kept for the previous release's replicas during a rollout
-- (they file one message a transaction; today's file batches with chatq_lock_chats, under the
-- same per-chat advisory lock). Take the chat's lock, then, under it and so with a snapshot
-- that sees every window committed before, read whether the message is a duplicate for the
-- coalescer, whether it is in the inbox, the database clock, and the chat's open window.
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

-- The coalescer's first step in filing the messages delivered together, inside their one
-- transaction: take the chats' locks (they serialise a chat's messages across replicas) in
-- one order, that of the lock keys, so two replicas filing batches that share chats never
-- wait for each other in a cycle; lock the chats' open windows; then, under the locks and so
-- with a snapshot that sees every window committed before, read for each message (in the
-- order given, one row each) whether it is a duplicate for the coalescer (filed already, or
-- past 'queued': taken by a reply — a fold removes its window row —, answered, or with a
-- person; a person's retry puts it back to 'accepted' on purpose), whether it is in the
-- inbox, the database clock (one reading for the batch), and its chat's open window (its
-- columns are NULL when there is none).
CREATE OR REPLACE FUNCTION chatq_lock_chats(p_chat_keys text[], p_operations uuid[])
RETURNS TABLE (duplicate boolean, known boolean, now timestamptz, id uuid, first_at timestamptz,
               last_at timestamptz, deadline_at timestamptz, due_at timestamptz, delay_seconds double precision,
               message_count integer)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    k bigint;
    v_now timestamptz;
BEGIN
    FOR k IN SELECT DISTINCT hashtextextended(x, 0) FROM unnest(p_chat_keys) x ORDER BY 1 LOOP
        PERFORM pg_advisory_xact_lock(k);
    END LOOP;
    -- The chats' open windows, locked chat by chat (their chats' locks, held, keep any two
    -- batches from waiting for each other), each found by a probe of chat_windows_one_open:
    -- as one statement over the array, a plan cached while the table was empty scanned all
    -- of chat_windows (10 ms a batch at 6,000 rows).
    PERFORM 1 FROM (SELECT DISTINCT x FROM unnest(p_chat_keys) x) k
    CROSS JOIN LATERAL (
        SELECT cw.id FROM chat_windows cw WHERE cw.chat_key = k.x AND cw.status = 'open' LIMIT 1 FOR UPDATE
    ) w;
    v_now := clock_timestamp();
    -- One index probe per message and table (LIMIT 1 keeps each lookup a probe, whatever
    -- the plan cached for the function thinks of the tables' sizes).
    RETURN QUERY
    SELECT coalesce(o.status NOT IN ('accepted', 'queued'), false) OR f.filed IS NOT NULL,
           o.status IS NOT NULL,
           v_now, w.id, w.first_at, w.last_at, w.deadline_at, w.due_at, w.delay_seconds, w.message_count
    FROM unnest(p_chat_keys, p_operations) WITH ORDINALITY AS m(chat_key, op, n)
    LEFT JOIN LATERAL (SELECT o.status FROM operations o WHERE o.id = m.op LIMIT 1) o ON true
    LEFT JOIN LATERAL (SELECT true AS filed FROM window_messages wm WHERE wm.operation_id = m.op LIMIT 1) f ON true
    LEFT JOIN LATERAL (
        SELECT cw.id, cw.first_at, cw.last_at, cw.deadline_at, cw.due_at, cw.delay_seconds, cw.message_count
        FROM chat_windows cw WHERE cw.chat_key = m.chat_key AND cw.status = 'open' LIMIT 1
    ) w ON true
    ORDER BY m.n;
END
$$;

-- The coalescer's write of a batch, in one round trip: the windows as they stand after it
-- (each once: opened by the batch, inserted — blocked while the chat has a reply job in
-- flight or the seller holds it, which the chat's lock, held, serialises with the job's end
-- and the hold's: 40_windows_blocked.sql —, or moved on, updated), each message in its
-- window, and each operation waiting, its record saying for what ('filed', due at the
-- window's due time after that message; or 'held' while the seller holds the chat).
CREATE OR REPLACE FUNCTION chatq_file_messages(
    p_window_ids uuid[], p_opened boolean[], p_chat_keys text[], p_platforms text[], p_account_ids text[],
    p_chat_ids text[], p_first_at timestamptz[], p_last_at timestamptz[], p_deadline_at timestamptz[],
    p_due_at timestamptz[], p_delay_seconds double precision[], p_message_counts integer[],
    p_operations uuid[], p_operation_windows uuid[], p_operation_due_at timestamptz[]
) RETURNS void LANGUAGE plpgsql
-- No statement of this function may read a table by a scan, or by a walk of an index with
-- no condition to descend by (bitmap scans, which read in bulk, off with them): each row it
-- reads or writes is found by its key. Plans made on statistics taken while the tables
-- were small (a quiet minute, the benchmark's warm-up) otherwise prefer reading everything
-- to a few probes (tests/integration/test_filing_cost.py counts the rows read).
SET enable_seqscan = off SET enable_bitmapscan = off
AS $$
BEGIN
    INSERT INTO chat_windows (id, chat_key, platform, account_id, chat_id, status, first_at, last_at,
                              deadline_at, due_at, delay_seconds, message_count, blocked)
    SELECT v.id, v.chat_key, v.platform, v.account_id, v.chat_id, 'open', v.first_at, v.last_at, v.deadline_at,
           v.due_at, v.delay_seconds, v.message_count, j.busy IS NOT NULL OR c.held IS NOT NULL
    FROM unnest(p_window_ids, p_opened, p_chat_keys, p_platforms, p_account_ids, p_chat_ids, p_first_at,
                p_last_at, p_deadline_at, p_due_at, p_delay_seconds, p_message_counts)
         AS v(id, opened, chat_key, platform, account_id, chat_id, first_at, last_at, deadline_at, due_at,
              delay_seconds, message_count)
    -- chatq_chat_blocked, inline, as probes by key (LIMIT 1): written as EXISTS, a plan made
    -- for the batch's real size read every job in flight once into a hashed set (3,000 for
    -- 64 messages, found by a review); as a call, its plans, made under this function's
    -- settings, would be kept for the function's other callers.
    LEFT JOIN LATERAL (
        SELECT true AS busy FROM reply_jobs j
        WHERE j.chat_key = v.chat_key AND j.status IN ('pending', 'processing') LIMIT 1
    ) j ON true
    LEFT JOIN LATERAL (
        SELECT true AS held FROM chats c WHERE c.chat_key = v.chat_key AND c.held_until > clock_timestamp() LIMIT 1
    ) c ON true
    WHERE v.opened;
    -- The windows moved on, by key (id = ANY: one descent each), their values by position.
    UPDATE chat_windows w
    SET last_at = p_last_at[array_position(p_window_ids, w.id)],
        due_at = p_due_at[array_position(p_window_ids, w.id)],
        message_count = p_message_counts[array_position(p_window_ids, w.id)]
    WHERE w.id = ANY(p_window_ids)
      AND (NOT p_opened[array_position(p_window_ids, w.id)]
           AND w.chat_key = p_chat_keys[array_position(p_window_ids, w.id)]) IS TRUE;
    INSERT INTO window_messages (operation_id, window_id)
    SELECT v.op, v.window_id FROM unnest(p_operations, p_operation_windows) AS v(op, window_id);
    INSERT INTO operation_events (operation_id, kind, detail)
    SELECT v.op,
           CASE WHEN c.held_until IS NULL THEN 'filed' ELSE 'held' END,
           CASE WHEN c.held_until IS NULL
                THEN 'filed in the chat''s window, waiting for the buyer to finish typing (due '
                     || to_char(v.due_at AT TIME ZONE 'UTC', 'HH24:MI:SS') || ' UTC)'
                ELSE 'filed in the chat''s window; the seller holds the chat until '
                     || to_char(c.held_until AT TIME ZONE 'UTC', 'HH24:MI') || ' UTC'
           END
    FROM unnest(p_operations, p_operation_windows, p_operation_due_at) WITH ORDINALITY AS v(op, window_id, due_at, n)
    -- Probes by key (LIMIT 1), not a join a stale plan could run as a scan of chat_windows.
    CROSS JOIN LATERAL (SELECT w.chat_key FROM chat_windows w WHERE w.id = v.window_id LIMIT 1) w
    LEFT JOIN LATERAL (
        SELECT c.held_until FROM chats c WHERE c.chat_key = w.chat_key AND c.held_until > now() LIMIT 1
    ) c ON true
    ORDER BY v.n;
    -- Filing comes before any reply: only a message not yet in a window moves. One statement
    -- for the batch (it was one a message, 0.14 ms each under bench.pipeline): an index
    -- scan of the primary key for the ids, one descent each, and no other path. Joined with
    -- unnest(p_operations) instead, a plan made for the real array (a session's first five
    -- calls) ran it as a nested loop over a walk of the whole primary key: every row read,
    -- and each compared with every id (1,064 rows and 68,032 comparisons, 9 ms, for 64
    -- messages). The status test is wrapped (IS TRUE) so that no index by status can serve
    -- it. The rows are locked in key order (the loop locked them in the batch's): a writer
    -- of a message not yet filed takes its chat's lock first (filing holds it) or writes one
    -- row, so none waits on these rows holding another of them; only a job listing a
    -- message never filed, which nothing writes, would lock such rows in its own order, and
    -- a deadlock fails one of the two transactions, retried whole (class 40 is transient).
    UPDATE operations SET status = 'waiting', updated_at = now()
    WHERE id = ANY(p_operations) AND (status = ANY(chatq_operation_sources('waiting'))) IS TRUE;
END
$$;

-- A message of the chat received before p_before that is still in transit: stored, not yet
-- filed in a window (in the outbox, or on the broker: behind a backlog, redelivered after
-- a consumer died, or behind a cut connection). The scheduler passes a window's due_at: a
-- message received before the window falls due belongs to it (or to an earlier one), and
-- emitting without it would answer the burst twice, or answer a late message after a
-- later one. The fold-in passes the open window's last_at. Waited for at most 60 s (then
-- the chat goes on and the late message is answered by its next reply).
-- A SQL function on purpose, planned for its values at each call: as PL/pgSQL its cached
-- generic plan read every message in transit through operations_status_received (1 ms a
-- call against 0.09, pg_stat_user_functions under bench.responder).
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

-- The scheduler's write of the reply jobs of a round, in one round trip (it was four: the
-- jobs, the windows closed, the operations pointed at their jobs with their records, the
-- outbox rows): each job's row (its operations in order: p_op_jobs names each operation's
-- job, in the job's order), each whole job's window closed (p_close: false for a part of a
-- window past the cap, whose closed window the caller wrote), each operation pointed at
-- its job and its record saying so, and each job's outbox row on p_exchange. Every lookup
-- is by key.
CREATE OR REPLACE FUNCTION chatq_emit_jobs(
    p_job_ids uuid[], p_window_ids uuid[], p_chat_keys text[], p_platforms text[], p_account_ids text[],
    p_chat_ids text[], p_close boolean[], p_bodies bytea[], p_op_ids uuid[], p_op_jobs uuid[],
    p_now timestamptz, p_exchange text, p_routing_key text
) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO reply_jobs (id, window_id, chat_key, platform, account_id, chat_id, status, operation_ids,
                            created_at, updated_at)
    SELECT v.id, v.window_id, v.chat_key, v.platform, v.account_id, v.chat_id, 'pending', g.ops, p_now, p_now
    FROM unnest(p_job_ids, p_window_ids, p_chat_keys, p_platforms, p_account_ids, p_chat_ids) WITH ORDINALITY
         AS v(id, window_id, chat_key, platform, account_id, chat_id, n)
    -- A job named with no operation gets none (and the table's checks refuse it), never
    -- silently no row beside its outbox row.
    LEFT JOIN (SELECT o.job, array_agg(o.op ORDER BY o.n) AS ops
               FROM unnest(p_op_ids, p_op_jobs) WITH ORDINALITY AS o(op, job, n) GROUP BY o.job) g ON g.job = v.id
    ORDER BY v.n;
    UPDATE chat_windows w SET status = 'closed', closed_at = p_now, job_id = v.job_id
    FROM (SELECT x.window_id, x.job_id FROM unnest(p_window_ids, p_job_ids, p_close) AS x(window_id, job_id, close)
          WHERE x.close) v
    WHERE w.id = v.window_id AND w.id = ANY(p_window_ids);
    INSERT INTO operation_events (operation_id, kind, detail, job_id)
    SELECT v.op, 'emitted', 'in a reply job: the buyer paused, one reply answers the burst', v.job
    FROM unnest(p_op_ids, p_op_jobs) WITH ORDINALITY AS v(op, job, n)
    ORDER BY v.n;
    UPDATE operations o SET job_id = v.job, updated_at = p_now
    FROM unnest(p_op_ids, p_op_jobs) AS v(op, job)
    WHERE o.id = v.op AND o.id = ANY(p_op_ids);
    INSERT INTO outbox (exchange, routing_key, message_id, ordering_key, headers, body)
    SELECT p_exchange, p_routing_key, v.id::text, v.chat_key, '{}'::jsonb, v.body
    FROM unnest(p_job_ids, p_chat_keys, p_bodies) WITH ORDINALITY AS v(id, chat_key, body, n)
    ORDER BY v.n;
END
$$;
