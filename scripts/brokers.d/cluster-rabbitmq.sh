# scripts/brokers.d/cluster-rabbitmq.sh - the nodes rabbit-1..3 of the RabbitMQ cluster
# (start, join, wait, stop, epmd); sourced by scripts/brokers (not run).

# Node rabbit-N@localhost (in namespaces: rabbit-N@reliq-rabbit-N, each with its own
# epmd); HOME=CDIR/rabbit-N holds a copy of one shared Erlang cookie
# (CDIR/.erlang.cookie), so any node's rabbitmqctl reaches all.
rabbit_nodename() { if netns_on; then echo "$1@reliq-$1"; else echo "$1@localhost"; fi; } # NODE
rabbit_node_env() { rabbit_env "$CDIR/$1" "$(rabbit_nodename "$1")" "$(node_port "$1" 3)" "$(node_host "$1")"; } # NODE; in a subshell
cluster_rabbitmqctl() { # NODE ARGS...  (CTL_TIMEOUT=seconds: bounded; default none); in NODE's namespace
  local n=$1 ns
  shift
  ns=$(node_netns "$n")
  (rabbit_node_env "$n" && exec timeout "${CTL_TIMEOUT:-0}" ${ns:+ip netns exec "$ns"} "$RABBIT_SBIN/rabbitmqctl" -n "$(rabbit_nodename "$n")" "$@")
}
rabbit_cookie() { # NODE: DIR/cluster/NODE/.erlang.cookie = the shared cookie
  local c=$CDIR/.erlang.cookie f=$CDIR/$1/.erlang.cookie r
  if [ ! -s "$c" ]; then
    r=$(set +o pipefail; LC_ALL=C tr -dc '[:upper:]' < /dev/urandom | head -c 20)  # tr ends by SIGPIPE
    [ ${#r} = 20 ] && (umask 077 && printf '%s' "$r" > "$c") || return 1
  fi
  cmp -s "$c" "$f" && return 0
  rm -f "$f" && cp "$c" "$f" && chmod 400 "$f"
}
# rabbit_members NODE FIELD: the short names in FIELD (disk_nodes, running_nodes)
# of NODE's cluster_status
rabbit_members() {
  local out
  out=$(CTL_TIMEOUT=30 cluster_rabbitmqctl "$1" cluster_status --formatter json 2>&1) || { echo "$out"; return 1; }
  sed -n "s/.*\"$2\":\[\([^]]*\)\].*/\1/p" <<< "$out" | tr -d '"' | tr , '\n' | sed 's/@.*//' | sort | tr '\n' ' '
}
# rabbit_sees NODE MEMBER...: NODE's cluster_status lists every MEMBER as running
rabbit_sees() {
  local n=$1 m running
  shift
  running=$(rabbit_members "$n" running_nodes) || { echo "$running"; return 1; }
  for m in "$@"; do
    case " $running " in *" $m "*) ;; *) echo "$n: running nodes are: $running"; return 1 ;; esac
  done
}

start_cluster_rabbit() { # NODE
  local n=$1 d=$CDIR/$1 ns
  mkdir -p "$d/mnesia" "$d/log"
  if alive "$n"; then log "$n: already running (pid $(pid_of "$d/pid" || pid_of "$d/launcher.pid"))"; return 0; fi
  check_ports_free "$n" || return 1
  rabbit_config "$d" "$(node_port "$n" 1)" "$(node_port "$n" 2)" "$(node_host "$n")"
  echo "cluster_name = $BROKERS_CLUSTER_NAME" >> "$d/rabbitmq.conf"
  rabbit_cookie "$n" || { err "$n: cannot write the Erlang cookie in $d"; return 1; }
  # cluster down may stop it (in namespaces each node has its own, gone with the namespace)
  netns_on || pgrep -x epmd > /dev/null 2>&1 || touch "$CDIR/epmd-ours"
  rm -f "$d/pid"
  ns=$(node_netns "$n")
  (rabbit_node_env "$n" && cd "$d" && exec setsid ${ns:+ip netns exec "$ns"} "$RABBIT_SBIN/rabbitmq-server" > "$d/log/stdout.log" 2>&1 < /dev/null) &
  echo $! > "$d/launcher.pid"
  await_exec $! rabbitmq-server
  touch "$d/fresh"
  log "$n: starting (node $(rabbit_nodename "$n"), ports $(ports_of "$n" | tr ' ' ,) on $(node_host "$n"), data $d)"
}

# rabbit_join NODE: make NODE (rabbit-2/3) a member of rabbit-1's cluster, once;
# a node that was a member remembers it and rejoins by itself after a restart
rabbit_join() {
  local n=$1 members f=$CDIR/$1/log/join.log
  members=$(rabbit_members rabbit-1 disk_nodes) || { fail rabbit-1 "cluster_status failed: $members"; return 1; }
  case " $members " in *" $n "*) return 0 ;; esac
  log "$n: joining the cluster of rabbit-1 (stop_app, join_cluster, start_app)"
  if ! { cluster_rabbitmqctl "$n" stop_app && cluster_rabbitmqctl "$n" join_cluster "$(rabbit_nodename rabbit-1)" \
    && cluster_rabbitmqctl "$n" start_app; } > "$f" 2>&1; then
    fail "$n" "could not join rabbit-1 (if its data is stale: scripts/brokers cluster down rabbitmq; rm -rf $CDIR/rabbit-*)"
    show_logs "$f"
    return 1
  fi
}

# rabbit_stale_hint NODE: after NODE failed to boot, name the known case whose only way
# out is new data: a node stopped in the middle of a rolling restart kept feature-flag
# state the others do not share, and it crashes at boot in rabbit_feature_flags
rabbit_stale_hint() {
  grep -rqs 'rabbit_feature_flags' "$CDIR/$1/log" || return 0
  err "$1: it crashed enabling feature flags at boot (seen after a run was interrupted" \
    "during a rolling restart): the cluster's data is stale; start it afresh with" \
    "scripts/brokers cluster down rabbitmq; rm -rf $CDIR/rabbit-*; scripts/brokers cluster up rabbitmq"
}

# rabbit_boot_race NODE: NODE's last boot crashed asking a peer for its feature flags
# while that peer was booting (RabbitMQ 3.10: {incompatible_feature_flags, {badrpc, …
# {badmap, undefined} …}}): a race of nodes started together, not stale data
rabbit_boot_race() {
  tail -n 400 "$CDIR/$1/log/$(rabbit_nodename "$1").log" 2> /dev/null \
    | grep -q 'incompatible_feature_flags,{badrpc,{.EXIT.,{{badmap,undefined}'
}

# nodes of the cluster to wait for (all running ones), e.g. after `cluster up`
wait_cluster_rabbitmq() {
  local n fresh=0 all again=()
  all=$(cluster_nodes rabbitmq)
  for n in $all; do
    if ! wait_ports "$n"; then
      rabbit_boot_race "$n" || { rabbit_stale_hint "$n"; return 1; }
      again+=("$n")
    fi
  done
  # Started again once the others listen, such a node boots (seen after `cluster down`
  # then `cluster up` of all three at once).
  for n in "${again[@]}"; do
    log "$n: crashed at boot syncing feature flags with a peer that was booting too; starting it again"
    start_cluster_rabbit "$n" && wait_ports "$n" || { rabbit_stale_hint "$n"; return 1; }
  done
  for n in $all; do [ -f "$CDIR/$n/fresh" ] && fresh=1; done
  if [ $fresh = 1 ]; then
    rabbit_join rabbit-2 || return 1
    rabbit_join rabbit-3 || return 1
  fi
  # shellcheck disable=SC2086  # the node list is split on purpose
  node_wait rabbit-1 "cluster_status of rabbit-1 lists $all running" rabbit_sees rabbit-1 $all || return 1
  for n in $all; do rm -f "$CDIR/$n/fresh"; done
}

# wait_rejoined_rabbitmq NODE: it answers and another running node lists it as running
wait_rejoined_rabbitmq() {
  local n=$1 other='' m
  wait_ports "$n" || { rabbit_stale_hint "$n"; return 1; }
  for m in $(cluster_nodes rabbitmq); do
    [ "$m" != "$n" ] && alive "$m" && node_open "$m" 1 && { other=$m; break; }
  done
  if [ -f "$CDIR/$n/fresh" ] && [ "$n" != rabbit-1 ] && [ "$other" = rabbit-1 ]; then
    rabbit_join "$n" || return 1    # never joined yet
  fi
  node_wait "$n" "cluster_status of ${other:-$n} lists $n running" rabbit_sees "${other:-$n}" "$n" || return 1
  rm -f "$CDIR/$n/fresh"
}

stop_cluster_rabbit() { # NODE: rabbitmqctl stop, else TERM/KILL
  local n=$1 d=$CDIR/$1 pid
  pid=$(pid_of "$d/pid")
  if pid_alive "$d/pid" "$(pattern_of "$n")" \
    && CTL_TIMEOUT=60 cluster_rabbitmqctl "$n" stop "$d/pid" > /dev/null 2>&1; then
    log "$n: stopped (rabbitmqctl stop, pid $pid)"
    rm -f "$d/pid"
  elif pid_alive "$d/pid" "$(pattern_of "$n")" || ! pid_alive "$d/launcher.pid" rabbitmq-server; then
    stop_pid "$n" "$d/pid" "$(pattern_of "$n")"
  fi
  pid_alive "$d/launcher.pid" rabbitmq-server && stop_pid "$n (booting)" "$d/launcher.pid" rabbitmq-server
  rm -f "$d/launcher.pid" "$d/fresh"
}
# epmd: stopped when this script's cluster caused it to start (or the single node
# handed it over) and no Erlang node is registered any more; otherwise it is handed
# to the single node's `down` when that one is still running
cluster_epmd_release() {
  local pid
  netns_on && return 0                   # each namespace's epmd goes with it (netns_down)
  [ -f "$CDIR/epmd-ours" ] || return 0
  pid=$(pgrep -xo epmd) || { rm -f "$CDIR/epmd-ours"; return 0; }
  if ! ERL_EPMD_ADDRESS=$HOST "/proc/$pid/exe" -names 2> /dev/null | grep -q '^name '; then
    kill -TERM "$pid" 2> /dev/null && log "epmd: stopped (pid $pid)"
  else
    log "epmd: other Erlang nodes still registered, left running"
    if alive rabbitmq; then echo "$pid" > "$DIR/rabbitmq/epmd.pid" && touch "$DIR/rabbitmq/epmd-ours"; fi
  fi
  rm -f "$CDIR/epmd-ours"
}
