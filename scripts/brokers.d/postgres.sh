# scripts/brokers.d/postgres.sh - the Debian PostgreSQL cluster and the test role/database
# (install, start, wait, stop); sourced by scripts/brokers (not run).

# The Debian cluster (pg_lsclusters); started/stopped with pg_ctlcluster, and
# stopped by `down` only when this script started it (DIR/postgres/started-here).
POSTGRES_SECURE_CLUSTER=reliq-secure   # the secured set's own cluster (scripts/brokers.d/secure.sh)
pg_cluster_field() { # N [CLUSTER]: field N of the newest cluster line (1 ver 2 name 3 port 4 status 7 log),
  # of CLUSTER when given, else of any cluster but the secured set's
  command -v pg_lsclusters > /dev/null 2>&1 || return 0
  pg_lsclusters -h 2> /dev/null | sort -k1,1V \
    | awk -v want="${2:-}" -v skip="$POSTGRES_SECURE_CLUSTER" '(want == "" && $2 != skip) || $2 == want' \
    | tail -n 1 | awk -v n="$1" '{print $n}'
}
# pg_setup_role PORT LOG: the test role and database on the cluster at PORT, idempotent
# (psql variables keep the quoting right)
pg_setup_role() {
  runuser -u postgres -- psql -X -q -v ON_ERROR_STOP=1 -p "$1" -d postgres \
    -v role="$POSTGRES_USER" -v pw="$POSTGRES_PASSWORD" -v db="$POSTGRES_DB" \
    > "$2" 2>&1 << 'EOF'
SELECT format('CREATE ROLE %I LOGIN CREATEDB PASSWORD %L', :'role', :'pw')
 WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = :'role')\gexec
SELECT format('ALTER ROLE %I LOGIN CREATEDB PASSWORD %L', :'role', :'pw')\gexec
SELECT format('CREATE DATABASE %I OWNER %I', :'db', :'role')
 WHERE NOT EXISTS (SELECT FROM pg_database WHERE datname = :'db')\gexec
EOF
}
ensure_postgres() {
  if ! command -v pg_ctlcluster > /dev/null 2>&1; then
    log "postgres: installing postgresql (apt)"
    apt_install postgresql || return 1
  fi
  if [ -z "$(pg_cluster_field 1)" ]; then
    local ver
    ver=$(find /usr/lib/postgresql -mindepth 1 -maxdepth 1 -printf '%f\n' 2> /dev/null | sort -V | tail -n 1)
    [ -n "$ver" ] || { err "postgres: no PostgreSQL server under /usr/lib/postgresql"; return 1; }
    run_quiet "pg_createcluster-$ver" pg_createcluster "$ver" main || return 1
  fi
}
# The tests' connections at once: eight tests in parallel, a crash-harness test being
# three processes with a pool of 10 each (the default's 100 ran out with four of them).
POSTGRES_MAX_CONNECTIONS=${POSTGRES_MAX_CONNECTIONS:-400}
start_postgres() {
  local d=$DIR/postgres ver name port status live
  mkdir -p "$d"
  ver=$(pg_cluster_field 1) name=$(pg_cluster_field 2) port=$(pg_cluster_field 3) status=$(pg_cluster_field 4)
  [ -n "$ver" ] || { err "postgres: no cluster found (pg_lsclusters)"; return 1; }
  if [ "$port" != "$POSTGRES_PORT" ]; then
    err "postgres: cluster $ver/$name is configured for port $port, brokers.env says POSTGRES_PORT=$POSTGRES_PORT"
    return 1
  fi
  # Written to the cluster's postgresql.conf (read at its next start).
  run_quiet pg_conftool-max_connections \
    pg_conftool "$ver" "$name" set max_connections "$POSTGRES_MAX_CONNECTIONS" || return 1
  case $status in
    online*)
      live=$(runuser -u postgres -- psql -X -qtA -p "$port" -d postgres -c 'show max_connections' 2> /dev/null)
      if [ -f "$d/started-here" ]; then
        if [ -n "$live" ] && [ "$live" -lt "$POSTGRES_MAX_CONNECTIONS" ]; then
          log "postgres: restarting cluster $ver/$name for max_connections=$POSTGRES_MAX_CONNECTIONS (was $live)"
          run_quiet pg_ctlcluster-restart \
            pg_ctlcluster --skip-systemctl-redirect "$ver" "$name" restart || return 1
          return 0
        fi
        log "postgres: already running (cluster $ver/$name)"
      else
        log "postgres: cluster $ver/$name already online (not started by this script; down leaves it)"
        [ -n "$live" ] && [ "$live" -lt "$POSTGRES_MAX_CONNECTIONS" ] \
          && log "postgres: its max_connections is $live (the tests want $POSTGRES_MAX_CONNECTIONS): restart it to apply"
      fi
      return 0 ;;
  esac
  check_ports_free postgres || return 1
  [ "$(id -u)" = 0 ] || { err "postgres: starting the Debian cluster needs root"; return 1; }
  if ! pg_ctlcluster --skip-systemctl-redirect "$ver" "$name" start > "$d/pg_ctlcluster.log" 2>&1; then
    fail postgres "pg_ctlcluster $ver $name start failed"
    return 1
  fi
  echo "$ver $name" > "$d/started-here"
  log "postgres: started cluster $ver/$name"
}
wait_postgres() {
  local t0=$SECONDS
  wait_ports postgres || return 1
  until pg_isready -q -h "$HOST" -p "$POSTGRES_PORT"; do
    ((SECONDS - t0 >= WAIT_TIMEOUT)) && { fail postgres "pg_isready failed for ${WAIT_TIMEOUT}s"; return 1; }
    sleep 0.3
  done
  if ! pg_setup_role "$POSTGRES_PORT" "$DIR/postgres/setup.log"; then
    fail postgres "creating role/database $POSTGRES_USER/$POSTGRES_DB failed"
    show_logs "$DIR/postgres/setup.log"
    return 1
  fi
  # the way the tests connect: TCP + password
  PGPASSWORD=$POSTGRES_PASSWORD PGCONNECT_TIMEOUT=5 psql -X -qtA -h "$HOST" -p "$POSTGRES_PORT" \
    -U "$POSTGRES_USER" -d "$POSTGRES_DB" -c 'select 1' > "$DIR/postgres/login.log" 2>&1 \
    || { fail postgres "login as $POSTGRES_USER over TCP failed"; show_logs "$DIR/postgres/login.log"; return 1; }
}
stop_postgres() {
  local f=$DIR/postgres/started-here ver name
  if [ -f "$f" ]; then
    read -r ver name < "$f"
    if pg_ctlcluster --skip-systemctl-redirect "$ver" "$name" stop > "$DIR/postgres/pg_ctlcluster.log" 2>&1; then
      log "postgres: stopped cluster $ver/$name"
    else
      [ "$(pg_cluster_field 4)" = down ] || { fail postgres "pg_ctlcluster $ver $name stop failed"; return 1; }
    fi
    rm -f "$f"
  elif [ "$(pg_cluster_field 4)" = online ]; then
    log "postgres: not started by this script, left running"
  fi
}
pg_cluster_datadir() { pg_cluster_field 6; } # the main (not the secured set's) cluster
