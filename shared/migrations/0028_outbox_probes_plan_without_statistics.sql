-- chatq:no-transaction
-- Probes of a chat's unpublished outbox rows keep their plan whatever the statistics say
-- (as 0026 and 0027; found with pg_stat_statements under bench.pipeline).
--
-- Statistics taken while every row was published (a quiet minute, the benchmark's
-- warm-up: the relay had caught up) make the planner expect no unpublished row, and both
-- partial indexes of the unpublished rows look empty. It then took the smaller one, by
-- exchange and id, for the probes that name a chat too, filtering the chat key:
--   - the relay's probe of whether a row heads its chat read every earlier unpublished
--     row of the exchange, n^2/2 rows for a claim of n (20,200 rows for 200 rows behind
--     2,000 chats);
--   - the status a person reads ('accepted' until the relay published the message, then
--     'queued'; chatq_shown_status) read every unpublished row of the exchange for each
--     message: the backlog gauges, which read it for every unfinished message every 10 s,
--     took 1-2.7 s of Postgres a refresh.
--
-- The index by exchange and id (outbox_unpublished_by_exchange, replacing
-- outbox_unpublished_exchange) holds only rows with a positive id, which every row has
-- (an identity from 1): a query may use it only where it says so, which only the relay's
-- claim does (shared/outbox.py). Every probe of a chat is left with outbox_unpublished_head.
-- Built concurrently (shared/migrate.py): intake writes the outbox throughout.
DROP INDEX CONCURRENTLY IF EXISTS outbox_unpublished_by_exchange;
CREATE INDEX CONCURRENTLY outbox_unpublished_by_exchange ON outbox (exchange, id)
    WHERE published_at IS NULL AND id > 0;
DROP INDEX CONCURRENTLY IF EXISTS outbox_unpublished_exchange;
