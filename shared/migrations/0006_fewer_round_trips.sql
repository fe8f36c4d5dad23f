-- Fewer round trips per message. At two cores, round trips (each a pair of context
-- switches and a statement's fixed cost on both sides) were what limited throughput
-- (bench/). The responder's state changes become single statements: each function below
-- is one round trip and one transaction (a statement is atomic), and a reply costs three
-- (claim, before send, record) instead of about twenty. The coalescer files a message in
-- four (begin, chatq_lock_chat_window, one write, commit) instead of twelve.
--
-- Inside the hot functions every table access is a key lookup with a scalar key, so the
-- plan PL/pgSQL caches per connection is right whatever the tables held when it was made.
-- Measured (pg_stat_statements, bench.pipeline): statements over arrays of keys were
-- either planned anew on every call (0.3-0.5 ms each, more than they ran) or, cached
-- while the tables were nearly empty, kept scanning them as they grew (12 ms a claim).

-- Every operation a sent job answered is held by that job in reply_coverage (claim and
-- fold-in take them before sending; only a job that fails without sending gives them
-- back). Jobs sent before 0005 had no rows: give them theirs, so "answered by a sent
-- job" can be an index lookup instead of a scan of every sent job's operation_ids.
INSERT INTO reply_coverage (operation_id, job_id)
SELECT o.id, j.id
FROM reply_jobs j CROSS JOIN LATERAL unnest(j.operation_ids) AS u(id) JOIN operations o ON o.id = u.id
WHERE j.status = 'sent'
ON CONFLICT (operation_id) DO NOTHING;

-- A chat's last answered message only ever moves forward in platform order (timestamp,
-- then message id, numeric ids by length). Used when a reply is recorded and when a
-- person resolves an operation as replied manually.
CREATE FUNCTION chatq_advance_last_answered(
    p_chat_key text, p_sent_at timestamptz, p_message_id text, p_reply_at timestamptz, p_job_id uuid
) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO chats (chat_key, last_answered_sent_at, last_answered_message_id, last_reply_at, last_job_id)
    VALUES (p_chat_key, p_sent_at, p_message_id, p_reply_at, p_job_id)
    ON CONFLICT (chat_key) DO UPDATE
    SET last_answered_sent_at = EXCLUDED.last_answered_sent_at,
        last_answered_message_id = EXCLUDED.last_answered_message_id,
        last_reply_at = EXCLUDED.last_reply_at, last_job_id = EXCLUDED.last_job_id
    WHERE (chats.last_answered_sent_at, length(chats.last_answered_message_id), chats.last_answered_message_id)
        < (EXCLUDED.last_answered_sent_at, length(EXCLUDED.last_answered_message_id),
           EXCLUDED.last_answered_message_id);
END
$$;

-- The messages of a job, in platform order, one row each (position from 1).
CREATE FUNCTION chatq_job_messages(p_ids uuid[])
RETURNS TABLE (pos bigint, operation_id uuid, message_id text, text text, sent_at timestamptz,
               received_at timestamptz)
LANGUAGE sql STABLE AS $$
    SELECT row_number() OVER w, o.id, o.message_id, o.text, coalesce(o.sent_at, o.received_at), o.received_at
    FROM operations o
    WHERE o.id = ANY(p_ids)
    WINDOW w AS (ORDER BY coalesce(o.sent_at, o.received_at), length(o.message_id), o.message_id, o.received_at)
$$;

-- Claim a job for an attempt, taking every decision before any side effect. First the
-- job's session advisory lock (p_lock_key; held across the platform call, released by
-- chatq_record_sent or by the caller): a redelivered copy that arrives while the first
-- handler still runs is refused instead of reconciling a send still in progress.
--   busy       another session holds the job
--   missing    the job is not in the database
--   skip       final already, or every message is answered / held by another reply
--   reconcile  a delivery is 'sending' or 'unknown': the reply may be on the platform
--   claimed    processing; the job holds its messages in reply_coverage; with the chat's
--              last p_history turns before it (buyer messages and our replies, oldest first)
-- One row per message the job keeps (reconcile: all of them), or one row with no message.
CREATE FUNCTION chatq_claim_job(p_job uuid, p_attempt integer, p_lock_key bigint, p_history integer)
RETURNS TABLE (outcome text, reason text, platform text, account_id text, chat_id text,
               delivery_status text, delivery_text text, delivery_started_at timestamptz,
               history_roles text[], history_texts text[],
               pos bigint, operation_id uuid, message_id text, text text, sent_at timestamptz,
               received_at timestamptz)
LANGUAGE plpgsql AS $$
-- Every table access below is a primary-key lookup with a scalar key, one per message
-- (or an insert from a local array), so the plan cached for each statement is an index
-- lookup whatever the tables held when it was made. A statement over an array of keys
-- would be planned anew on each call (0.3-0.5 ms, measured), or, once cached while the
-- tables were nearly empty, keep scanning them as they grow.
#variable_conflict use_column
DECLARE
    j record;
    o record;
    v uuid;
    holder uuid;
    holder_status text;
    last_sent timestamptz;
    last_id text;
    ids uuid[] := '{}';
    stale uuid[] := '{}';
    covered uuid[] := '{}';
    taken uuid[];
    keep uuid[];
    m_message_ids text[] := '{}';
    m_texts text[] := '{}';
    m_sent timestamptz[] := '{}';
    m_received timestamptz[] := '{}';
    first_received timestamptz;
    roles text[] := '{}';
    texts text[] := '{}';
BEGIN
    IF NOT pg_try_advisory_lock(p_lock_key) THEN
        RETURN QUERY SELECT 'busy', NULL::text, NULL::text, NULL::text, NULL::text, NULL::text, NULL::text,
                            NULL::timestamptz, NULL::text[], NULL::text[], NULL::bigint, NULL::uuid,
                            NULL::text, NULL::text, NULL::timestamptz, NULL::timestamptz;
        RETURN;
    END IF;
    SELECT r.status, r.platform, r.account_id, r.chat_id, r.operation_ids, r.chat_key,
           d.status AS d_status, d.text AS d_text, d.started_at AS d_started
    INTO j
    FROM reply_jobs r LEFT JOIN deliveries d ON d.job_id = r.id
    WHERE r.id = p_job
    FOR UPDATE OF r;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'missing', NULL::text, NULL::text, NULL::text, NULL::text, NULL::text, NULL::text,
                            NULL::timestamptz, NULL::text[], NULL::text[], NULL::bigint, NULL::uuid, NULL::text,
                            NULL::text, NULL::timestamptz, NULL::timestamptz;
        RETURN;
    END IF;
    IF j.status IN ('sent', 'failed', 'needs_review', 'superseded') THEN
        RETURN QUERY SELECT 'skip', 'job already ' || j.status, j.platform, j.account_id, j.chat_id,
                            NULL::text, NULL::text, NULL::timestamptz, NULL::text[], NULL::text[], NULL::bigint,
                            NULL::uuid, NULL::text, NULL::text, NULL::timestamptz, NULL::timestamptz;
        RETURN;
    END IF;
    UPDATE reply_jobs SET status = 'processing', attempts = p_attempt, updated_at = now() WHERE id = p_job;

    -- The job's messages, and which are answered already: held by a sent job, or not after
    -- the chat's last answered message (platform order).
    SELECT c.last_answered_sent_at, c.last_answered_message_id INTO last_sent, last_id
    FROM chats c WHERE c.chat_key = j.chat_key;
    FOREACH v IN ARRAY j.operation_ids LOOP
        SELECT op.sent_at, op.message_id, op.text, op.received_at INTO o FROM operations op WHERE op.id = v;
        CONTINUE WHEN NOT FOUND;
        ids := ids || v;
        m_message_ids := m_message_ids || o.message_id;
        m_texts := m_texts || o.text;
        m_sent := m_sent || coalesce(o.sent_at, o.received_at);
        m_received := m_received || o.received_at;
        first_received := least(first_received, o.received_at);
        SELECT rc.job_id INTO holder FROM reply_coverage rc WHERE rc.operation_id = v;
        IF FOUND AND holder <> p_job THEN
            SELECT s.status INTO holder_status FROM reply_jobs s WHERE s.id = holder;
            IF holder_status = 'sent' THEN
                covered := covered || v;
                stale := stale || v;
                CONTINUE;
            END IF;
        END IF;
        IF (o.sent_at, length(o.message_id), o.message_id) <= (last_sent, length(last_id), last_id) THEN
            stale := stale || v;
        END IF;
    END LOOP;

    IF j.d_status IN ('sending', 'unknown') THEN
        keep := ids;
    ELSIF cardinality(stale) = cardinality(ids) THEN
        UPDATE reply_jobs SET status = 'superseded', updated_at = now() WHERE id = p_job;
        FOREACH v IN ARRAY ids LOOP
            UPDATE operations SET status = 'ignored', updated_at = now(),
                   status_reason = CASE WHEN v = ANY(covered)
                       THEN 'already answered by an earlier reply'
                       ELSE 'arrived after a reply to a later message of this chat' END
            WHERE id = v AND status NOT IN ('replied', 'ignored');
        END LOOP;
        RETURN QUERY SELECT 'skip', 'every message was already answered', j.platform, j.account_id, j.chat_id,
                            NULL::text, NULL::text, NULL::timestamptz, NULL::text[], NULL::text[], NULL::bigint,
                            NULL::uuid, NULL::text, NULL::text, NULL::timestamptz, NULL::timestamptz;
        RETURN;
    ELSE
        -- Take the messages for this job; one another job already holds is not ours to
        -- answer (the primary key decides, whatever race brought it here twice).
        WITH ins AS (
            INSERT INTO reply_coverage (operation_id, job_id)
            SELECT x, p_job FROM unnest(ids) AS x WHERE x <> ALL(stale)
            ON CONFLICT (operation_id) DO UPDATE SET job_id = reply_coverage.job_id
            RETURNING reply_coverage.operation_id AS op, reply_coverage.job_id AS holder
        )
        SELECT coalesce(array_agg(op) FILTER (WHERE holder <> p_job), '{}') INTO taken FROM ins;

        keep := ARRAY(SELECT x FROM unnest(ids) AS x WHERE x <> ALL(stale) AND x <> ALL(taken));
        IF cardinality(stale) > 0 OR cardinality(taken) > 0 THEN
            -- Late messages (older than a reply already sent) would reorder the chat;
            -- messages another reply holds would be answered twice. The job keeps the rest.
            FOREACH v IN ARRAY stale LOOP
                UPDATE operations SET status = 'ignored', job_id = NULL, updated_at = now(),
                       status_reason = 'arrived after a reply to a later message of this chat'
                WHERE id = v AND status NOT IN ('replied', 'ignored');
            END LOOP;
            IF cardinality(keep) = 0 THEN
                UPDATE reply_jobs SET status = 'superseded', updated_at = now() WHERE id = p_job;
                RETURN QUERY SELECT 'skip', 'every message is answered or held by another reply', j.platform,
                                    j.account_id, j.chat_id, NULL::text, NULL::text, NULL::timestamptz,
                                    NULL::text[], NULL::text[], NULL::bigint, NULL::uuid, NULL::text, NULL::text,
                                    NULL::timestamptz, NULL::timestamptz;
                RETURN;
            END IF;
            UPDATE reply_jobs
            SET operation_ids = ARRAY(
                SELECT t.id FROM unnest(ids, m_message_ids, m_sent, m_received) AS t(id, mid, sent, recv)
                WHERE t.id = ANY(keep) ORDER BY t.sent, length(t.mid), t.mid, t.recv)
            WHERE id = p_job;
        END IF;
        FOREACH v IN ARRAY keep LOOP
            UPDATE operations SET status = 'replying', updated_at = now()
            WHERE id = v AND status IN ('accepted', 'queued', 'waiting', 'replying');
        END LOOP;

        -- The conversation so far, for the model: turns before this job's messages. A chat
        -- with no reply yet (no chats row) has none. Planned for its values each time
        -- (EXECUTE): its best plan depends on how much the chat has said.
        IF p_history > 0 AND last_sent IS NOT NULL THEN
            EXECUTE $q$
                SELECT coalesce(array_agg(t.role ORDER BY t.at), '{}'), coalesce(array_agg(t.body ORDER BY t.at), '{}')
                FROM (
                    SELECT h.role, h.body, h.at FROM (
                        SELECT 'buyer' AS role, o.text AS body, o.received_at AS at FROM operations o
                        WHERE o.platform = $1 AND o.account_id = $2 AND o.chat_id = $3
                          AND o.status = 'replied' AND o.received_at < $4
                        UNION ALL
                        SELECT 'bot', s.reply_text, s.sent_at FROM reply_jobs s
                        WHERE s.chat_key = $5 AND s.status = 'sent' AND s.sent_at < $4
                    ) h
                    ORDER BY h.at DESC LIMIT $6
                ) t
            $q$ INTO roles, texts
            USING j.platform, j.account_id, j.chat_id, first_received, j.chat_key, p_history;
        END IF;
    END IF;

    -- The messages kept, in platform order, from what was read above (no table access).
    RETURN QUERY
        SELECT CASE WHEN j.d_status IN ('sending', 'unknown') THEN 'reconcile' ELSE 'claimed' END,
               NULL::text, j.platform, j.account_id, j.chat_id,
               CASE WHEN j.d_status IN ('sending', 'unknown') THEN j.d_status END,
               CASE WHEN j.d_status IN ('sending', 'unknown') THEN j.d_text END,
               CASE WHEN j.d_status IN ('sending', 'unknown') THEN j.d_started END,
               roles, texts,
               row_number() OVER w, t.id, t.mid, t.body, t.sent, t.recv
        FROM unnest(ids, m_message_ids, m_texts, m_sent, m_received) AS t(id, mid, body, sent, recv)
        WHERE t.id = ANY(keep)
        WINDOW w AS (ORDER BY t.sent, length(t.mid), t.mid, t.recv)
        ORDER BY t.sent, length(t.mid), t.mid, t.recv;
END
$$;

-- Just before the platform call: move the messages gathered in the chat's open window
-- since the job was built into the job (when p_fold), so one reply covers them; if there
-- were none, record the delivery intent ('sending', committed before the platform is
-- called: from then on the send may have happened). Same per-chat lock as the coalescer.
-- Returns the messages folded in; none means the intent is recorded.
CREATE FUNCTION chatq_before_send(p_job uuid, p_chat_key text, p_text text, p_attempt integer, p_fold boolean)
RETURNS TABLE (pos bigint, operation_id uuid, message_id text, text text, sent_at timestamptz,
               received_at timestamptz)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    w uuid;
    ids uuid[] := '{}';
BEGIN
    IF p_fold THEN
        PERFORM pg_advisory_xact_lock(hashtextextended(p_chat_key, 0));
        SELECT cw.id INTO w FROM chat_windows cw WHERE cw.chat_key = p_chat_key AND cw.status = 'open' FOR UPDATE;
        IF FOUND THEN
            WITH del AS (DELETE FROM window_messages wm WHERE wm.window_id = w RETURNING wm.operation_id)
            SELECT coalesce(array_agg(del.operation_id), '{}') INTO ids FROM del;
            DELETE FROM chat_windows WHERE id = w;
            WITH ins AS (
                INSERT INTO reply_coverage (operation_id, job_id) SELECT x, p_job FROM unnest(ids) AS x
                ON CONFLICT (operation_id) DO NOTHING RETURNING reply_coverage.operation_id AS op
            )
            SELECT coalesce(array_agg(op), '{}') INTO ids FROM ins;
        END IF;
    END IF;
    IF cardinality(ids) > 0 THEN
        UPDATE reply_jobs SET operation_ids = operation_ids || ids, folded = folded + 1, updated_at = now()
        WHERE id = p_job;
        UPDATE operations SET job_id = p_job, status = 'replying', updated_at = now() WHERE id = ANY(ids);
        RETURN QUERY SELECT m.* FROM chatq_job_messages(ids) m ORDER BY m.pos;
        RETURN;
    END IF;
    INSERT INTO deliveries (job_id, status, text, attempt, started_at)
    VALUES (p_job, 'sending', p_text, p_attempt, now())
    ON CONFLICT (job_id) DO UPDATE
    SET status = 'sending', text = EXCLUDED.text, attempt = EXCLUDED.attempt,
        started_at = now(), finished_at = NULL, error = NULL;
END
$$;

-- Record a reply on the platform: the job, its delivery, the operations it covers and the
-- chat's last answered message move together. Returns when it was sent and when each
-- operation it newly replied to was received (for the receipt-to-reply histogram). Then
-- releases the job's session lock (p_lock_key): the job is final once this commits, and a
-- copy that takes the lock before the commit waits on the job's row, then skips it.
CREATE FUNCTION chatq_record_sent(
    p_job uuid, p_text text, p_platform_message_id text, p_last_sent_at timestamptz, p_last_message_id text,
    p_lock_key bigint
) RETURNS TABLE (sent_at timestamptz, received_ats timestamptz[])
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    j record;
    v uuid;
    recv_at timestamptz;
    received timestamptz[] := '{}';
BEGIN
    UPDATE reply_jobs r SET status = 'sent', reply_text = p_text, platform_message_id = p_platform_message_id,
           sent_at = clock_timestamp(), error_kind = NULL, error_message = NULL, updated_at = now()
    WHERE r.id = p_job
    RETURNING r.sent_at AS at, r.chat_key, r.operation_ids INTO j;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'job % is not in the database', p_job;
    END IF;
    UPDATE deliveries d SET status = 'sent', platform_message_id = p_platform_message_id, finished_at = j.at,
           error = NULL
    WHERE d.job_id = p_job;
    PERFORM chatq_advance_last_answered(j.chat_key, p_last_sent_at, p_last_message_id, j.at, p_job);
    -- One key lookup per operation (see chatq_claim_job on plans over arrays of keys).
    FOREACH v IN ARRAY j.operation_ids LOOP
        UPDATE operations o SET status = 'replied', status_reason = NULL, updated_at = j.at
        WHERE o.id = v AND o.status <> 'replied'
        RETURNING o.received_at INTO recv_at;
        IF FOUND THEN
            received := received || recv_at;
        END IF;
    END LOOP;
    PERFORM pg_advisory_unlock(p_lock_key);
    RETURN QUERY SELECT j.at, received;
END
$$;

-- The coalescer's first step in filing a message, inside its transaction: take the chat's
-- lock (serialises the chat's messages across replicas), then, under it and so with a
-- snapshot that sees every window committed before, read whether the message is filed
-- already, whether it is in the inbox, the database clock, and the chat's open window
-- (locked for update; its columns are NULL when there is none).
CREATE FUNCTION chatq_lock_chat_window(p_chat_key text, p_operation uuid)
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
