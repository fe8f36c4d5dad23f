"""The responder: one reply per job, exactly once, with retries, dead letters and
unknown-outcome handling."""
