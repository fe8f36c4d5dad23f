"""RabbitMQ: topology as data, its idempotent declaration, connections, publishing."""
