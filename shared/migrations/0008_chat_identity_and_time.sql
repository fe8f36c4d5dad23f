-- Chat identity and time you can trust (issue 14).

-- Platform order, defined once (chatq_order in shared/functions/05_order.sql): a row of
-- what decides it, compared field by field.
CREATE TYPE chatq_order AS (
    sent_at        timestamptz,  -- the platform's time (clamped at intake)
    numeric_length integer,      -- where ids grow with time (Telegram): the id as a number
    numeric_id     text,
    received_at    timestamptz,  -- then our receipt
    message_id     text
);

-- Every operation has a platform time: the receipt time where the platform gave none.
UPDATE operations SET sent_at = received_at WHERE sent_at IS NULL;
ALTER TABLE operations ALTER COLUMN sent_at SET NOT NULL;

-- The last-answered marker is ordered like the messages.
ALTER TABLE chats ADD COLUMN last_answered_received_at timestamptz;
UPDATE chats SET last_answered_received_at = last_reply_at;

-- Chat keys escape ':' and '%' in their parts (shared.messages.chat_key): rewrite the keys
-- of chats whose ids hold either. Two chats that shared a key before cannot be told apart
-- in the markers, which only steer history: drop those markers.
DELETE FROM chats WHERE chat_key IN (
    SELECT chat_key FROM reply_jobs WHERE account_id ~ '[:%]' OR chat_id ~ '[:%]'
    UNION SELECT chat_key FROM chat_windows WHERE account_id ~ '[:%]' OR chat_id ~ '[:%]');
UPDATE chat_windows SET chat_key = platform || ':' || replace(replace(account_id, '%', '%25'), ':', '%3A')
                                   || ':' || replace(replace(chat_id, '%', '%25'), ':', '%3A')
WHERE account_id ~ '[:%]' OR chat_id ~ '[:%]';
UPDATE reply_jobs SET chat_key = platform || ':' || replace(replace(account_id, '%', '%25'), ':', '%3A')
                                 || ':' || replace(replace(chat_id, '%', '%25'), ':', '%3A')
WHERE account_id ~ '[:%]' OR chat_id ~ '[:%]';

-- A window whose chat has a reply job in flight is blocked: the scheduler skips it by
-- index, and the job's end unblocks it (a trigger on reply_jobs, 40_windows_blocked.sql).
ALTER TABLE chat_windows ADD COLUMN blocked boolean NOT NULL DEFAULT false;
UPDATE chat_windows w SET blocked = true
WHERE w.status = 'open'
  AND EXISTS (SELECT 1 FROM reply_jobs j WHERE j.chat_key = w.chat_key AND j.status IN ('pending', 'processing'));
DROP INDEX chat_windows_due;
-- Exactly the scheduler's claim and its next-due query: open windows no job blocks, by due time.
CREATE INDEX chat_windows_ready_due ON chat_windows (due_at) WHERE status = 'open' AND NOT blocked;
