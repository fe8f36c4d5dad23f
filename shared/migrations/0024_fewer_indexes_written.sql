-- Every update of an operation or a reply job wrote an entry into its updated_at index
-- (the updates are not HOT: status is indexed), read only by retention. Retention now
-- walks the receipt and creation indexes, which are written once, and checks updated_at
-- on the rows it finds (a row updated after its receipt is still untouched long enough
-- only if updated_at is past the period too).
DROP INDEX IF EXISTS operations_updated;
DROP INDEX IF EXISTS reply_jobs_updated;
