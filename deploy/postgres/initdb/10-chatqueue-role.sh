#!/bin/sh
# Runs once, when Postgres initialises an empty volume (docker-entrypoint-initdb.d; the
# image runs it as the superuser POSTGRES_USER). Two identities, not one:
#   postgres - the superuser, for a person: backups, restores, roles. Never in a service.
#   chatq    - the application role: owns the chatqueue database and its schema (so the
#              migrations can create and alter its tables) and nothing else; not a
#              superuser, cannot create roles or databases.
#   chatq_receiver, chatq_coalescer, chatq_responder - one role per service, named after
#              the application role: LOGIN and nothing else here; every migration run
#              (python -m shared.migrate, as chatq) grants each exactly the tables it uses
#              (shared/roles.py). The services connect as these; chatq only migrates.
#   chatqueue_monitor - the Postgres exporter's: pg_monitor (statistics views) and CONNECT,
#              no table of the application.
# Managed Postgres: run the same statements as its admin user (docs/deploying.md "Roles").
# Variables: CHATQ_DB_USER, CHATQ_DB_PASSWORD, CHATQ_DB_NAME, CHATQ_MONITOR_PASSWORD,
# CHATQ_MONITOR_USER (chatqueue_monitor unless set), CHATQ_RECEIVER_DB_PASSWORD,
# CHATQ_COALESCER_DB_PASSWORD, CHATQ_RESPONDER_DB_PASSWORD (a service's role is made when
# its password is set).
set -eu
psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --dbname "${POSTGRES_DB:-postgres}" \
  -v app_user="$CHATQ_DB_USER" -v app_password="$CHATQ_DB_PASSWORD" -v app_db="$CHATQ_DB_NAME" \
  -v monitor_user="${CHATQ_MONITOR_USER:-chatqueue_monitor}" -v monitor_password="$CHATQ_MONITOR_PASSWORD" <<'SQL'
CREATE ROLE :"app_user" LOGIN PASSWORD :'app_password'
  NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS;
CREATE DATABASE :"app_db" OWNER :"app_user";
REVOKE ALL ON DATABASE :"app_db" FROM PUBLIC;
CREATE ROLE :"monitor_user" LOGIN PASSWORD :'monitor_password'
  NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS IN ROLE pg_monitor;
GRANT CONNECT ON DATABASE :"app_db" TO :"monitor_user";
\connect :"app_db"
REVOKE ALL ON SCHEMA public FROM PUBLIC;
ALTER SCHEMA public OWNER TO :"app_user";
SQL
service_role() {  # service_role NAME PASSWORD: the service's login role, when a password is given
  [ -n "$2" ] || return 0
  psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --dbname "${POSTGRES_DB:-postgres}" \
    -v role="${CHATQ_DB_USER}_$1" -v password="$2" <<'SQL'
CREATE ROLE :"role" LOGIN PASSWORD :'password'
  NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS NOINHERIT;
SQL
}
service_role receiver "${CHATQ_RECEIVER_DB_PASSWORD:-}"
service_role coalescer "${CHATQ_COALESCER_DB_PASSWORD:-}"
service_role responder "${CHATQ_RESPONDER_DB_PASSWORD:-}"
