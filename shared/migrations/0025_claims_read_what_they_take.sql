-- Claims read what they take, not what waits (issue 20, found with auto_explain under
-- bench.pipeline).
--
-- The scheduler's claim of due windows under each account's fair share read every due
-- window each round (a window function over all of them, sorted by account): with a
-- backlog of 5,000 due windows behind one account's share, 4-8 ms of Postgres per round
-- to emit 16. Ready windows by account and due time let it find the accounts with a
-- ready window (one probe each) and read only the earliest windows each account may
-- still send: a round costs what it emits, not what waits.
CREATE INDEX chat_windows_ready_account ON chat_windows (platform, account_id, due_at)
    WHERE status = 'open' AND NOT blocked;

-- A relay reads only its own exchanges' unpublished rows, in id order: with one index of
-- all unpublished rows by id, the coalescer's relay stepped over every inbound row the
-- receiver's relay had not yet published (2,600 behind a burst, 1.8 ms a claim).
CREATE INDEX outbox_unpublished_exchange ON outbox (exchange, id) WHERE published_at IS NULL;
DROP INDEX IF EXISTS outbox_unpublished;
