-- chatq:release 1 sha256:52ece0ee55c56bc1
-- Platform order, the one definition: the platform's timestamp; then, where ids grow
-- with time (Telegram's message_id within a chat), the id as a number (shorter first);
-- then our receipt time; then the id. Avito's `created` is whole seconds and its ids and
-- generic ids are opaque, so their ties go by receipt, never by comparing ids.
CREATE OR REPLACE FUNCTION chatq_order(
    p_platform text, p_sent_at timestamptz, p_message_id text, p_received_at timestamptz
) RETURNS chatq_order LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT ROW(p_sent_at,
               CASE WHEN p_platform = 'telegram' THEN length(p_message_id) ELSE 0 END,
               CASE WHEN p_platform = 'telegram' THEN p_message_id ELSE '' END,
               p_received_at, p_message_id)::chatq_order
$$;
