# scripts/brokers.d/cluster.sh - `scripts/brokers cluster ...`: node names and ports, and the
# commands (up, down, status, kill, start, restart, pause, resume, fill, free, leader, rabbitmqctl); the nodes of
# each broker are in cluster-rabbitmq.sh, cluster-kafka.sh, cluster-nats.sh, their data disks in cluster-disk.sh,
# their network namespaces (BROKERS_CLUSTER_NETNS=1) and `cluster net` in cluster-netns.sh. sourced by scripts/brokers (not run).

# ----------------------------------------------------------------- clusters
# `cluster ...`: a three-node cluster of rabbitmq, kafka and nats each, beside the
# single nodes above: own ports (brokers.env, *_CLUSTER_*), data, logs and PID
# files under DIR/cluster/<node>; nodes are rabbit-1..3, kafka-1..3, nats-1..3.
CLUSTER_BROKERS="rabbitmq kafka nats"

cluster_nodes() { # BROKER: its three node names
  case $1 in
    rabbitmq) echo "rabbit-1 rabbit-2 rabbit-3" ;;
    *) echo "$1-1 $1-2 $1-3" ;;
  esac
}
node_broker() { # NODE: rabbitmq | kafka | nats
  case $1 in
    rabbit-[1-3]) echo rabbitmq ;;
    kafka-[1-3]) echo kafka ;;
    nats-[1-3]) echo nats ;;
    *) return 1 ;;
  esac
}
cluster_broker() { # NAME: the broker's canonical name (rabbit = rabbitmq)
  case $1 in
    rabbit | rabbitmq) echo rabbitmq ;;
    kafka | nats) echo "$1" ;;
    *) return 1 ;;
  esac
}
node_port() { local p; read -r -a p <<< "$(ports_of "$1")"; echo "${p[$2 - 1]}"; } # NODE K: its K-th port
# comma-separated HOST:PORT of entry 1 of every node of BROKER (client ports)
cluster_bootstrap() {
  local n out=()
  for n in $(cluster_nodes "$1"); do out+=("$(node_host "$n"):$(node_port "$n" 1)"); done
  (IFS=,; echo "${out[*]}")
}
cluster_check_settings() { # every *_CLUSTER_*PORTS list: three port numbers
  local v
  for v in RABBITMQ_CLUSTER_PORTS RABBITMQ_CLUSTER_MGMT_PORTS RABBITMQ_CLUSTER_DIST_PORTS \
    KAFKA_CLUSTER_PORTS KAFKA_CLUSTER_CONTROLLER_PORTS KAFKA_CLUSTER_PROXIED_PORTS KAFKA_CLUSTER_PROXY_PORTS \
    NATS_CLUSTER_PORTS NATS_CLUSTER_ROUTE_PORTS NATS_CLUSTER_MONITOR_PORTS; do
    [[ ${!v} =~ ^[0-9]+,[0-9]+,[0-9]+$ ]] || die "$v must be three ports separated by commas, not '${!v}'"
  done
}
# node_wait NODE WHAT CMD...: retry CMD until it succeeds, the node dies or WAIT_TIMEOUT
# passes (then fail with WHAT and CMD's last output); the node's logs on failure
node_wait() {
  local n=$1 what=$2 t0=$SECONDS out
  shift 2
  until out=$("$@" 2>&1); do
    alive "$n" || { fail "$n" "exited while waiting for: $what"; return 1; }
    if ((SECONDS - t0 >= WAIT_TIMEOUT)); then
      fail "$n" "not within ${WAIT_TIMEOUT}s (BROKERS_WAIT_TIMEOUT): $what${out:+; last check said: $(tail -n 3 <<< "$out")}"
      return 1
    fi
    sleep 1
  done
}

# ------------------------------------------- cluster commands
SEL=''
cluster_args() { # BROKER...: SEL = their canonical names, in the order given (default: all three)
  local b c
  SEL=''
  # shellcheck disable=SC2086  # the broker list is split on purpose
  [ $# -gt 0 ] || set -- $CLUSTER_BROKERS
  for b in "$@"; do
    c=$(cluster_broker "$b") || die "cluster: unknown broker '$b' (known: rabbitmq, kafka, nats)"
    case " $SEL " in *" $c "*) ;; *) SEL+="${SEL:+ }$c" ;; esac
  done
}
cluster_ensure() { # BROKER
  case $1 in
    rabbitmq) ensure_rabbitmq ;;
    kafka) ensure_kafka ;;
    nats) ensure_nats ;;
  esac
}
start_node() { # NODE
  node_disk_mount "$1" || return 1
  case $(node_broker "$1") in
    rabbitmq) start_cluster_rabbit "$1" ;;
    kafka) start_cluster_kafka "$1" ;;
    nats) start_cluster_nats "$1" ;;
  esac
}
stop_node() { # NODE
  case $(node_broker "$1") in
    rabbitmq) stop_cluster_rabbit "$1" ;;
    kafka) stop_cluster_kafka "$1" ;;
    nats) stop_cluster_nats "$1" ;;
  esac
}
node_pid() { pid_of "$CDIR/$1/pid" || pid_of "$CDIR/$1/launcher.pid"; } # NODE

cmd_cluster_up() {
  local t0=$SECONDS t b n brokers failed=() started=()
  cluster_args "$@"
  brokers=$SEL
  mkdir -p "$CDIR" "$INSTALL_LOGS" || die "cannot create $CDIR"
  netns_up || die "cluster: the network namespaces could not be set up"
  for b in $brokers; do cluster_ensure "$b" || failed+=("$b"); done
  for b in $brokers; do
    case " ${failed[*]:-} " in *" $b "*) continue ;; esac
    for n in $(cluster_nodes "$b"); do
      start_node "$n" || { failed+=("$b"); continue 2; }
    done
    started+=("$b")
  done
  for b in "${started[@]}"; do
    t=$SECONDS
    if "wait_cluster_$b"; then log "$b cluster: ready (waited $((SECONDS - t))s)"; else failed+=("$b"); fi
  done
  if [ ${#failed[@]} -gt 0 ]; then
    err "cluster: could not bring up: ${failed[*]} (data and logs under $CDIR)"
    return 1
  fi
  log "cluster: all up in $((SECONDS - t0))s; connection settings: $ROOT/brokers.env (RELIQ_*_CLUSTER_URL)"
  # shellcheck disable=SC2086
  cmd_cluster_status $brokers
}

# stop_cluster BROKER: stop its three nodes
stop_cluster() {
  local n pids=()
  case $1 in
    # rabbit-1 last: it boots first next time (the others wait for the last one to stop)
    rabbitmq) for n in rabbit-2 rabbit-3; do stop_cluster_rabbit "$n" & pids+=($!); done
      wait "${pids[@]}"
      stop_cluster_rabbit rabbit-1
      cluster_epmd_release ;;
    # all at once: stopped one by one, the last ones would wait for a controller quorum
    *) for n in $(cluster_nodes "$1"); do stop_node "$n" & pids+=($!); done
      wait "${pids[@]}" ;;
  esac
}

cmd_cluster_down() {
  local b n p pids=() rc=0
  [ -d "$CDIR" ] || { log "cluster: nothing to stop ($CDIR does not exist)"; return 0; }
  cluster_args "$@"
  for b in $SEL; do stop_cluster "$b" & pids+=($!); done
  wait "${pids[@]}"
  for b in $SEL; do
    for n in $(cluster_nodes "$b"); do
      for p in $(ports_of "$n"); do
        if port_open "$p" "$(node_host "$n")"; then err "$n: port $p still open after stop ($(port_owner "$p"))"; rc=1; fi
      done
      node_disk_unmount "$n" || rc=1
    done
  done
  netns_down || rc=1
  return $rc
}

cmd_cluster_status() {
  local b n p closed open state pid note rc=0
  cluster_args "$@"
  printf '%-9s %-9s %-18s %-8s %-8s %s\n' BROKER NODE PORTS STATE PID NOTE
  for b in $SEL; do
    for n in $(cluster_nodes "$b"); do
      closed=() open=0 note='' pid=''
      for p in $(ports_of "$n"); do
        if port_open "$p" "$(node_host "$n")"; then open=1; else closed+=("$p"); fi
      done
      if alive "$n"; then
        pid=$(node_pid "$n")
        if [ ${#closed[@]} -eq 0 ]; then state=up; else state=starting rc=1 note="closed: ${closed[*]}"; fi
      else
        state=down rc=1
        pid=$(node_pid "$n") && note="process $pid is gone"
        pid=
        [ $open = 1 ] && note="${note:+$note; }port held by a process this script did not start"
      fi
      [ -n "$(node_disk_note "$n")" ] && note="${note:+$note; }$(node_disk_note "$n")"
      printf '%-9s %-9s %-18s %-8s %-8s %s\n' "$b" "$n" "$(ports_of "$n" | tr ' ' ,)" "$state" "${pid:--}" "$note"
    done
  done
  return $rc
}

cmd_cluster_kill() { # NODE: SIGKILL, wait until it is gone
  local n=${1:-} pid i
  node_broker "$n" > /dev/null || die "usage: $0 cluster kill NODE (rabbit-1..3, kafka-1..3, nats-1..3)"
  alive "$n" || { err "$n: not running"; return 1; }
  pid=$(node_server_pid "$n")
  kill -KILL "$pid" 2> /dev/null
  # an Erlang VM can take long to be gone after SIGKILL (seen in namespaces: over 60 s,
  # twice, right after a run's start; why is not known yet): up to 120 s, its state
  # logged every 10 s meanwhile
  for ((i = 1; i <= 600; i++)); do
    running "$pid" || break
    ((i % 50)) || log "$n: pid $pid not gone $((i / 5)) s after SIGKILL: state $(awk '{ print $3 }' "/proc/$pid/stat" 2> /dev/null), wchan $(cat "/proc/$pid/wchan" 2> /dev/null), $(ls "/proc/$pid/task" 2> /dev/null | wc -l) threads"
    sleep 0.2
  done
  running "$pid" && { err "$n: pid $pid still there 120 s after SIGKILL"; return 1; }
  for ((i = 0; i < 50; i++)); do alive "$n" || break; sleep 0.2; done  # rabbit: the launcher follows
  rm -f "$CDIR/$n/pid" "$CDIR/$n/launcher.pid"
  log "$n: killed (SIGKILL to pid $pid, gone in $((i / 5)) s)"
}

# the node's server process: the Erlang VM, not its sh launcher (which exits with it);
# a booting rabbit node: the launcher
node_server_pid() { # NODE
  if pid_alive "$CDIR/$1/pid" "$(pattern_of "$1")"; then pid_of "$CDIR/$1/pid"; else node_pid "$1"; fi
}

cmd_cluster_signal() { # STOP|CONT NODE: freeze or thaw the node's server process
  local sig=$1 n=${2:-} pid state
  node_broker "$n" > /dev/null || die "usage: $0 cluster pause|resume NODE (rabbit-1..3, kafka-1..3, nats-1..3)"
  alive "$n" || { err "$n: not running"; return 1; }
  pid=$(node_server_pid "$n")
  kill "-$sig" "$pid" || { err "$n: SIG$sig to pid $pid failed"; return 1; }
  # /proc/PID/stat field 3: T once stopped; anything else once thawed
  state=$(awk '{ print $3 }' "/proc/$pid/stat" 2> /dev/null)
  if [ "$sig" = STOP ]; then
    [ "$state" = T ] || { sleep 0.2; state=$(awk '{ print $3 }' "/proc/$pid/stat"); }
    [ "$state" = T ] || { err "$n: pid $pid not stopped (state $state)"; return 1; }
    log "$n: paused (SIGSTOP to pid $pid)"
  else
    log "$n: resumed (SIGCONT to pid $pid)"
  fi
}

cmd_cluster_restart() { # NODE: a graceful stop (as `down` does), then `start`
  local n=${1:-} t0=$SECONDS
  node_broker "$n" > /dev/null || die "usage: $0 cluster restart NODE (rabbit-1..3, kafka-1..3, nats-1..3)"
  alive "$n" || { err "$n: not running"; return 1; }
  stop_node "$n" || return 1
  ! alive "$n" || { err "$n: still running after its stop"; return 1; }
  log "$n: stopped gracefully in $((SECONDS - t0))s"
  cmd_cluster_start "$n"
}

cmd_cluster_start() { # NODE: start it, wait until it is back in the cluster
  local n=${1:-} b t0=$SECONDS
  b=$(node_broker "$n") || die "usage: $0 cluster start NODE (rabbit-1..3, kafka-1..3, nats-1..3)"
  mkdir -p "$CDIR" "$INSTALL_LOGS" || die "cannot create $CDIR"
  netns_up || return 1
  cluster_ensure "$b" || return 1
  start_node "$n" || return 1
  "wait_rejoined_$b" "$n" || return 1
  log "$n: back in the $b cluster (waited $((SECONDS - t0))s)"
}

# leader_claim BROKER WHAT [VHOST]: the leader of WHAT as some running node sees it
# (that view can be stale for a few seconds after the leader died)
leader_claim() {
  local b=$1 what=$2 vhost=${3:-/} n out id
  case $b in
    kafka)
      if [ "$what" = controller ]; then
        out=$(CTL_TIMEOUT=60 kafka_cluster_tool org.apache.kafka.tools.MetadataQuorumCommand describe --status 2>&1) \
          || { echo "describe --status failed: $(tail -n 3 <<< "$out")"; return 1; }
        id=$(sed -n 's/^LeaderId: *\([0-9-]*\).*/\1/p' <<< "$out")
      else
        if ! out=$(CTL_TIMEOUT=60 kafka_cluster_tool org.apache.kafka.tools.TopicCommand --describe --topic "${what%:*}" 2>&1); then
          grep -q 'does not exist' <<< "$out" && { echo "topic '${what%:*}' does not exist"; return 1; }
          echo "describe ${what%:*} failed: $(head -n 1 <<< "$out")"
          return 1
        fi
        id=$(awk -v p="${what##*:}" '{ for (i = 1; i < NF; i++) { if ($i == "Partition:") q = $(i + 1); if ($i == "Leader:" && q == p) { print $(i + 1); exit } } }' <<< "$out")
      fi
      [[ $id =~ ^[1-3]$ ]] || { echo "no leader for $what (${id:-partition not found})"; return 1; }
      echo "kafka-$id" ;;
    rabbitmq)
      local unknown=0 silent=0
      for n in $(cluster_nodes rabbitmq); do
        node_open "$n" 1 || { silent=1; continue; }
        # quorum queue: its leader; classic queue: the node of its process (<rabbit-2@localhost.1.2.3>)
        out=$(CTL_TIMEOUT=30 cluster_rabbitmqctl "$n" list_queues -p "$vhost" name leader pid --no-table-headers --quiet 2>&1) \
          || { silent=1; continue; }
        id=$(awk -F'\t' -v q="$what" '$1 == q { print ($2 != "" ? $2 : $3); f = 1; exit } END { if (!f) print "?" }' <<< "$out")
        # a node back from a restart (a full disk, a split) may not list the cluster's
        # queues yet: ask the others before calling the queue unknown
        [ "$id" != "?" ] || { unknown=1; continue; }
        id=${id#<}
        [ -n "$id" ] || { echo "queue '$what' has no leader (an election)"; return 1; }
        echo "${id%%@*}"
        return 0
      done
      # Unknown only when every node answered without it: while one is down or does not
      # answer, the ones that did may be a node just back that lists nothing yet.
      [ $silent = 1 ] && { echo "not every node answers (queue '$what' not listed yet)"; return 1; }
      [ $unknown = 0 ] || { echo "no queue '$what' in vhost $vhost"; return 1; }
      echo "no cluster node answers"
      return 1 ;;
    nats)
      local known=0
      for n in $(cluster_nodes nats); do
        node_open "$n" 3 || continue
        id=$(nats_leader_seen_by "$n" "$what") || continue   # NODE does not know the stream
        known=1
        [ -n "$id" ] || continue
        # the claimed leader must agree (the others notice a dead leader late)
        [ "$(nats_leader_seen_by "$id" "$what" 2> /dev/null)" = "$id" ] && { echo "$id"; return 0; }
      done
      [ $known = 1 ] || { echo "stream '$what' not found (or no node answers)"; return 1; }
      echo "no leader for '$what' yet (an election)"
      return 1 ;;
  esac
}
nats_leader_seen_by() { # NODE STREAM|meta: the leader NODE reports (fails: NODE knows no such stream)
  node_broker "$1" > /dev/null || return 1
  if [ "$2" = meta ]; then nats_meta_leader "$1"; return 0; fi
  # stream_detail of every account: the leader sits in the stream's "cluster" object
  curl -fsS --max-time 5 "http://$(node_host "$1"):$(node_port "$1" 3)/jsz?accounts=true&streams=true" 2> /dev/null \
    | STREAM=$2 "$PY" -c '
import json, os, sys
j = json.load(sys.stdin)
for a in j.get("account_details") or []:
    for s in a.get("stream_detail") or []:
        if s.get("name") == os.environ["STREAM"]:
            print((s.get("cluster") or {}).get("leader") or ""); sys.exit()
sys.exit(1)' 2> /dev/null
}

# cmd_cluster_leader BROKER WHAT [VHOST]: print the node that leads WHAT now (e.g.
# kafka-2): a running node whose ports answer; waits (BROKERS_WAIT_TIMEOUT) through
# an election
cmd_cluster_leader() {
  local b what=${2:-} out t0=$SECONDS
  if ! b=$(cluster_broker "${1:-}" 2> /dev/null) || [ -z "$what" ]; then
    die "usage: $0 cluster leader kafka TOPIC:PARTITION|controller | rabbitmq QUEUE [VHOST] | nats STREAM|meta"
  fi
  if [ "$b" = kafka ]; then
    [ -f "$KAFKA_HOME/.resolved" ] || die "kafka: jars not resolved yet, run: $0 cluster up kafka"
    [ -f "$DIR/kafka/tools-log4j2.properties" ] || kafka_tools_log4j
    [[ $what == controller || $what == *:* ]] || die "kafka: WHAT is TOPIC:PARTITION (e.g. orders:0) or controller"
  fi
  while :; do
    if out=$(leader_claim "$b" "$what" "${3:-}"); then
      alive "$out" && node_open "$out" 1 && { echo "$out"; return 0; }
      out="$out is not running (an election is due)"
    else
      # unknown: fail fast on a wrong name, but give a cluster 10 s to agree on its
      # metadata (a node just back may answer first)
      case $out in *"no queue"* | *"not found"* | *"does not exist"*)
        ((SECONDS - t0 < 10)) || { err "$b: $out"; return 1; } ;;
      esac
    fi
    if ((SECONDS - t0 >= WAIT_TIMEOUT)); then
      err "$b: no running leader for $what within ${WAIT_TIMEOUT}s: $out"
      return 1
    fi
    sleep 1
  done
}

cmd_cluster() {
  local sub=${1:-}
  shift || true
  cluster_check_settings
  case $sub in
    up) cmd_cluster_up "$@" ;;
    down) cmd_cluster_down "$@" ;;
    status) cmd_cluster_status "$@" ;;
    kill) cmd_cluster_kill "$@" ;;
    start) cmd_cluster_start "$@" ;;
    restart) cmd_cluster_restart "$@" ;;
    fill) cmd_cluster_fill "$@" ;;
    free) cmd_cluster_free "$@" ;;
    pause) cmd_cluster_signal STOP "$@" ;;
    resume) cmd_cluster_signal CONT "$@" ;;
    leader) cmd_cluster_leader "$@" ;;
    net) cmd_cluster_net "$@" ;;
    rabbitmqctl)
      local n
      if node_broker "${1:-}" > /dev/null; then n=$1; shift; else n=rabbit-1; fi
      [ "$(node_broker "$n")" = rabbitmq ] || die "cluster rabbitmqctl: $n is not a rabbit node"
      cluster_rabbitmqctl "$n" "$@" ;;
    *) usage >&2; exit 2 ;;
  esac
}
