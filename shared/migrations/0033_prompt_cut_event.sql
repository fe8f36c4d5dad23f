-- What the model was not given (issue 39, point 4): a reply job whose chat is longer than
-- LLM_MAX_*_CHARS is written from a cut prompt, and its messages' record says so
-- ('prompt_cut'). The known kinds are read from the constraint as it stands and this one
-- added, so a migration of the same release that adds another kind keeps it.
DO $$
DECLARE
    def text;
BEGIN
    SELECT pg_get_constraintdef(c.oid) INTO def
    FROM pg_constraint c WHERE c.conname = 'operation_events_known_kind' AND c.conrelid = 'operation_events'::regclass;
    IF def IS NULL OR position('''prompt_cut''' IN def) > 0 THEN
        RETURN;
    END IF;
    -- chatq:destructive the constraint is put back at once with every kind it held and one more
    ALTER TABLE operation_events DROP CONSTRAINT operation_events_known_kind;
    EXECUTE 'ALTER TABLE operation_events ADD CONSTRAINT operation_events_known_kind '
        || replace(def, 'ARRAY[', 'ARRAY[''prompt_cut''::text, ');
END
$$;
