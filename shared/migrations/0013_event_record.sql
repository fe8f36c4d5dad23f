-- An event record for every operation (issue 18): what happened, who decided, when,
-- written in the transaction of the state change it records (operation_events, 0007).
-- The numbers a seller reads are counted from it by event time.
CREATE INDEX operation_events_kind_at ON operation_events (kind, at);
ALTER TABLE operation_events ADD CONSTRAINT operation_events_known_kind CHECK (kind IN (
    'received', 'ignored', 'duplicate', 'recovered', 'filed', 'held', 'emitted', 'attempt', 'folded',
    'part_sent', 'replied', 'answered_by_seller', 'attempt_failed', 'retry_scheduled', 'failed',
    'needs_review', 'retried', 'resolved'));
