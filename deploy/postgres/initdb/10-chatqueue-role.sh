#!/bin/sh
# Runs once, when Postgres initialises an empty volume (docker-entrypoint-initdb.d; the
# image runs it as the superuser POSTGRES_USER). Two identities, not one:
#   postgres - the superuser, for a person: backups, restores, roles. Never in a service.
#   chatq    - the application role: owns the chatqueue database and its schema (so the
#              migrations can create and alter its tables) and nothing else; not a
#              superuser, cannot create roles or databases.
#   chatqueue_monitor - the Postgres exporter's: pg_monitor (statistics views) and CONNECT,
#              no table of the application.
# Managed Postgres: run the same statements as its admin user (docs/deploying.md "Roles").
# Variables: CHATQ_DB_USER, CHATQ_DB_PASSWORD, CHATQ_DB_NAME, CHATQ_MONITOR_PASSWORD,
# CHATQ_MONITOR_USER (chatqueue_monitor unless set).
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
