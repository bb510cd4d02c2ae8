#!/bin/sh
# docker/Dockerfile.postgres's entry point: on an empty data directory, initdb with POSTGRES_USER as the superuser
# (password POSTGRES_PASSWORD, scram-sha-256 over TCP) and create POSTGRES_DB, as the official image does; then run
# the server in the foreground on all interfaces (the container's network is the boundary).
set -eu
: "${POSTGRES_USER:=postgres}" "${POSTGRES_DB:=$POSTGRES_USER}"
: "${POSTGRES_PASSWORD:?set POSTGRES_PASSWORD}"
if [ ! -s "$PGDATA/PG_VERSION" ]; then
    password=$(mktemp)
    printf '%s\n' "$POSTGRES_PASSWORD" > "$password"
    initdb -D "$PGDATA" -U "$POSTGRES_USER" --pwfile="$password" --auth-local=trust --auth-host=scram-sha-256 >/dev/null
    rm -f "$password"
    echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
    if [ "$POSTGRES_DB" != postgres ]; then
        pg_ctl -D "$PGDATA" -o "-c listen_addresses=''" -w start >/dev/null
        psql -v ON_ERROR_STOP=1 -U "$POSTGRES_USER" -d postgres -c "CREATE DATABASE \"$POSTGRES_DB\"" >/dev/null
        pg_ctl -D "$PGDATA" -m fast -w stop >/dev/null
    fi
fi
exec postgres -D "$PGDATA" -c listen_addresses='*'
