"""Code shared by the chatqueue services: settings, database, broker, outbox, metrics."""
