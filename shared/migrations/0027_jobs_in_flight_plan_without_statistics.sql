-- The scheduler's counts of jobs in flight keep their plan whatever the statistics say
-- (as 0026 for the ready windows).
--
-- reply_jobs keeps days of finished jobs, so a flood of jobs in flight changes too few of
-- its rows for autovacuum to analyze it again soon: statistics taken while no job was in
-- flight (a quiet hour, the benchmark's warm-up) make the planner expect none, and every
-- partial index of the jobs in flight look empty. The claim's count of each account's
-- jobs in flight, and the share's two probes of the first and the last account in flight,
-- were then read from reply_jobs_in_flight_age (the same rows, by age), every job in
-- flight each time: 320,000 rows a round with 200 accounts of 8 jobs each
-- (tests/integration/test_scheduler_cost.py).
--
-- The index of the jobs in flight by age (reply_jobs_in_flight_by_age, replacing
-- reply_jobs_in_flight_age) holds only rows with an update time, which every row has: a
-- query may use it only where it compares updated_at itself (the sweeper's stuck jobs).
-- Built before the old one is dropped: reply_jobs is read on (its writes wait) while the
-- build reads the whole table, and is locked outright only for the drop.
CREATE INDEX reply_jobs_in_flight_by_age ON reply_jobs (updated_at)
    WHERE status IN ('pending', 'processing') AND updated_at IS NOT NULL;
DROP INDEX IF EXISTS reply_jobs_in_flight_age;
