"""The operator's tooling, apart from the services: the ``chatq`` command (``cli``), its
checks of a deployment (``doctor``), ``make run``'s check and start of Postgres and
RabbitMQ (``preflight``) and the development ``.env`` file (``envfile``). The services never
import it (``python -m services``, the development runner, reads the env file)."""
