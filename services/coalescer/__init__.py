"""The coalescer: per-chat debounce windows in Postgres; one reply job per burst."""
