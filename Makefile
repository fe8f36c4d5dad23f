# chatqueue — every target installs what it needs; `make test` and `make run` work on a
# fresh machine with PostgreSQL and RabbitMQ reachable on localhost.

PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# Local services used by tests (override to point elsewhere).
CHATQ_TEST_DATABASE_URL ?= postgresql://postgres@127.0.0.1:5432/postgres
CHATQ_TEST_AMQP_URL ?= amqp://guest:guest@127.0.0.1:5672/
CHATQ_TEST_RABBITMQ_API_URL ?= http://guest:guest@127.0.0.1:15672/api
export CHATQ_TEST_DATABASE_URL CHATQ_TEST_AMQP_URL CHATQ_TEST_RABBITMQ_API_URL

PYTEST_ARGS ?=

.PHONY: install test check containers unit integration e2e lint types run demo chaos soak migrate definitions services-check bench tools-bench tools-test tools-unit tools-e2e cluster cluster-stop clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) (Python 3.11)"; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

services-check: install
	$(BIN)/python -m chatq.preflight --database-url "$(CHATQ_TEST_DATABASE_URL)" \
	  --amqp-url "$(CHATQ_TEST_AMQP_URL)" --rabbitmq-api-url "$(CHATQ_TEST_RABBITMQ_API_URL)"

# Tools the tests drive. The unit tests: promtool (Debian's prometheus package) for the
# alert rules and their unit tests, amtool (prometheus-alertmanager) for the Alertmanager
# config, kubectl's kustomize for deploy/k8s. The e2e tests add Chromium for the
# operations page.
tools-unit:
	@command -v promtool >/dev/null || { apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }
	@command -v amtool >/dev/null || { apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus-alertmanager >/dev/null; }
	@command -v kubectl >/dev/null || command -v kustomize >/dev/null || { echo "need kubectl or kustomize on PATH to render deploy/k8s"; exit 1; }

tools-e2e:
	@command -v chromium >/dev/null || { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; }

tools-test: tools-unit tools-e2e

# Every test: unit, integration and e2e, after the type check, then the containers. Exit
# 5 (no tests collected) is a failure.
test: install types tools-test services-check
	$(BIN)/python -m pytest $(PYTEST_ARGS); rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi; exit $$rc
	$(MAKE) containers

# The image and deploy/compose.yaml built and exercised for real (tests/containers): a
# Docker engine of its own in a private network namespace (installed when missing), the
# images built from Debian packages and our Dockerfile, base images cached in
# /var/cache/chatqueue-containers. By hand: flock /tmp/chatq-heavy.lock make containers
containers: install
	bash tests/containers/run.sh

unit: install tools-unit
	$(BIN)/python -m pytest tests/unit $(PYTEST_ARGS)

# The inner loop, under a minute: lint, types, the unit tests and the contract suites
# against the in-memory stores (no services needed).
check: install tools-unit
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/python -m pytest tests/unit tests/contract -q -m "not integration" $(PYTEST_ARGS)

# The contract suites (each store against its fake and Postgres) and the integration tests.
integration: install services-check
	$(BIN)/python -m pytest tests/contract tests/integration $(PYTEST_ARGS)

e2e: install tools-e2e services-check
	$(BIN)/python -m pytest tests/e2e $(PYTEST_ARGS)

lint: install types
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# mypy over shared/ and services/, strict where pyproject's [tool.mypy] says.
types: install
	$(BIN)/mypy

# Regenerate deploy/rabbitmq/definitions.json from shared/broker/topology.py.
definitions: install
	$(BIN)/python -m shared.broker.topology export -o deploy/rabbitmq/definitions.json

migrate: install
	$(BIN)/python -m shared.migrate

# The whole pipeline (receiver with relay, coalescer, responder) on local Postgres and
# RabbitMQ, in the foreground; the seller's settings come from ENV_FILE (.env, git-ignored;
# the environment wins), on built-in defaults otherwise (sandbox chat, facts responder).
# The development admin token is made once and kept in ENV_FILE. Ctrl-C drains and stops.
ENV_FILE ?= .env
run: install
	$(BIN)/python -m chatq.preflight --create-database --start-with-compose --env-file "$(ENV_FILE)"
	$(BIN)/python -m services --env-file "$(ENV_FILE)"

# A local three-node RabbitMQ cluster of the installed RabbitMQ, beside the default node
# (which it leaves alone): AMQP on CLUSTER_PORT..+2, management 10000 higher, Erlang
# distribution 20000 higher, data in /tmp/chatq-cluster-<port>. Prints the
# CHATQ_AMQP_URL that lists the three nodes; `make cluster-stop` stops and removes it.
CLUSTER_PORT ?= 5681
cluster: install
	$(BIN)/python -m chaos.cluster start --base-port $(CLUSTER_PORT)

cluster-stop: install
	$(BIN)/python -m chaos.cluster stop --base-port $(CLUSTER_PORT)

# Load tools: wrk from Debian's packages (pgbench comes with PostgreSQL).
tools-bench:
	@command -v wrk >/dev/null || { apt-get update -qq && apt-get install -y -qq wrk; }
	@command -v pgbench >/dev/null || { echo "pgbench not found (postgresql-client)"; exit 1; }

# Every benchmark in one run, then one table (figure, reference in the same run, ratio,
# goal); JSON in bench/results/. About 13 minutes on 2026-12-06 with its eight steps
# (README's make bench row has each one's); each step prints its own duration.
bench: install services-check tools-bench
	$(BIN)/python -m bench

# The whole pipeline in under a minute against fake platforms: a burst answered once, a
# duplicate ignored, a failure retried, a permanent failure shown, and a summary.
demo: install services-check
	$(BIN)/python -m demo --admin-database-url "$(CHATQ_TEST_DATABASE_URL)" \
	  --amqp-url "$(CHATQ_TEST_AMQP_URL)" --rabbitmq-api-url "$(CHATQ_TEST_RABBITMQ_API_URL)"

# The full fault campaign: every scenario, thousands of messages, the accounting table.
# Restarts the local RabbitMQ in one scenario: run it on a machine of its own. The Postgres
# scenarios run on a private Postgres they start (chaos/postgres.py), never the local one.
# The cluster scenario starts a three-node RabbitMQ cluster of its own (chaos/cluster.py);
# the Postgres outage is watched by a Prometheus server with the alert rules (chaos/prometheus.py).
chaos: install services-check
	@command -v prometheus >/dev/null || { apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }
	$(BIN)/python -m chaos --admin-database-url "$(CHATQ_TEST_DATABASE_URL)" \
	  --amqp-url "$(CHATQ_TEST_AMQP_URL)" --rabbitmq-api-url "$(CHATQ_TEST_RABBITMQ_API_URL)"

# Minutes of steady load with every process's memory and every table's size sampled (not
# in CI). SOAK_ARGS passes options, e.g. make soak SOAK_ARGS="--minutes 10 --rate 50".
SOAK_ARGS ?=
soak: install services-check
	$(BIN)/python -m chaos.soak --admin-database-url "$(CHATQ_TEST_DATABASE_URL)" \
	  --amqp-url "$(CHATQ_TEST_AMQP_URL)" --rabbitmq-api-url "$(CHATQ_TEST_RABBITMQ_API_URL)" $(SOAK_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
