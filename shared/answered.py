"""Each chat's last answered message: the responder's cheap already-answered guard.
Written when a reply is recorded and when a person resolves as replied manually; it only
ever moves forward in platform order (timestamp, then message id, numeric ids by length).
The rule lives in one place, the function of migration 0006."""

UPSERT_LAST_ANSWERED = "SELECT chatq_advance_last_answered($1, $2, $3, $4, $5)"
