# scripts/brokers.d/common.sh - messages, process and port helpers, the per-broker facts
# (ports, PID patterns, logs) and the quiet installs (apt, pip's python) every part uses;
# sourced by scripts/brokers (not run), before its settings: no top-level code here needs them.

# ----------------------------------------------------------------- messages
log()  { printf '[brokers] %s\n' "$*" >&2; }
err()  { printf '[brokers] ERROR: %s\n' "$*" >&2; }
die()  { err "$*"; exit 2; }

# show_logs FILE...: the last 20 lines of each non-empty file, indented
show_logs() {
  local f
  for f in "$@"; do
    [ -s "$f" ] || continue
    printf '    --- last 20 lines of %s\n' "$f" >&2
    tail -n 20 "$f" | sed 's/^/    /' >&2
  done
}

# ----------------------------------------------------------------- processes
# PORT [HOST]; a host other than HOST is a node in a network namespace: without the
# bridge its address would be routed off this machine (and something may answer there)
port_open() {
  [ "${2:-$HOST}" = "$HOST" ] || [ -e "/sys/class/net/$NETNS_BRIDGE" ] || return 1
  timeout 1 bash -c "exec 3<>/dev/tcp/${2:-$HOST}/$1" 2>/dev/null
}

# who holds a listening port (for error messages), empty when unknown
port_owner() {
  command -v ss >/dev/null 2>&1 || return 0
  ss -Hltnp "sport = :$1" 2>/dev/null | grep -o 'users:(([^)]*))' | head -n 1
}

pid_of() { [ -s "$1" ] && tr -dc '0-9' < "$1"; }

# running PID: exists and is not a zombie waiting to be reaped
running() { kill -0 "$1" 2> /dev/null && ! grep -q '^[0-9]* (.*) Z' "/proc/$1/stat" 2> /dev/null; }

# pid_alive PIDFILE PATTERN: the process in PIDFILE runs and its command line
# contains PATTERN (guards against a recycled PID)
pid_alive() {
  local pid
  pid=$(pid_of "$1") || return 1
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null || return 1
  tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | grep -qF -- "$2"
}

# launch BROKER LOGFILE CMD...: start CMD in DIR/BROKER as a daemon in its own
# session (no terminal, survives the caller's process group), PID in DIR/BROKER/pid.
# The background subshell is not a process-group leader, so setsid execs in place
# and $! is the daemon's own PID.
launch() {
  local b=$1 logf=$2
  shift 2
  # NETNS: run it in that network namespace (a cluster node, cluster-netns.sh)
  (cd "$DIR/$b" && exec setsid ${NETNS:+ip netns exec "$NETNS"} "$@" > "$logf" 2>&1 < /dev/null) &
  echo "$!" > "$DIR/$b/pid"
  await_exec "$!" "$1"
}

# await_exec PID WORD: wait (up to 5 s) until the background subshell PID has exec'd a
# command line containing WORD. Until then its command line is this script's, and a
# liveness check by pattern (pid_alive) in that moment calls a starting broker dead. On
# a loaded machine that moment was long enough: chaos rounds' node restarts failed with
# "exited before listening" while the node went on to boot (a single node's empty log;
# a RabbitMQ cluster node whose subshell was still setting up its environment).
await_exec() {
  local pid=$1 word=$2 i
  for ((i = 0; i < 100; i++)); do
    tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | grep -qF -- "$word" && return 0
    kill -0 "$pid" 2>/dev/null || return 0
    sleep 0.05
  done
}

# stop_pid NAME PIDFILE PATTERN [GRACE_SECONDS]: TERM, wait, then KILL
stop_pid() {
  local name=$1 pidf=$2 pat=$3 grace=${4:-30} pid i
  if ! pid_alive "$pidf" "$pat"; then
    rm -f "$pidf"
    log "$name: not running"
    return 0
  fi
  pid=$(pid_of "$pidf")
  kill -TERM "$pid" 2>/dev/null
  for ((i = 0; i < grace * 5; i++)); do
    running "$pid" || break
    sleep 0.2
  done
  if running "$pid"; then
    log "$name: still running after ${grace}s, sending KILL to $pid"
    kill -KILL "$pid" 2>/dev/null
    sleep 0.5
  fi
  rm -f "$pidf"
  log "$name: stopped (pid $pid)"
}

# ----------------------------------------------------------------- per broker facts
ports_of() {
  case $1 in
    rabbitmq) echo "$RABBITMQ_PORT $RABBITMQ_MGMT_PORT $RABBITMQ_DIST_PORT" ;;
    nats) echo "$NATS_PORT $NATS_MONITOR_PORT" ;;
    kafka) echo "$KAFKA_PORT $KAFKA_CONTROLLER_PORT" ;;
    sqs) echo "$SQS_PORT" ;;
    postgres) echo "$POSTGRES_PORT" ;;
    registry) echo "$REGISTRY_PORT $REGISTRY_MGMT_PORT" ;;
    # cluster nodes (see "clusters" below)
    rabbit-[1-3]) node_ports "$1" RABBITMQ_CLUSTER_PORTS RABBITMQ_CLUSTER_MGMT_PORTS RABBITMQ_CLUSTER_DIST_PORTS ;;
    kafka-[1-3]) node_ports "$1" KAFKA_CLUSTER_PORTS KAFKA_CLUSTER_CONTROLLER_PORTS KAFKA_CLUSTER_PROXIED_PORTS ;;
    nats-[1-3]) node_ports "$1" NATS_CLUSTER_PORTS NATS_CLUSTER_ROUTE_PORTS NATS_CLUSTER_MONITOR_PORTS ;;
  esac
}
# list_entry "A,B,C" N: the N-th entry (from 1) of a comma-separated list
list_entry() { local a; IFS=, read -r -a a <<< "$1"; echo "${a[$2 - 1]}"; }
# node_ports NODE LISTVAR...: entry N (NODE = <name>-N) of each comma-separated list
node_ports() {
  local i=${1##*-} v a out=()
  shift
  for v in "$@"; do
    IFS=, read -r -a a <<< "${!v}"
    out+=("${a[i - 1]}")
  done
  echo "${out[*]}"
}
# text that must appear in the command line of the process in DIR/<broker>/pid
pattern_of() {
  case $1 in
    rabbitmq) echo "beam.smp" ;;
    nats) echo "$DIR/nats/nats.conf" ;;
    kafka) echo "$DIR/kafka/server.properties" ;;
    sqs) echo "moto" ;;    # moto_server.py, or `-m moto.server` as started before
    registry) echo "$REGISTRY_HOME/quarkus-run.jar" ;;
    rabbit-[1-3]) echo "-home $CDIR/$1 " ;;   # beam.smp -home <the node's HOME>
    kafka-[1-3]) echo "$CDIR/$1/server.properties" ;;
    nats-[1-3]) echo "$CDIR/$1/nats.conf" ;;
  esac
}
logs_of() {
  case $1 in
    rabbitmq) echo "$DIR/rabbitmq/log/stdout.log $DIR/rabbitmq/log/$RABBITMQ_NODE.log" ;;
    nats) echo "$DIR/nats/nats.log" ;;
    kafka) echo "$DIR/kafka/logs/kafka.out $DIR/kafka/logs/server.log" ;;
    sqs) echo "$DIR/sqs/moto.log" ;;
    registry) echo "$DIR/registry/registry.log" ;;
    postgres) echo "$DIR/postgres/pg_ctlcluster.log $(pg_cluster_field 7)" ;;
    rabbit-[1-3]) echo "$CDIR/$1/log/stdout.log $CDIR/$1/log/$(rabbit_nodename "$1").log" ;;
    kafka-[1-3]) echo "$CDIR/$1/logs/kafka.out $CDIR/$1/logs/server.log" ;;
    nats-[1-3]) echo "$CDIR/$1/nats.log" ;;
  esac
}
# is the process of this script's broker alive? (postgres: not tracked by PID)
alive() {
  case $1 in
    rabbitmq) pid_alive "$DIR/rabbitmq/pid" beam.smp || pid_alive "$DIR/rabbitmq/launcher.pid" rabbitmq-server ;;
    postgres) return 0 ;;
    rabbit-[1-3]) pid_alive "$CDIR/$1/pid" "$(pattern_of "$1")" || pid_alive "$CDIR/$1/launcher.pid" rabbitmq-server ;;
    kafka-[1-3] | nats-[1-3]) pid_alive "$CDIR/$1/pid" "$(pattern_of "$1")" ;;
    *) pid_alive "$DIR/$1/pid" "$(pattern_of "$1")" ;;
  esac
}

# fail BROKER MESSAGE: name the broker, show the end of its logs
fail() {
  local b=$1
  shift
  err "$b: $*"
  # shellcheck disable=SC2046  # word splitting of the log list is intended
  show_logs $(logs_of "$b")
  return 1
}

# check_ports_free BROKER: none of its ports may be taken by someone else
check_ports_free() {
  local b=$1 p owner h
  h=$(node_host "$b")
  for p in $(ports_of "$b"); do
    if port_open "$p" "$h"; then
      owner=$(port_owner "$p")
      err "$b: port $h:$p is already in use by a process this script did not start${owner:+ ($owner)}; stop it or change the port in brokers.env"
      return 1
    fi
  done
}

# wait_ports BROKER: every port of BROKER answers, bounded by WAIT_TIMEOUT
wait_ports() {
  local b=$1 p t0=$SECONDS h
  h=$(node_host "$b")
  for p in $(ports_of "$b"); do
    until port_open "$p" "$h"; do
      alive "$b" || { fail "$b" "exited before listening on $h:$p"; return 1; }
      if ((SECONDS - t0 >= WAIT_TIMEOUT)); then
        fail "$b" "did not listen on $h:$p within ${WAIT_TIMEOUT}s (BROKERS_WAIT_TIMEOUT)"
        return 1
      fi
      sleep 0.3
    done
  done
}

# ----------------------------------------------------------------- installs
# Installs are quiet: output goes to DIR/install/<name>.log, shown on failure.
run_quiet() { # NAME CMD...: run CMD, log to INSTALL_LOGS/NAME.log, show its end on failure
  local name=$1 f t0=$SECONDS rc=0
  shift
  f=$INSTALL_LOGS/$name.log
  "$@" > "$f" 2>&1 || rc=$?
  if [ $rc = 0 ]; then
    log "$name: done in $((SECONDS - t0))s"
    return 0
  fi
  err "$name failed (exit $rc): $*"
  tail -n 40 "$f" | sed 's/^/    /' >&2
  return 1
}

POLICY_RC_CREATED=
cleanup() { [ -n "$POLICY_RC_CREATED" ] && rm -f /usr/sbin/policy-rc.d; }
trap cleanup EXIT
trap 'exit 130' INT TERM

APT_UPDATED=
apt_install() { # PACKAGE...
  if [ "$(id -u)" != 0 ]; then
    err "apt-get install $* needs root"
    return 1
  fi
  # Debian packages start their system service right away (RabbitMQ on all
  # interfaces, a postgres cluster): a policy-rc.d returning 101 forbids that.
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\n# temporary, from reliq scripts/brokers\nexit 101\n' > /usr/sbin/policy-rc.d
    chmod 755 /usr/sbin/policy-rc.d
    POLICY_RC_CREATED=1
  fi
  local rc=0
  export DEBIAN_FRONTEND=noninteractive
  if [ -z "$APT_UPDATED" ]; then
    log "apt-get update"
    run_quiet apt-update apt-get -o DPkg::Lock::Timeout=300 update || rc=1
    APT_UPDATED=1
  fi
  if [ $rc = 0 ]; then
    log "apt-get install $*"
    run_quiet "apt-install-${1}" apt-get -o DPkg::Lock::Timeout=300 install -y -q --no-install-recommends "$@" || rc=1
  fi
  if [ -n "$POLICY_RC_CREATED" ]; then
    rm -f /usr/sbin/policy-rc.d
    POLICY_RC_CREATED=
  fi
  return $rc
}

PY_EXE='' PY_SCRIPTS=''
python_paths() { # the real interpreter behind the (pyenv) python3 and its scripts dir
  [ -n "$PY_EXE" ] && return 0
  if ! PY_EXE=$("$PY" -c 'import sys; print(sys.executable)') \
    || ! PY_SCRIPTS=$("$PY_EXE" -c 'import sysconfig; print(sysconfig.get_path("scripts"))'); then
    err "cannot run $PY (set PYTHON=...)"
    return 1
  fi
}
