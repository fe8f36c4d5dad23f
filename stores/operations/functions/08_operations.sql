-- chatq:release 1 sha256:c0d7144c9a089171
-- Operation status changes shared by several functions: one helper per transition, so the
-- rule (which statuses move, what the record says) is written once.

-- The seller answered these operations in person: every one still unfinished ends
-- replied with p_reason, and its record says so (actor 'seller'). Returns the ones that
-- changed.
CREATE OR REPLACE FUNCTION chatq_answered_by_seller(
    p_ops uuid[], p_reason text, p_detail text, p_job uuid DEFAULT NULL
) RETURNS uuid[] LANGUAGE sql AS $$
    WITH up AS (
        UPDATE operations SET status = 'replied', status_reason = p_reason, updated_at = now()
        WHERE id = ANY(p_ops) AND status IN ('accepted', 'queued', 'waiting', 'replying')
        RETURNING id
    ), ev AS (
        INSERT INTO operation_events (operation_id, kind, actor, detail, job_id)
        SELECT id, 'answered_by_seller', 'seller', p_detail, p_job FROM up
    )
    SELECT coalesce(array_agg(id), '{}') FROM up
$$;
