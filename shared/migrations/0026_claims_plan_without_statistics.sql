-- The scheduler's claim keeps its plan whatever the statistics say (issue 20, found with
-- auto_explain under bench.pipeline).
--
-- The claim walks the accounts with a ready window and reads each one's earliest windows
-- from chat_windows_ready_account, in (platform, account, due time) order. Statistics taken
-- when few windows were open (after a quiet minute, or the benchmark's warm-up) made the
-- planner expect one ready window and read those from chat_windows_ready_due instead,
-- sorting them: every ready window twice a round, 10 ms a round with 13,000 windows
-- waiting behind one account's share.
--
-- chat_windows_ready_due now holds only rows with a due time, which every row has: a
-- query may use it only where it compares due_at itself (the count of due windows, the
-- next window to fall due). The walk by account, which compares no due time or compares
-- it inside (account, due time) pairs, can only be planned on the index by account.
DROP INDEX IF EXISTS chat_windows_ready_due;
CREATE INDEX chat_windows_ready_due ON chat_windows (due_at)
    WHERE status = 'open' AND NOT blocked AND due_at IS NOT NULL;
