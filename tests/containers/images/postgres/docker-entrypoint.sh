#!/bin/bash
# The official postgres image's contract, as deploy/compose.yaml uses it.
set -Eeo pipefail
if [ "${1:0:1}" = '-' ]; then set -- postgres "$@"; fi
if [ "$1" = postgres ] && [ "$(id -u)" = 0 ]; then
  mkdir -p "$PGDATA" && chown -R postgres:postgres "$PGDATA" && chmod 700 "$PGDATA"
  exec setpriv --reuid=postgres --regid=postgres --init-groups "$BASH_SOURCE" "$@"
fi
if [ "$1" = postgres ] && [ ! -s "$PGDATA/PG_VERSION" ]; then
  : "${POSTGRES_USER:=postgres}" "${POSTGRES_DB:=$POSTGRES_USER}"; export POSTGRES_USER POSTGRES_DB
  auth="${POSTGRES_HOST_AUTH_METHOD:-scram-sha-256}"
  if [ -z "${POSTGRES_PASSWORD:-}" ] && [ "$auth" != trust ]; then
    echo "error: POSTGRES_PASSWORD is not set (or set POSTGRES_HOST_AUTH_METHOD=trust)" >&2; exit 1
  fi
  pw=$(mktemp); printf '%s' "${POSTGRES_PASSWORD:-}" > "$pw"
  initdb --username="$POSTGRES_USER" --pwfile="$pw" -D "$PGDATA" --auth-local=trust --auth-host="$auth" ${POSTGRES_INITDB_ARGS:-} >/dev/null
  rm -f "$pw"
  echo "listen_addresses = '*'" >> "$PGDATA/postgresql.conf"
  printf 'host all all all %s\n' "$auth" >> "$PGDATA/pg_hba.conf"
  pg_ctl -D "$PGDATA" -o "-c listen_addresses=''" -w start >/dev/null
  psql=(psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --no-password)
  if [ "$POSTGRES_DB" != postgres ]; then "${psql[@]}" --dbname postgres -c "CREATE DATABASE \"$POSTGRES_DB\"" >/dev/null; fi
  for f in /docker-entrypoint-initdb.d/*; do
    case "$f" in
      *.sh) echo "running $f"; if [ -x "$f" ]; then "$f"; else . "$f"; fi ;;
      *.sql) echo "running $f"; "${psql[@]}" --dbname "$POSTGRES_DB" -f "$f" ;;
    esac
  done
  pg_ctl -D "$PGDATA" -m fast -w stop >/dev/null
  echo "PostgreSQL init process complete; ready for start up."
fi
exec "$@"
