"""A reply job, from claim to record: ``protocol``, ``postgres`` (stores/jobs/functions/30_jobs.sql; ``batches`` shares a connection among jobs in flight), ``fake``."""
