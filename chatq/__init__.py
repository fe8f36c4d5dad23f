"""The operator's tooling, apart from the services: the ``chatq`` command (``cli``), its
checks of a deployment (``doctor``), ``make run``'s check and start of Postgres and
RabbitMQ (``preflight``) and the development ``.env`` file (``envfile``). No service imports
it; only ``python -m services``, the development runner of all three, reads the env file
through it."""
