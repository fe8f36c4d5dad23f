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
-- query may use it only where it says so (chatq_earlier_in_transit compares received_at;
-- the seller's-answer sweep and the receiver's edit check state it). Filing itself now
-- moves each message by key (chatq_file_messages): written for the batch, a stale plan
-- read it from operations_status_received instead once this index was out of reach.
-- During a rollout the previous release's receiver, whose edit check does not state
-- received_at, reads an edited message's chat by another index until it is replaced.
-- Built concurrently (shared/migrate.py): intake writes operations throughout.
DROP INDEX CONCURRENTLY IF EXISTS operations_in_transit_by_receipt;
CREATE INDEX CONCURRENTLY operations_in_transit_by_receipt ON operations (platform, account_id, chat_id, received_at)
    WHERE status IN ('accepted', 'queued') AND received_at IS NOT NULL;
DROP INDEX CONCURRENTLY IF EXISTS operations_in_transit;
