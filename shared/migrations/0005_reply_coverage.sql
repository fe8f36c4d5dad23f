-- Each buyer message is covered by at most one reply job that may send (invariant I4),
-- enforced by a primary key rather than by reasoning about every race between
-- redeliveries, fold-ins and re-filed messages. A job takes its messages here when it is
-- claimed; a job that fails without sending gives them back.
CREATE TABLE reply_coverage (
    operation_id  uuid PRIMARY KEY REFERENCES operations (id),
    job_id        uuid NOT NULL REFERENCES reply_jobs (id),
    covered_at    timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX reply_coverage_job ON reply_coverage (job_id);
