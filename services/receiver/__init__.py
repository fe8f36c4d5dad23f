"""The receiver: webhook intake (inbox + outbox in one transaction), the outbox relay,
and the admin API."""
