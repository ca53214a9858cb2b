# scripts/brokers.d/sqs.sh - the moto server as SQS emulator (install, start, wait, stop);
# sourced by scripts/brokers (not run).

ensure_sqs() {
  python_paths || return 1
  "$PY_EXE" -c 'import moto.server, flask, flask_cors' 2>/dev/null && return 0
  log "sqs: installing moto[server] (pip)"
  run_quiet pip-moto "$PY_EXE" -m pip install -q --disable-pip-version-check 'moto[server]' || return 1
  "$PY_EXE" -c 'import moto.server, flask, flask_cors' \
    || { err "sqs: moto[server] installed but does not import"; return 1; }
}

start_sqs() {
  local d=$DIR/sqs
  mkdir -p "$d"
  if alive sqs; then log "sqs: already running (pid $(pid_of "$d/pid"))"; return 0; fi
  check_ports_free sqs || return 1
  # moto's own server, with one quadratic cost of ReceiveMessage removed (see the file).
  launch sqs "$d/moto.log" "$PY_EXE" "$ROOT/scripts/brokers.d/moto_server.py" -H "$HOST" -p "$SQS_PORT"
  log "sqs: starting moto server (state in memory only)"
}
wait_sqs() { wait_ports sqs; }
stop_sqs() { stop_pid sqs "$DIR/sqs/pid" "$(pattern_of sqs)"; }
