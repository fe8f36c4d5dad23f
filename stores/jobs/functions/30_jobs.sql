-- chatq:release 4 sha256:a2f4082205e98cce
-- The reply job aggregate: claim, before send, record, give up. Each is one statement, so
-- one round trip and one transaction; a reply costs three (claim, before send, record).
--
-- Inside the hot functions every table access is a key lookup with a scalar key, so the
-- plan PL/pgSQL caches per connection is right whatever the tables held when it was made.
-- Measured (pg_stat_statements, bench.pipeline): statements over arrays of keys were
-- either planned anew on every call (0.3-0.5 ms each, more than they ran) or, cached
-- while the tables were nearly empty, kept scanning them as they grew (12 ms a claim).
--
-- Status changes follow the tables of shared/state (chatq_*_sources, and the trigger of
-- 00_states.sql refuses any other). A message is answered when a sent job holds it in
-- reply_coverage (a primary key: one reply per message, whatever race brought it to two
-- jobs); nothing else makes a buyer message "answered".

-- The messages of a job, in platform order (chatq_order), one row each (position from 1).
CREATE OR REPLACE FUNCTION chatq_job_messages(p_ids uuid[])
RETURNS TABLE (pos bigint, operation_id uuid, message_id text, text text, sent_at timestamptz,
               received_at timestamptz)
LANGUAGE sql STABLE AS $$
    SELECT row_number() OVER w, o.id, o.message_id, o.text, o.sent_at, o.received_at
    FROM operations o
    WHERE o.id = ANY(p_ids)
    WINDOW w AS (ORDER BY chatq_order(o.platform, o.sent_at, o.message_id, o.received_at))
$$;

-- A chat's last p_history turns before p_before, oldest first: its buyer messages answered
-- and its replies sent. A chat with no reply yet (no chats row) has none. Planned for its
-- values each time (EXECUTE): its best plan depends on how much the chat has said.
CREATE OR REPLACE FUNCTION chatq_chat_history(
    p_platform text, p_account_id text, p_chat_id text, p_chat_key text, p_before timestamptz, p_history integer
) RETURNS chatq_turn[] LANGUAGE plpgsql AS $$
DECLARE
    turns chatq_turn[];
BEGIN
    IF p_history <= 0 OR NOT EXISTS (SELECT 1 FROM chats c WHERE c.chat_key = p_chat_key) THEN
        RETURN NULL;
    END IF;
    EXECUTE $q$
                SELECT coalesce(array_agg(ROW(t.role, t.body)::chatq_turn ORDER BY t.at), '{}')
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
    $q$ INTO turns
    USING p_platform, p_account_id, p_chat_id, p_before, p_chat_key, p_history;
    RETURN turns;
END
$$;

-- Withdraw a job nobody has sent yet when the seller answered its chat in person after it
-- was built (chats.seller_wrote_at): superseded, its unfinished messages 'replied',
-- "answered by the seller". Returns whether it did. The caller holds the job. A job a send
-- of which may have reached the chat (chatq_delivery_may_have_sent: a part of it out, an
-- unknown outcome) is never withdrawn: it is the bot's to finish, or a person's to check;
-- withdrawn, it left the buyer half an answer, or a reply nobody accounted for (issue 40).
CREATE OR REPLACE FUNCTION chatq_withdraw_if_seller_answered(
    p_job uuid, p_chat_key text, p_created timestamptz, p_ops uuid[]
) RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
    msg text;
BEGIN
    SELECT c.seller_message_id INTO msg FROM chats c WHERE c.chat_key = p_chat_key AND c.seller_wrote_at > p_created;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    IF EXISTS (SELECT 1 FROM deliveries d WHERE d.job_id = p_job
               AND chatq_delivery_may_have_sent(d.status, d.maybe_sent)) THEN
        RETURN false;
    END IF;
    UPDATE reply_jobs SET status = 'superseded', updated_at = now(),
           error_message = 'withdrawn: answered by the seller (message ' || msg || ')'
    WHERE id = p_job AND status IN ('pending', 'processing');
    DELETE FROM reply_coverage WHERE job_id = p_job;
    PERFORM chatq_answered_by_seller(
        p_ops, 'answered by the seller (message ' || msg || ')',
        'answered by the seller (message ' || msg || '); the reply was withdrawn', p_job);
    RETURN true;
END
$$;

-- Claim a job for an attempt, taking every decision before any side effect. First the
-- job's session advisory lock (p_lock_key; held across the platform call, released by
-- chatq_record_sent or by the caller): a redelivered copy that arrives while the first
-- handler still runs is refused instead of reconciling a send still in progress.
--   busy       another session holds the job
--   missing    the job is not in the database
--   skip       final already (reason says which), or every message is answered or held by
--              another reply (the job is superseded)
--   reconcile  a delivery is 'sending' or 'unknown': the reply may be on the platform
--   claimed    processing; the job holds its messages in reply_coverage
-- With account_paused: the job's account is paused (why), so nothing may be sent now.
-- business_connection_id: the Telegram Business connection the reply goes through (the
-- latest one among the job's messages), or NULL.
-- One value of the composite type chatq_claim_result (migration 0019), read by name:
-- outcome and reason always; the job's fields once it is found; delivery (the attempt
-- that may have sent) for reconcile; the job's messages (reconcile: all of them; claimed:
-- those it keeps) in platform order, with the chat's last p_history turns before them.
CREATE OR REPLACE FUNCTION chatq_claim_job(p_job uuid, p_attempt integer, p_lock_key bigint, p_history integer)
RETURNS chatq_claim_result
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    r chatq_claim_result;
    j record;
    o record;
    v uuid;
    holder uuid;
    reconciling boolean;
    ids uuid[] := '{}';
    m_ids text[] := '{}';
    m_texts text[] := '{}';
    m_sent timestamptz[] := '{}';
    m_received timestamptz[] := '{}';
    taken uuid[];
    first_received timestamptz;
BEGIN
    IF NOT pg_try_advisory_lock(p_lock_key) THEN
        r.outcome := 'busy';
        r.reason := 'another consumer is handling this job';
        RETURN r;
    END IF;
    -- The chat's lock before the job's row (see chatq_give_up).
    PERFORM pg_advisory_xact_lock(hashtextextended(x.chat_key, 0)) FROM reply_jobs x WHERE x.id = p_job;
    SELECT r.status, r.platform, r.account_id, r.chat_id, r.operation_ids AS ops, r.chat_key AS ck,
           r.created_at AS created, d.status AS d_status, d.text AS d_text, d.started_at AS d_started,
           coalesce(d.maybe_sent, false) AS d_maybe, d.maybe_since AS d_since
    INTO j
    FROM reply_jobs r LEFT JOIN deliveries d ON d.job_id = r.id
    WHERE r.id = p_job
    FOR UPDATE OF r;
    IF NOT FOUND THEN
        r.outcome := 'missing';
        RETURN r;
    END IF;
    r.platform := j.platform;
    r.account_id := j.account_id;
    r.chat_id := j.chat_id;
    r.chat_key := j.ck;
    -- Why the job's account may not send now (NULL: it may).
    SELECT a.state_reason INTO r.account_paused FROM accounts a
    WHERE a.platform = j.platform AND a.account_id = j.account_id AND a.state <> 'active';
    IF j.status NOT IN ('pending', 'processing') THEN
        r.outcome := 'skip';
        r.reason := 'job already ' || j.status;
        RETURN r;
    END IF;
    -- An attempt of this job may have reached the platform (its delivery says so now, or
    -- did once): whatever the latest attempt did, the reply may be there.
    -- (A job with no delivery yet has no status to compare: false, not NULL, or every
    -- check below that asks "NOT reconciling" would be skipped.)
    reconciling := chatq_delivery_may_have_sent(j.d_status, j.d_maybe);
    IF NOT reconciling AND chatq_withdraw_if_seller_answered(p_job, j.ck, j.created, j.ops) THEN
        r.outcome := 'skip';
        r.reason := 'withdrawn: the seller answered the chat in person';
        RETURN r;
    END IF;
    UPDATE reply_jobs r SET status = 'processing', attempts = p_attempt, updated_at = now() WHERE r.id = p_job;

    -- The job's messages. After an interrupted send every one stays (the reply that may be
    -- on the platform covers them all). Otherwise the job keeps those still unanswered
    -- that no other reply holds.
    FOREACH v IN ARRAY j.ops LOOP
        SELECT op.status, op.message_id, op.text, op.sent_at AS sent, op.received_at, op.job_id,
               op.business_connection_id AS bc
        INTO o FROM operations op WHERE op.id = v;
        CONTINUE WHEN NOT FOUND;
        r.business_connection_id := coalesce(o.bc, r.business_connection_id);
        IF NOT reconciling THEN
            SELECT rc.job_id INTO holder FROM reply_coverage rc WHERE rc.operation_id = v;
            IF FOUND AND holder <> p_job THEN
                IF o.job_id = p_job THEN
                    UPDATE operations op SET job_id = holder WHERE op.id = v;
                END IF;
                CONTINUE;
            END IF;
            CONTINUE WHEN o.status NOT IN ('accepted', 'queued', 'waiting', 'replying');
        END IF;
        ids := ids || v;
        m_ids := m_ids || o.message_id;
        m_texts := m_texts || o.text;
        m_sent := m_sent || o.sent;
        m_received := m_received || o.received_at;
        first_received := least(first_received, o.received_at);
    END LOOP;

    IF reconciling THEN
        PERFORM chatq_log(ids, 'attempt', 'attempt ' || p_attempt || ': a send of this reply may have reached the chat; '
                          || 'checking before anything more is sent', p_job);
        r.outcome := 'reconcile';
        r.delivery := ROW(CASE WHEN chatq_delivery_may_have_sent(j.d_status, false) THEN j.d_status ELSE 'unknown' END,
                          j.d_text, j.d_started, coalesce(j.d_since, j.d_started))::chatq_claimed_delivery;
    ELSE
        -- Take the messages; one another job took meanwhile is not ours to answer (the
        -- primary key decides).
        WITH ins AS (
            INSERT INTO reply_coverage (operation_id, job_id)
            SELECT x, p_job FROM unnest(ids) AS x
            ON CONFLICT (operation_id) DO UPDATE SET job_id = reply_coverage.job_id
            RETURNING reply_coverage.operation_id AS op, reply_coverage.job_id AS h
        )
        SELECT coalesce(array_agg(op) FILTER (WHERE h <> p_job), '{}') INTO taken FROM ins;
        IF cardinality(taken) > 0 THEN
            SELECT coalesce(array_agg(t.id), '{}'), coalesce(array_agg(t.mid), '{}'),
                   coalesce(array_agg(t.body), '{}'), coalesce(array_agg(t.sent), '{}'),
                   coalesce(array_agg(t.recv), '{}')
            INTO ids, m_ids, m_texts, m_sent, m_received
            FROM unnest(ids, m_ids, m_texts, m_sent, m_received) AS t(id, mid, body, sent, recv)
            WHERE t.id <> ALL(taken);
        END IF;
        IF cardinality(ids) = 0 THEN
            UPDATE reply_jobs r SET status = 'superseded', updated_at = now() WHERE r.id = p_job;
            r.outcome := 'skip';
            r.reason := 'every message is answered or held by another reply';
            RETURN r;
        END IF;
        -- A message filed ('waiting') reads 'replying' from its coverage row
        -- (chatq_shown_status): its row is written only if another job's id is on it. One
        -- not yet filed (accepted, queued) is moved on, or its filing would take it again.
        -- By key, one at a time: written set-based (id = ANY(ids) and a status filter), it
        -- doubled Postgres' CPU per reply in bench.pipeline (the plan was not caught).
        FOREACH v IN ARRAY ids LOOP
            UPDATE operations op
            SET job_id = p_job, updated_at = now(),
                status = CASE WHEN op.status = 'waiting' THEN op.status ELSE 'replying' END
            WHERE op.id = v AND (op.status IN ('accepted', 'queued') OR op.job_id IS DISTINCT FROM p_job)
              AND op.status = ANY(chatq_operation_sources('replying'));
        END LOOP;
        PERFORM chatq_log(ids, 'attempt', 'attempt ' || p_attempt || ': writing the reply', p_job);
        IF cardinality(ids) <> cardinality(j.ops) THEN
            UPDATE reply_jobs r
            SET operation_ids = ARRAY(
                SELECT t.id FROM unnest(ids, m_ids, m_sent, m_received) AS t(id, mid, sent, recv)
                ORDER BY chatq_order(j.platform, t.sent, t.mid, t.recv))
            WHERE r.id = p_job;
        END IF;
        r.outcome := 'claimed';

        -- The conversation so far, for the model: turns before this job's messages.
        r.history := chatq_chat_history(j.platform, j.account_id, j.chat_id, j.ck, first_received, p_history);
    END IF;

    -- The messages kept, in platform order, from what was read above (no table access).
    SELECT array_agg(ROW(t.id, t.mid, t.body, t.sent, t.recv)::chatq_job_message ORDER BY t.o)
    INTO r.messages
    FROM (SELECT u.*, chatq_order(j.platform, u.sent, u.mid, u.recv) AS o
          FROM unnest(ids, m_ids, m_texts, m_sent, m_received) AS u(id, mid, body, sent, recv)) t;
    RETURN r;
END
$$;

-- The chat locks of a batch of jobs (each chat's once), in the order of their lock keys,
-- for the rest of the transaction: every taker of several chats' locks takes them in that
-- order (chatq_lock_chats, the claim, before-send and record batches,
-- chatq_unblock_expired_holds), so no two wait for each other in a cycle. Ending a job
-- takes its chat's lock (the trigger that unblocks the chat's next window): a batch that
-- may end jobs of several chats takes them all first. One probe by key a job.
CREATE OR REPLACE FUNCTION chatq_lock_chats_of_jobs(p_jobs uuid[]) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(k.key) FROM (
        SELECT DISTINCT hashtextextended(r.chat_key, 0) AS key
        FROM unnest(p_jobs) AS x(job)
        CROSS JOIN LATERAL (SELECT r.chat_key FROM reply_jobs r WHERE r.id = x.job LIMIT 1) r
        ORDER BY 1
    ) k;
END
$$;

-- chatq_claim_job for the jobs of one responder connection that are claimed together: one
-- round trip, one transaction, and for the jobs that take the common way (in flight, no
-- send of theirs that may have reached the chat, the seller not in the chat since they
-- were built) one statement for each table it writes, whatever the number of jobs (a
-- statement per job cost more than its rows; pg_stat_user_functions under bench.pipeline:
-- the claim was 0.70 ms of Postgres per reply, one job at a time). Row i is job i's, the
-- same value chatq_claim_job returns for it, and the same writes. A job off the common
-- way (missing, final, to reconcile, to withdraw) is claimed by chatq_claim_job itself,
-- alone, in the same transaction.
--
-- Each table is read and written by its key (id = ANY; a status is checked only on the
-- rows found, "IS TRUE", as in chatq_record_sent_many). A message in two jobs of the batch
-- (a race coverage settles) is kept by the first, as the one-by-one claims would, because
-- the coverage row the first wrote would be read by the second.
CREATE OR REPLACE FUNCTION chatq_claim_jobs(p_jobs uuid[], p_attempts integer[], p_lock_keys bigint[], p_history integer)
RETURNS TABLE (i integer, claim chatq_claim_result)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    n integer := cardinality(p_jobs);
    got boolean[];
    held uuid[] := '{}';
    r chatq_claim_result;
    -- The jobs claimed the common way (k = 1..), with their index in p_jobs.
    cj uuid[];
    ci integer[];
    cplat text[];
    cacct text[];
    cchat text[];
    cck text[];
    cops_n integer[];
    cpaused text[];
    cbc text[];
    -- Their messages, job after job, each job's in its own order (fk: the job's k).
    fo uuid[];
    fk integer[];
    -- What the messages are now, and who holds them.
    rid uuid[];
    rstatus text[];
    rmid text[];
    rtext text[];
    rsent timestamptz[];
    rrecv timestamptz[];
    rjob uuid[];
    rbc text[];
    hop uuid[];
    hjob uuid[];
    -- The messages kept (in the order above), and those to write.
    k_op uuid[] := '{}';
    k_k integer[] := '{}';
    k_mid text[] := '{}';
    k_text text[] := '{}';
    k_sent timestamptz[] := '{}';
    k_recv timestamptz[] := '{}';
    w_op uuid[] := '{}';
    w_k integer[] := '{}';
    m_op uuid[] := '{}';
    m_holder uuid[] := '{}';
    taken uuid[];
    kept_n integer[];
    cfirst timestamptz[];
    x integer;
    p integer;
    v uuid;
    holder uuid;
BEGIN
    IF n = 0 THEN
        RETURN;
    END IF;
    -- Every chat's lock of the batch first: a job this claim ends (superseded, withdrawn)
    -- takes its chat's lock through the trigger that unblocks the chat's next window, and
    -- taken then, in the batch's order, a lock after a higher key deadlocked with a filing
    -- of both chats (issue 40; test_claim_batch.py holds it).
    PERFORM chatq_lock_chats_of_jobs(p_jobs);
    SELECT array_agg(pg_try_advisory_lock(t.k) ORDER BY t.n) INTO got
    FROM unnest(p_lock_keys) WITH ORDINALITY AS t(k, n);
    FOR x IN 1 .. n LOOP
        IF got[x] THEN
            held := held || p_jobs[x];
        END IF;
    END LOOP;

    -- The common way: the job moves to processing in the statement that decides it may.
    WITH u AS (
        UPDATE reply_jobs r SET status = 'processing', attempts = p_attempts[array_position(p_jobs, r.id)],
               updated_at = now()
        WHERE r.id = ANY(held) AND (r.status IN ('pending', 'processing')) IS TRUE
          AND NOT EXISTS (SELECT 1 FROM deliveries d WHERE d.job_id = r.id
                          AND chatq_delivery_may_have_sent(d.status, d.maybe_sent))
          AND NOT EXISTS (SELECT 1 FROM chats c WHERE c.chat_key = r.chat_key
                          AND (c.seller_wrote_at > r.created_at) IS TRUE)
        RETURNING r.id, r.platform, r.account_id, r.chat_id, r.chat_key, r.operation_ids
    ), ordered AS (
        SELECT u.*, array_position(p_jobs, u.id) AS pi FROM u
    )
    SELECT array_agg(o.id ORDER BY o.pi), array_agg(o.pi ORDER BY o.pi), array_agg(o.platform ORDER BY o.pi),
           array_agg(o.account_id ORDER BY o.pi), array_agg(o.chat_id ORDER BY o.pi),
           array_agg(o.chat_key ORDER BY o.pi), array_agg(cardinality(o.operation_ids) ORDER BY o.pi),
           (SELECT array_agg(x.op ORDER BY q.pi, x.m) FROM ordered q, unnest(q.operation_ids) WITH ORDINALITY x(op, m)),
           (SELECT array_agg(q.k ORDER BY q.pi, x.m)
            FROM (SELECT q.*, row_number() OVER (ORDER BY q.pi)::integer AS k FROM ordered q) q,
                 unnest(q.operation_ids) WITH ORDINALITY x(op, m))
    INTO cj, ci, cplat, cacct, cchat, cck, cops_n, fo, fk
    FROM ordered o;
    cj := coalesce(cj, '{}');
    fo := coalesce(fo, '{}');

    IF cardinality(cj) > 0 THEN
        -- Why each job's account may not send now (NULL: it may).
        cpaused := ARRAY(
            SELECT (SELECT a.state_reason FROM accounts a
                    WHERE a.platform = t.p AND a.account_id = t.a AND a.state <> 'active')
            FROM unnest(cplat, cacct) WITH ORDINALITY AS t(p, a, k) ORDER BY t.k);
        cbc := array_fill(NULL::text, ARRAY[cardinality(cj)]);
        SELECT array_agg(o.id), array_agg(o.status), array_agg(o.message_id), array_agg(o.text),
               array_agg(o.sent_at), array_agg(o.received_at), array_agg(o.job_id),
               array_agg(o.business_connection_id)
        INTO rid, rstatus, rmid, rtext, rsent, rrecv, rjob, rbc
        FROM operations o WHERE o.id = ANY(fo);
        SELECT array_agg(rc.operation_id), array_agg(rc.job_id) INTO hop, hjob
        FROM reply_coverage rc WHERE rc.operation_id = ANY(fo);
        rid := coalesce(rid, '{}');
        hop := coalesce(hop, '{}');

        -- Each job keeps its messages still unanswered that no other reply holds.
        FOR x IN 1 .. coalesce(cardinality(fo), 0) LOOP
            v := fo[x];
            p := array_position(rid, v);
            CONTINUE WHEN p IS NULL;
            cbc[fk[x]] := coalesce(rbc[p], cbc[fk[x]]);
            holder := hjob[array_position(hop, v)];
            IF holder IS NULL AND array_position(k_op, v) IS NOT NULL THEN
                holder := cj[k_k[array_position(k_op, v)]];
            END IF;
            IF holder IS NOT NULL AND holder <> cj[fk[x]] THEN
                IF rjob[p] = cj[fk[x]] THEN
                    m_op := m_op || v;
                    m_holder := m_holder || holder;
                END IF;
                CONTINUE;
            END IF;
            CONTINUE WHEN rstatus[p] NOT IN ('accepted', 'queued', 'waiting', 'replying');
            k_op := k_op || v;
            k_k := k_k || fk[x];
            k_mid := k_mid || rmid[p];
            k_text := k_text || rtext[p];
            k_sent := k_sent || rsent[p];
            k_recv := k_recv || rrecv[p];
            IF rstatus[p] IN ('accepted', 'queued') OR rjob[p] IS DISTINCT FROM cj[fk[x]] THEN
                w_op := w_op || v;
                w_k := w_k || fk[x];
            END IF;
        END LOOP;
        IF cardinality(m_op) > 0 THEN
            UPDATE operations op SET job_id = m_holder[array_position(m_op, op.id)]
            WHERE op.id = ANY(m_op);
        END IF;

        -- The first received of each job's messages kept so far: where its history ends.
        cfirst := ARRAY(SELECT (SELECT min(t.recv) FROM unnest(k_k, k_recv) AS t(k, recv) WHERE t.k = g)
                        FROM generate_series(1, cardinality(cj)) AS g ORDER BY g);

        -- Take the messages; one another job took meanwhile is not ours to answer (the
        -- primary key decides).
        IF cardinality(k_op) > 0 THEN
            WITH ins AS (
                INSERT INTO reply_coverage (operation_id, job_id)
                SELECT t.op, cj[t.k] FROM unnest(k_op, k_k) AS t(op, k)
                ON CONFLICT (operation_id) DO UPDATE SET job_id = reply_coverage.job_id
                RETURNING reply_coverage.operation_id AS op, reply_coverage.job_id AS h
            )
            SELECT coalesce(array_agg(ins.op) FILTER (WHERE ins.h <> cj[k_k[array_position(k_op, ins.op)]]), '{}')
            INTO taken FROM ins;
            IF cardinality(taken) > 0 THEN
                SELECT coalesce(array_agg(t.op ORDER BY t.n), '{}'), coalesce(array_agg(t.k ORDER BY t.n), '{}'),
                       coalesce(array_agg(t.mid ORDER BY t.n), '{}'), coalesce(array_agg(t.body ORDER BY t.n), '{}'),
                       coalesce(array_agg(t.sent ORDER BY t.n), '{}'), coalesce(array_agg(t.recv ORDER BY t.n), '{}')
                INTO k_op, k_k, k_mid, k_text, k_sent, k_recv
                FROM unnest(k_op, k_k, k_mid, k_text, k_sent, k_recv) WITH ORDINALITY AS t(op, k, mid, body, sent, recv, n)
                WHERE t.op <> ALL(taken);
                SELECT coalesce(array_agg(t.op ORDER BY t.n), '{}'), coalesce(array_agg(t.k ORDER BY t.n), '{}')
                INTO w_op, w_k
                FROM unnest(w_op, w_k) WITH ORDINALITY AS t(op, k, n) WHERE t.op <> ALL(taken);
            END IF;
        END IF;
        kept_n := ARRAY(SELECT (SELECT count(*) FROM unnest(k_k) AS q(k) WHERE q.k = g)::integer
                        FROM generate_series(1, cardinality(cj)) AS g ORDER BY g);

        -- A job left with no message is superseded.
        IF 0 = ANY(kept_n) THEN
            UPDATE reply_jobs r SET status = 'superseded', updated_at = now()
            WHERE r.id = ANY(ARRAY(SELECT cj[g] FROM generate_series(1, cardinality(cj)) AS g WHERE kept_n[g] = 0));
        END IF;
        -- A message filed ('waiting') reads 'replying' from its coverage row
        -- (chatq_shown_status): its row is written only if another job's id is on it. One
        -- not yet filed (accepted, queued) is moved on, or its filing would take it again.
        IF cardinality(w_op) > 0 THEN
            UPDATE operations op
            SET job_id = cj[w_k[array_position(w_op, op.id)]], updated_at = now(),
                status = CASE WHEN op.status = 'waiting' THEN op.status ELSE 'replying' END
            WHERE op.id = ANY(w_op)
              AND (op.status IN ('accepted', 'queued') OR op.job_id IS DISTINCT FROM cj[w_k[array_position(w_op, op.id)]]) IS TRUE
              AND (op.status = ANY(chatq_operation_sources('replying'))) IS TRUE;
        END IF;
        IF cardinality(k_op) > 0 THEN
            INSERT INTO operation_events (operation_id, kind, detail, job_id)
            SELECT t.op, 'attempt', 'attempt ' || p_attempts[ci[t.k]] || ': writing the reply', cj[t.k]
            FROM unnest(k_op, k_k) WITH ORDINALITY AS t(op, k, n)
            ORDER BY t.n;
        END IF;
    END IF;

    -- Each job's row, in the caller's order.
    FOR x IN 1 .. n LOOP
        r := NULL;
        p := array_position(cj, p_jobs[x]);
        IF NOT got[x] THEN
            r.outcome := 'busy';
            r.reason := 'another consumer is handling this job';
        ELSIF p IS NULL THEN
            -- Off the common way: the job's own claim, holding its lock once, as it would.
            r := chatq_claim_job(p_jobs[x], p_attempts[x], p_lock_keys[x], p_history);
            PERFORM pg_advisory_unlock(p_lock_keys[x]);
        ELSE
            r.platform := cplat[p];
            r.account_id := cacct[p];
            r.chat_id := cchat[p];
            r.chat_key := cck[p];
            r.account_paused := cpaused[p];
            r.business_connection_id := cbc[p];
            IF kept_n[p] = 0 THEN
                r.outcome := 'skip';
                r.reason := 'every message is answered or held by another reply';
            ELSE
                r.outcome := 'claimed';
                SELECT array_agg(ROW(t.op, t.mid, t.body, t.sent, t.recv)::chatq_job_message
                                 ORDER BY chatq_order(cplat[p], t.sent, t.mid, t.recv))
                INTO r.messages
                FROM unnest(k_op, k_k, k_mid, k_text, k_sent, k_recv) AS t(op, k, mid, body, sent, recv)
                WHERE t.k = p;
                IF kept_n[p] <> cops_n[p] THEN
                    UPDATE reply_jobs j SET operation_ids = ARRAY(SELECT (m).operation_id FROM unnest(r.messages) AS m)
                    WHERE j.id = cj[p];
                END IF;
                r.history := chatq_chat_history(cplat[p], cacct[p], cchat[p], cck[p], cfirst[p], p_history);
            END IF;
        END IF;
        i := x;
        claim := r;
        RETURN NEXT;
    END LOOP;
END
$$;

-- The previous release's claim (one row of parallel arrays), for its responders during a
-- rollout: chatq_claim_job's result spread out the old way. Drop it one release later.
CREATE OR REPLACE FUNCTION chatq_claim(p_job uuid, p_attempt integer, p_lock_key bigint, p_history integer)
RETURNS TABLE (outcome text, reason text, platform text, account_id text, chat_id text, chat_key text,
               account_paused text, business_connection_id text,
               delivery_status text, delivery_text text, delivery_started_at timestamptz,
               delivery_maybe_since timestamptz, history_roles text[], history_texts text[],
               operation_ids uuid[], message_ids text[], texts text[], sent_ats timestamptz[],
               received_ats timestamptz[])
LANGUAGE sql AS $$
    SELECT c.outcome, c.reason, c.platform, c.account_id, c.chat_id, c.chat_key, c.account_paused,
           c.business_connection_id, (c.delivery).status, (c.delivery).text, (c.delivery).started_at,
           (c.delivery).maybe_since,
           ARRAY(SELECT h.role FROM unnest(c.history) WITH ORDINALITY h ORDER BY h.ordinality),
           ARRAY(SELECT h.text FROM unnest(c.history) WITH ORDINALITY h ORDER BY h.ordinality),
           ARRAY(SELECT m.operation_id FROM unnest(c.messages) WITH ORDINALITY m ORDER BY m.ordinality),
           ARRAY(SELECT m.message_id FROM unnest(c.messages) WITH ORDINALITY m ORDER BY m.ordinality),
           ARRAY(SELECT m.text FROM unnest(c.messages) WITH ORDINALITY m ORDER BY m.ordinality),
           ARRAY(SELECT m.sent_at FROM unnest(c.messages) WITH ORDINALITY m ORDER BY m.ordinality),
           ARRAY(SELECT m.received_at FROM unnest(c.messages) WITH ORDINALITY m ORDER BY m.ordinality)
    FROM chatq_claim_job(p_job, p_attempt, p_lock_key, p_history) c
$$;

-- The delivery intents of jobs about to send (status sending), one row a job, in job id
-- order. A new intent replaces the latest attempt's row, but never forgets that an earlier
-- attempt may have sent (its status was sending or unknown), nor since when.
CREATE OR REPLACE FUNCTION chatq_record_intents(p_jobs uuid[], p_texts text[], p_attempts integer[])
RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO deliveries AS d (job_id, status, text, attempt, started_at)
    SELECT t.job, 'sending', t.body, t.attempt, now()
    FROM unnest(p_jobs, p_texts, p_attempts) AS t(job, body, attempt)
    ORDER BY t.job
    ON CONFLICT (job_id) DO UPDATE
    SET status = 'sending', text = EXCLUDED.text, attempt = EXCLUDED.attempt,
        started_at = now(), finished_at = NULL, error = NULL, platform_message_id = NULL,
        maybe_sent = chatq_delivery_may_have_sent(d.status, d.maybe_sent),
        maybe_since = CASE
            WHEN d.maybe_sent THEN d.maybe_since
            WHEN chatq_delivery_may_have_sent(d.status, false) THEN d.started_at
        END;
END
$$;

-- Just before the platform call: move the messages gathered in the chat's open window
-- since the job was built into the job (when p_fold), so one reply covers them — unless an
-- earlier message of the chat is still in transit (the window waits for it, as the
-- coalescer's emission does); if there were none, record the delivery intent ('sending', committed before the platform is
-- called: from then on the send may have happened). Same per-chat lock as the coalescer.
-- Returns the job's messages, all of them in platform order, when it folded some in; none
-- means the intent is recorded; one row with withdrawn = true means the seller answered the
-- chat in person since the job was built, and the job is withdrawn (nothing recorded).
CREATE OR REPLACE FUNCTION chatq_before_send(
    p_job uuid, p_chat_key text, p_text text, p_attempt integer, p_fold boolean, p_max_messages integer,
    p_max_chars integer
)
RETURNS TABLE (pos bigint, operation_id uuid, message_id text, text text, sent_at timestamptz,
               received_at timestamptz, withdrawn boolean)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    w uuid;
    ids uuid[] := '{}';
    n integer;
    chars bigint;
    job_created timestamptz;
    acct record;
    v uuid;
BEGIN
    IF p_fold THEN
        PERFORM pg_advisory_xact_lock(hashtextextended(p_chat_key, 0));
        SELECT cw.id INTO w FROM chat_windows cw WHERE cw.chat_key = p_chat_key AND cw.status = 'open'
            AND NOT chatq_earlier_in_transit(cw.platform, cw.account_id, cw.chat_id, cw.last_at)
            -- Nothing folds into a reply the seller has overtaken, or while they hold the chat.
            AND NOT EXISTS (
                SELECT 1 FROM chats c JOIN reply_jobs r ON r.id = p_job
                WHERE c.chat_key = p_chat_key
                  AND (c.held_until > clock_timestamp() OR c.seller_wrote_at > r.created_at))
        FOR UPDATE;
        IF FOUND THEN
            -- Only while the job stays within what one job carries; past it, the window
            -- is the chat's next job.
            SELECT count(*), coalesce(sum(length(o.text)), 0) INTO n, chars
            FROM reply_jobs r CROSS JOIN LATERAL unnest(r.operation_ids) AS x(id) JOIN operations o ON o.id = x.id
            WHERE r.id = p_job;
            SELECT n + count(*), chars + coalesce(sum(length(o.text)), 0) INTO n, chars
            FROM window_messages wm JOIN operations o ON o.id = wm.operation_id
            WHERE wm.window_id = w;
            IF n > p_max_messages OR chars > p_max_chars THEN
                w := NULL;
            END IF;
        END IF;
        IF w IS NOT NULL THEN
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
        -- By key, one message at a time: written for the set (id = ANY, and the statuses), a
        -- plan made on stale statistics read it from operations_status_received, every
        -- unfinished message (as filing's did, chatq_file_messages).
        FOREACH v IN ARRAY ids LOOP
            UPDATE operations SET job_id = p_job, status = 'replying', updated_at = now()
            WHERE id = v AND status = ANY(chatq_operation_sources('replying'));
        END LOOP;
        PERFORM chatq_log(ids, 'folded', 'arrived while the reply was being written: the reply is written again '
                          || 'to answer it too', p_job);
        UPDATE reply_jobs SET operation_ids = operation_ids || ids, folded = folded + 1, updated_at = now()
        WHERE id = p_job
        RETURNING operation_ids INTO ids;
        -- Every message of the grown job, in platform order.
        RETURN QUERY SELECT m.*, false FROM chatq_job_messages(ids) m ORDER BY m.pos;
        RETURN;
    END IF;
    -- The last moment to step back: the seller answered the chat in person since this
    -- reply was built. Nothing was sent; the reply is withdrawn.
    SELECT r.created_at, r.operation_ids INTO job_created, ids FROM reply_jobs r WHERE r.id = p_job;
    IF chatq_withdraw_if_seller_answered(p_job, p_chat_key, job_created, ids) THEN
        RETURN QUERY SELECT NULL::bigint, NULL::uuid, NULL::text, NULL::text, NULL::timestamptz, NULL::timestamptz, true;
        RETURN;
    END IF;
    -- And for the account: a person paused or removed it since the job was claimed (while
    -- the reply was written). Nothing is sent: SQLSTATE CQ001 (removed: the job fails with
    -- the reason) or CQ002 (paused: the job waits for the account, the reason as message).
    SELECT a.state, a.state_reason, a.removed_at IS NOT NULL AS removed, r.platform, r.account_id INTO acct
    FROM reply_jobs r JOIN accounts a ON a.platform = r.platform AND a.account_id = r.account_id
    WHERE r.id = p_job;
    IF FOUND AND acct.removed THEN
        RAISE EXCEPTION USING ERRCODE = 'CQ001',
            MESSAGE = 'the ' || acct.platform || ' account ' || acct.account_id || ' was removed';
    ELSIF FOUND AND acct.state <> 'active' THEN
        RAISE EXCEPTION USING ERRCODE = 'CQ002', MESSAGE = coalesce(acct.state_reason, acct.state);
    END IF;
    PERFORM chatq_record_intents(ARRAY[p_job], ARRAY[p_text], ARRAY[p_attempt]);
END
$$;

-- chatq_before_send for a batch of jobs in one call: row i's are job i's rows, the same
-- rows and the same writes. The common way (nothing to fold, the seller has not written
-- since the job was built, the account active) is one write of every job's delivery
-- intent; a job off it (an open window of its chat to fold in, a seller's answer, an
-- account paused or removed) is decided by chatq_before_send itself, in the same
-- transaction. Before, the batch called chatq_before_send for each job: eight statements a
-- job, 0.2 ms of Postgres a reply under bench.pipeline (pg_stat_statements). Every chat's
-- lock of the batch is taken first, in lock-key order, as every taker of several takes
-- them (chatq_lock_chats, chatq_claim_jobs, chatq_record_sent_many), whether or not the job
-- folds: a job withdrawn takes its chat's lock too (the trigger that unblocks the chat's next window),
-- and taken then, after a higher key, it deadlocked with a filing of both chats (found by a
-- review; test_before_send_batch.py holds it). The per-job call takes its own again
-- (granted at once: it is this transaction's). Every read is a probe by key. Where two
-- jobs of a batch would both raise, the first to raise may differ from the per-job order;
-- the caller then asks each job alone, which gives each its own error.
CREATE OR REPLACE FUNCTION chatq_before_send_many(
    p_jobs uuid[], p_chat_keys text[], p_texts text[], p_attempts integer[], p_folds boolean[],
    p_max_messages integer, p_max_chars integer
)
RETURNS TABLE (i integer, pos bigint, operation_id uuid, message_id text, text text, sent_at timestamptz,
               received_at timestamptz, withdrawn boolean)
LANGUAGE plpgsql
SET enable_seqscan = off SET enable_bitmapscan = off
AS $$
#variable_conflict use_column
DECLARE
    x integer;
    special integer[];
BEGIN
    PERFORM pg_advisory_xact_lock(k.key) FROM (
        SELECT DISTINCT hashtextextended(t.ck, 0) AS key FROM unnest(p_chat_keys) AS t(ck) ORDER BY 1
    ) k;
    -- The jobs off the common way, in their chats' lock order.
    SELECT coalesce(array_agg(t.n ORDER BY hashtextextended(t.ck, 0), t.n), '{}') INTO special
    FROM unnest(p_jobs, p_chat_keys, p_folds) WITH ORDINALITY AS t(job, ck, fold, n)
    -- Probes by key (LIMIT 1), one a job: written as EXISTS under OR, a plan made for the
    -- batch read every chat and every open window once into hashed sets (3 ms a call).
    LEFT JOIN LATERAL (SELECT r.created_at, r.platform, r.account_id FROM reply_jobs r WHERE r.id = t.job LIMIT 1) r
        ON true
    LEFT JOIN LATERAL (SELECT true AS open FROM chat_windows cw WHERE cw.chat_key = t.ck AND cw.status = 'open'
                       LIMIT 1) w ON t.fold
    LEFT JOIN LATERAL (SELECT true AS wrote FROM chats c WHERE c.chat_key = t.ck AND c.seller_wrote_at > r.created_at
                       LIMIT 1) c ON true
    LEFT JOIN LATERAL (SELECT true AS stopped FROM accounts a WHERE a.platform = r.platform
                         AND a.account_id = r.account_id AND (a.removed_at IS NOT NULL OR a.state <> 'active')
                       LIMIT 1) a ON true
    WHERE r.created_at IS NULL OR w.open OR c.wrote OR a.stopped;
    PERFORM chatq_record_intents(array_agg(t.job), array_agg(t.body), array_agg(t.attempt))
    FROM unnest(p_jobs, p_texts, p_attempts) WITH ORDINALITY AS t(job, body, attempt, n)
    WHERE t.n <> ALL(special)
    HAVING count(*) > 0;
    FOREACH x IN ARRAY special LOOP
        RETURN QUERY SELECT x, b.* FROM chatq_before_send(p_jobs[x], p_chat_keys[x], p_texts[x], p_attempts[x],
                                                         p_folds[x], p_max_messages, p_max_chars) AS b
                     ORDER BY b.pos;
    END LOOP;
END
$$;

-- Record a reply on the platform: the job, its delivery, the operations it covers and the
-- chat's last answered message (the latest of them in platform order) move together.
-- Returns when it was sent and when each operation it newly replied to was received (for
-- the receipt-to-reply histogram). Then releases the job's session lock (p_lock_key): the
-- job is final once this commits, and a copy that takes the lock before the commit waits
-- on the job's row, then skips it.
CREATE OR REPLACE FUNCTION chatq_record_sent(p_job uuid, p_text text, p_platform_message_id text, p_lock_key bigint)
RETURNS TABLE (sent_at timestamptz, received_ats timestamptz[])
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    j record;
    o record;
    v uuid;
    received timestamptz[] := '{}';
    replied uuid[] := '{}';
    latest chatq_order;
BEGIN
    -- The chat's lock before the job's row (see chatq_give_up).
    PERFORM pg_advisory_xact_lock(hashtextextended(x.chat_key, 0)) FROM reply_jobs x WHERE x.id = p_job;
    UPDATE reply_jobs r SET status = 'sent', reply_text = p_text, platform_message_id = p_platform_message_id,
           sent_at = clock_timestamp(), error_kind = NULL, error_message = NULL, updated_at = now()
    WHERE r.id = p_job AND r.status IN ('pending', 'processing')
    RETURNING r.sent_at AS at, r.chat_key, r.platform, r.operation_ids INTO j;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'job % is not in flight: a reply cannot be recorded for it', p_job
            USING ERRCODE = 'check_violation';
    END IF;
    UPDATE deliveries d SET status = 'sent', platform_message_id = p_platform_message_id, finished_at = j.at,
           error = NULL
    WHERE d.job_id = p_job;
    -- One key lookup per operation (see chatq_claim on plans over arrays of keys).
    FOREACH v IN ARRAY j.operation_ids LOOP
        UPDATE operations x SET status = 'replied', status_reason = NULL, job_id = p_job, updated_at = j.at
        WHERE x.id = v AND x.status IN ('accepted', 'queued', 'waiting', 'replying')
        RETURNING x.sent_at, x.message_id, x.received_at INTO o;
        IF FOUND THEN
            replied := replied || v;
            received := received || o.received_at;
            IF latest IS NULL OR latest < chatq_order(j.platform, o.sent_at, o.message_id, o.received_at) THEN
                latest := chatq_order(j.platform, o.sent_at, o.message_id, o.received_at);
            END IF;
        END IF;
    END LOOP;
    IF latest IS NOT NULL THEN
        PERFORM chatq_advance_last_answered(j.chat_key, j.platform, latest.sent_at, latest.message_id,
                                            latest.received_at, j.at, p_job);
    END IF;
    PERFORM chatq_log(replied, 'replied', 'reply sent (platform message ' || p_platform_message_id || ')', p_job);
    PERFORM pg_advisory_unlock(p_lock_key);
    RETURN QUERY SELECT j.at, received;
END
$$;

-- chatq_record_sent for the jobs of one responder connection whose replies went out
-- together: one round trip, one transaction, and one statement for each table it writes,
-- whatever the number of jobs (a statement per job and per message cost more than the
-- rows: executor start-up, the table's CHECK constraints parsed again, a trigger's WHEN;
-- perf of Postgres under bench.pipeline). The same writes as chatq_record_sent for each
-- job; row i is job i's. If a job is not in flight, nothing is written (check_violation,
-- as chatq_record_sent raises) and the caller records the jobs one by one. The jobs'
-- session locks (p_lock_keys) are released only once every record is in, so a batch that
-- fails leaves each job held and unrecorded, as it was.
--
-- The chats' locks are taken first, in the order of their lock keys: ending a job takes
-- its chat's lock (the trigger that unblocks the chat's next window, which finds it held),
-- and every other taker of several chats' locks takes them in that order
-- (chatq_lock_chats, claim and before-send batches, chatq_unblock_expired_holds). Each table
-- is written by its key (id = ANY, the status checked only on the rows found: "IS TRUE"
-- keeps it from being read through a partial index whose predicate it would imply, as
-- filing's update once was, on statistics taken while nothing was in flight).
CREATE OR REPLACE FUNCTION chatq_record_sent_many(
    p_jobs uuid[], p_texts text[], p_platform_message_ids text[], p_lock_keys bigint[]
)
RETURNS TABLE (i integer, sent_at timestamptz, received_ats timestamptz[])
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    missing uuid;
    -- The jobs recorded, in their chats' lock order, with when each was sent and its chat.
    jobs uuid[];
    ats timestamptz[];
    keys text[];
    -- Their operations, job after job (each job's in its own order), with the job's index
    -- in ``jobs``; a message in two jobs' lists (never, by coverage) goes to the first.
    ops uuid[];
    op_job integer[];
    -- The operations newly replied to, in that order.
    r_ops uuid[];
    r_job integer[];
    r_platform text[];
    r_sent timestamptz[];
    r_mid text[];
    r_received timestamptz[];
BEGIN
    PERFORM chatq_lock_chats_of_jobs(p_jobs);
    WITH j AS (
        UPDATE reply_jobs r
        SET status = 'sent', reply_text = p_texts[array_position(p_jobs, r.id)],
            platform_message_id = p_platform_message_ids[array_position(p_jobs, r.id)],
            sent_at = clock_timestamp(), error_kind = NULL, error_message = NULL, updated_at = now()
        WHERE r.id = ANY(p_jobs) AND (r.status IN ('pending', 'processing')) IS TRUE
        RETURNING r.id, r.sent_at, r.chat_key, r.operation_ids
    ), ordered AS (
        SELECT j.*, row_number() OVER (ORDER BY hashtextextended(j.chat_key, 0), array_position(p_jobs, j.id)) AS n
        FROM j
    )
    SELECT (SELECT array_agg(o.id ORDER BY o.n) FROM ordered o),
           (SELECT array_agg(o.sent_at ORDER BY o.n) FROM ordered o),
           (SELECT array_agg(o.chat_key ORDER BY o.n) FROM ordered o),
           (SELECT array_agg(u.op ORDER BY o.n, u.m) FROM ordered o, unnest(o.operation_ids) WITH ORDINALITY u(op, m)),
           (SELECT array_agg(o.n::integer ORDER BY o.n, u.m) FROM ordered o, unnest(o.operation_ids) WITH ORDINALITY u(op, m))
    INTO jobs, ats, keys, ops, op_job;
    IF coalesce(cardinality(jobs), 0) < cardinality(p_jobs) THEN
        SELECT x INTO missing FROM unnest(p_jobs) AS x WHERE x <> ALL(coalesce(jobs, '{}')) LIMIT 1;
        RAISE EXCEPTION 'job % is not in flight: a reply cannot be recorded for it', missing
            USING ERRCODE = 'check_violation';
    END IF;
    UPDATE deliveries d
    SET status = 'sent', platform_message_id = p_platform_message_ids[array_position(p_jobs, d.job_id)],
        finished_at = ats[array_position(jobs, d.job_id)], error = NULL
    WHERE d.job_id = ANY(jobs);
    WITH o AS (
        UPDATE operations x
        SET status = 'replied', status_reason = NULL, job_id = jobs[op_job[array_position(ops, x.id)]],
            updated_at = ats[op_job[array_position(ops, x.id)]]
        WHERE x.id = ANY(ops) AND (x.status IN ('accepted', 'queued', 'waiting', 'replying')) IS TRUE
        RETURNING x.id, op_job[array_position(ops, x.id)] AS job, x.platform, x.sent_at, x.message_id,
                  x.received_at, array_position(ops, x.id) AS pos
    )
    SELECT array_agg(o.id ORDER BY o.pos), array_agg(o.job ORDER BY o.pos), array_agg(o.platform ORDER BY o.pos),
           array_agg(o.sent_at ORDER BY o.pos), array_agg(o.message_id ORDER BY o.pos),
           array_agg(o.received_at ORDER BY o.pos)
    INTO r_ops, r_job, r_platform, r_sent, r_mid, r_received
    FROM o;
    IF r_ops IS NOT NULL THEN
        INSERT INTO operation_events (operation_id, kind, detail, job_id)
        SELECT t.op, 'replied', 'reply sent (platform message ' || p_platform_message_ids[array_position(p_jobs, jobs[t.job])] || ')',
               jobs[t.job]
        FROM unnest(r_ops, r_job) WITH ORDINALITY AS t(op, job, n)
        ORDER BY t.n;
        -- Each chat's last answered message: the latest of those its job replied to, as
        -- chatq_advance_last_answered moves it (never back, never past the clock).
        INSERT INTO chats AS c (chat_key, last_answered_sent_at, last_answered_message_id, last_answered_received_at,
                                last_reply_at, last_job_id)
        SELECT DISTINCT ON (keys[t.job]) keys[t.job], least(t.sent, clock_timestamp()), t.mid, t.received,
               ats[t.job], jobs[t.job]
        FROM unnest(r_job, r_platform, r_sent, r_mid, r_received) AS t(job, platform, sent, mid, received)
        ORDER BY keys[t.job], chatq_order(t.platform, t.sent, t.mid, t.received) DESC
        ON CONFLICT (chat_key) DO UPDATE
        SET last_answered_sent_at = EXCLUDED.last_answered_sent_at,
            last_answered_message_id = EXCLUDED.last_answered_message_id,
            last_answered_received_at = EXCLUDED.last_answered_received_at,
            last_reply_at = EXCLUDED.last_reply_at, last_job_id = EXCLUDED.last_job_id
        -- (A chat key starts with its platform: shared.messages.chat_key.)
        WHERE chatq_order(split_part(c.chat_key, ':', 1), c.last_answered_sent_at, c.last_answered_message_id,
                          c.last_answered_received_at)
            < chatq_order(split_part(c.chat_key, ':', 1), EXCLUDED.last_answered_sent_at,
                          EXCLUDED.last_answered_message_id, EXCLUDED.last_answered_received_at);
    END IF;
    PERFORM pg_advisory_unlock(k) FROM unnest(p_lock_keys) AS k;
    RETURN QUERY
    SELECT array_position(p_jobs, t.job)::integer, t.at,
           coalesce((SELECT array_agg(x.received ORDER BY x.n)
                     FROM unnest(r_job, r_received) WITH ORDINALITY AS x(job, received, n) WHERE x.job = t.n), '{}')
    FROM unnest(jobs, ats) WITH ORDINALITY AS t(job, at, n);
END
$$;

-- Give up on a job that did not send: under the job's lock, and only while it is in
-- flight. When any send of it may have reached the platform (delivery 'sending' or
-- 'unknown' now, or maybe_sent from an earlier attempt) the job and its messages go to a person (needs_review) and keep their claim
-- on the messages, so a retry cannot answer them twice; otherwise they fail, and give the
-- messages back for a person's retry. p_kind 'review': a reply written and held back
-- before any send (needs_review too, with the claim kept). The reason and the owner are
-- kept either way.
--   busy          another session holds the job: its holder decides, nothing changes
--   final         the job is already final (or missing): nothing changes
--   failed | needs_review   what the job and its unfinished operations became
CREATE OR REPLACE FUNCTION chatq_give_up(p_job uuid, p_kind text, p_reason text, p_owner text, p_lock_key bigint)
RETURNS TABLE (outcome text, chat_key text, operation_ids uuid[])
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    j record;
    v uuid;
    target text;
    ekind text;
    why text;
    changed uuid[] := '{}';
BEGIN
    IF NOT pg_try_advisory_lock(p_lock_key) THEN
        outcome := 'busy';
        RETURN NEXT;
        RETURN;
    END IF;
    -- The chat's lock before the job's row, as the seller's message and the batched steps
    -- take them (ending the job takes the chat's lock in its trigger: taken after the row,
    -- it deadlocked with a seller's message of the chat, found by a review).
    PERFORM pg_advisory_xact_lock(hashtextextended(r.chat_key, 0)) FROM reply_jobs r WHERE r.id = p_job;
    SELECT r.status, r.chat_key AS ck, r.operation_ids AS ops, d.status AS d_status,
           coalesce(d.maybe_sent, false) AS d_maybe
    INTO j
    FROM reply_jobs r LEFT JOIN deliveries d ON d.job_id = r.id
    WHERE r.id = p_job
    FOR UPDATE OF r;
    IF NOT FOUND OR j.status NOT IN ('pending', 'processing') THEN
        PERFORM pg_advisory_unlock(p_lock_key);
        outcome := 'final';
        chat_key := j.ck;
        RETURN NEXT;
        RETURN;
    END IF;
    IF chatq_delivery_may_have_sent(j.d_status, j.d_maybe) THEN
        target := 'needs_review';
        ekind := 'unknown';
        why := p_reason || '; the last send may have reached the chat: check it, then resolve, or retry with a confirmed re-send';
    ELSIF p_kind = 'review' THEN
        -- A written reply held back before any send for a person to read (the responder's
        -- check of the model's answer): the messages keep their claim, nothing went out.
        target := 'needs_review';
        ekind := 'permanent';
        why := p_reason || '; nothing was sent: answer the buyer in person, then resolve (or retry to write it again)';
    ELSE
        target := 'failed';
        ekind := p_kind;
        why := p_reason;
        DELETE FROM reply_coverage rc WHERE rc.job_id = p_job;
    END IF;
    UPDATE reply_jobs r SET status = target, error_kind = ekind,
           error_message = left(why, 500), owner = p_owner, updated_at = now()
    WHERE r.id = p_job;
    FOREACH v IN ARRAY j.ops LOOP
        UPDATE operations o SET status = target, status_reason = left(why, 500), owner = p_owner, updated_at = now()
        WHERE o.id = v AND o.job_id = p_job AND o.status IN ('accepted', 'queued', 'waiting', 'replying');
        IF FOUND THEN
            changed := changed || v;
        END IF;
    END LOOP;
    PERFORM chatq_log(changed, target, replace(target, '_', ' ') || ': ' || why, p_job, p_owner);
    PERFORM pg_advisory_unlock(p_lock_key);
    outcome := target;
    chat_key := j.ck;
    operation_ids := changed;
    RETURN NEXT;
END
$$;
