-- chatq:no-transaction
-- Filing moves each message by key whatever the statistics say (as 0026-0028; found with
-- pg_stat_statements under bench.pipeline).
--
-- Filing moves its messages from 'accepted' or 'queued' to 'waiting' (id = ANY(...) and
-- those statuses). Those statuses imply operations_in_transit's predicate, so on
-- statistics taken while no message was in transit (a quiet minute, the benchmark's
-- warm-up) the planner read the update from that index, expecting it empty: every entry
-- of it, including those each message left since the last vacuum. 1.8 ms a batch of 10
-- under bench.pipeline, 16,640 entries read for 8 batches beside 2,000 messages in transit
-- (tests/integration/test_filing_cost.py).
--
-- The index of the messages in transit (operations_in_transit_by_receipt, replacing
-- operations_in_transit) holds only rows with a receipt time, which every row has: a
-- query may use it only where it compares received_at itself, as the one it is for does
-- (chatq_earlier_in_transit: a message of the chat received before a time).
-- Built concurrently (shared/migrate.py): intake writes operations throughout.
DROP INDEX CONCURRENTLY IF EXISTS operations_in_transit_by_receipt;
CREATE INDEX CONCURRENTLY operations_in_transit_by_receipt ON operations (platform, account_id, chat_id, received_at)
    WHERE status IN ('accepted', 'queued') AND received_at IS NOT NULL;
DROP INDEX CONCURRENTLY IF EXISTS operations_in_transit;
