-- chatq:release 3 sha256:6aa9158b61f6ae54
-- Generated from shared/state (python -m shared.state): the transition tables of
-- shared/state/operation.py, job.py and account.py. Do not edit by hand.

-- operation: the statuses that may move to p_to.
CREATE OR REPLACE FUNCTION chatq_operation_sources(p_to text) RETURNS text[]
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE p_to
        WHEN 'accepted' THEN ARRAY['failed', 'needs_review']::text[]
        WHEN 'queued' THEN ARRAY['accepted']::text[]
        WHEN 'waiting' THEN ARRAY['accepted', 'queued']::text[]
        WHEN 'replying' THEN ARRAY['accepted', 'queued', 'waiting']::text[]
        WHEN 'replied' THEN ARRAY['accepted', 'queued', 'waiting', 'replying', 'failed', 'needs_review']::text[]
        WHEN 'failed' THEN ARRAY['accepted', 'queued', 'waiting', 'replying']::text[]
        WHEN 'needs_review' THEN ARRAY['accepted', 'queued', 'waiting', 'replying']::text[]
        WHEN 'ignored' THEN ARRAY['failed', 'needs_review']::text[]
        ELSE '{}'::text[]
    END
$$;

CREATE OR REPLACE FUNCTION chatq_check_operation_status() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NOT (OLD.status = ANY(chatq_operation_sources(NEW.status))) THEN
        RAISE EXCEPTION 'operation %: status % -> % is not allowed', NEW.id, OLD.status, NEW.status
            USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END
$$;

CREATE OR REPLACE TRIGGER operations_status_transition
    BEFORE UPDATE OF status ON operations
    FOR EACH ROW WHEN (OLD.status IS DISTINCT FROM NEW.status)
    EXECUTE FUNCTION chatq_check_operation_status();

-- reply job: the statuses that may move to p_to.
CREATE OR REPLACE FUNCTION chatq_job_sources(p_to text) RETURNS text[]
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE p_to
        WHEN 'pending' THEN ARRAY['processing']::text[]
        WHEN 'processing' THEN ARRAY['pending']::text[]
        WHEN 'sent' THEN ARRAY['processing', 'needs_review']::text[]
        WHEN 'failed' THEN ARRAY['pending', 'processing']::text[]
        WHEN 'needs_review' THEN ARRAY['pending', 'processing']::text[]
        WHEN 'superseded' THEN ARRAY['pending', 'processing', 'needs_review']::text[]
        ELSE '{}'::text[]
    END
$$;

CREATE OR REPLACE FUNCTION chatq_check_job_status() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NOT (OLD.status = ANY(chatq_job_sources(NEW.status))) THEN
        RAISE EXCEPTION 'reply job %: status % -> % is not allowed', NEW.id, OLD.status, NEW.status
            USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END
$$;

CREATE OR REPLACE TRIGGER reply_jobs_status_transition
    BEFORE UPDATE OF status ON reply_jobs
    FOR EACH ROW WHEN (OLD.status IS DISTINCT FROM NEW.status)
    EXECUTE FUNCTION chatq_check_job_status();

-- delivery: the statuses that may move to p_to.
CREATE OR REPLACE FUNCTION chatq_delivery_sources(p_to text) RETURNS text[]
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE p_to
        WHEN 'sending' THEN ARRAY['unknown', 'not_sent']::text[]
        WHEN 'sent' THEN ARRAY['sending', 'unknown']::text[]
        WHEN 'unknown' THEN ARRAY['sending']::text[]
        WHEN 'not_sent' THEN ARRAY['sending']::text[]
        ELSE '{}'::text[]
    END
$$;

CREATE OR REPLACE FUNCTION chatq_check_delivery_status() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NOT (OLD.status = ANY(chatq_delivery_sources(NEW.status))) THEN
        RAISE EXCEPTION 'delivery %: status % -> % is not allowed', NEW.job_id, OLD.status, NEW.status
            USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END
$$;

CREATE OR REPLACE TRIGGER deliveries_status_transition
    BEFORE UPDATE OF status ON deliveries
    FOR EACH ROW WHEN (OLD.status IS DISTINCT FROM NEW.status)
    EXECUTE FUNCTION chatq_check_delivery_status();

-- delivery: the statuses that may move to p_to.
CREATE OR REPLACE FUNCTION chatq_delivery_part_sources(p_to text) RETURNS text[]
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE p_to
        WHEN 'sending' THEN ARRAY['unknown', 'not_sent']::text[]
        WHEN 'sent' THEN ARRAY['sending', 'unknown']::text[]
        WHEN 'unknown' THEN ARRAY['sending']::text[]
        WHEN 'not_sent' THEN ARRAY['sending']::text[]
        ELSE '{}'::text[]
    END
$$;

CREATE OR REPLACE FUNCTION chatq_check_delivery_part_status() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NOT (OLD.status = ANY(chatq_delivery_part_sources(NEW.status))) THEN
        RAISE EXCEPTION 'delivery %: status % -> % is not allowed', NEW.job_id, OLD.status, NEW.status
            USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END
$$;

CREATE OR REPLACE TRIGGER delivery_parts_status_transition
    BEFORE UPDATE OF status ON delivery_parts
    FOR EACH ROW WHEN (OLD.status IS DISTINCT FROM NEW.status)
    EXECUTE FUNCTION chatq_check_delivery_part_status();

-- account: the statuses that may move to p_to.
CREATE OR REPLACE FUNCTION chatq_account_sources(p_to text) RETURNS text[]
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE p_to
        WHEN 'active' THEN ARRAY['paused_by_platform', 'paused_by_person']::text[]
        WHEN 'paused_by_platform' THEN ARRAY['active']::text[]
        WHEN 'paused_by_person' THEN ARRAY['active', 'paused_by_platform']::text[]
        ELSE '{}'::text[]
    END
$$;

CREATE OR REPLACE FUNCTION chatq_check_account_state() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NOT (OLD.state = ANY(chatq_account_sources(NEW.state))) THEN
        RAISE EXCEPTION 'account %: state % -> % is not allowed', NEW.account_id, OLD.state, NEW.state
            USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END
$$;

CREATE OR REPLACE TRIGGER accounts_state_transition
    BEFORE UPDATE OF state ON accounts
    FOR EACH ROW WHEN (OLD.state IS DISTINCT FROM NEW.state)
    EXECUTE FUNCTION chatq_check_account_state();

-- delivery: whether a send of the job may have reached the chat (shared/state/job.py
-- may_have_sent): its latest attempt's status is sending or unknown, or an
-- earlier attempt's was, or a part of a reply in parts went out (maybe_sent). Such a job is
-- finished or handed to a person, never withdrawn nor failed: every step that may
-- withdraw or fail a job asks this, and nothing else.
CREATE OR REPLACE FUNCTION chatq_delivery_may_have_sent(p_status text, p_maybe_sent boolean) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT coalesce(p_status = ANY(ARRAY['sending', 'unknown']::text[]), false)
        OR coalesce(p_maybe_sent, false)
$$;
