# scripts/brokers.d/cluster-netns.sh - the clusters on a network of their own
# (BROKERS_CLUSTER_NETNS=1): every node, and the chaos tests' consumer, a host in its own
# network namespace on a bridge, so one link can be cut or made lossy while the others
# stay up (`cluster net ...`); sourced by scripts/brokers (not run).
#
# Layout: bridge reliq0 with the host at NET.1 (NET: BROKERS_NETNS_NET, 10.77.0); node
# rabbit-N at NET.1N, kafka-N at NET.2N, nats-N at NET.3N, the consumer at NET.100; a
# namespace reliq-<name> each, linked to the bridge by a veth pair (host end vr-<name>,
# inside eth0). Nodes keep their ports from brokers.env and listen on their own address;
# their data is under DIR/cluster-netns (the loopback cluster's stays under DIR/cluster).
# RabbitMQ nodes are rabbit-N@reliq-rabbit-N, each namespace with its own epmd and an
# /etc/netns/reliq-<name>/hosts that names every node (`ip netns exec` mounts it as
# /etc/hosts there); rabbitmqctl runs inside the node's namespace.
#
# Faults act on the bridge, between hosts (an nftables table `bridge reliq_net`, the
# forward hook): packets are dropped silently in the middle, as a broken switch or a
# firewall would, never refused. The kernel here has no netem qdisc
# (CONFIG_NET_SCH_NETEM is not set), so loss is drawn by nftables (numgen) and a slow link
# is a token bucket (tc tbf) on the host's veth end.

NETNS_NET=${BROKERS_NETNS_NET:-10.77.0}
NETNS_BRIDGE=reliq0
NETNS_HOSTS="rabbit-1 rabbit-2 rabbit-3 kafka-1 kafka-2 kafka-3 nats-1 nats-2 nats-3 consumer"

netns_on() { [ "${BROKERS_CLUSTER_NETNS:-0}" = 1 ]; }
netns_ip() { # NAME: its address on the bridge (fails for a name that has none)
  case $1 in
    rabbit-[1-3]) echo "$NETNS_NET.1${1#rabbit-}" ;;
    kafka-[1-3]) echo "$NETNS_NET.2${1#kafka-}" ;;
    nats-[1-3]) echo "$NETNS_NET.3${1#nats-}" ;;
    consumer) echo "$NETNS_NET.100" ;;
    host) echo "$NETNS_NET.1" ;;
    *) return 1 ;;
  esac
}
# node_host NODE: the address NODE listens on (its own in namespaces, else HOST)
node_host() {
  if netns_on && [ "$1" != host ] && netns_ip "$1" > /dev/null; then netns_ip "$1"; else echo "$HOST"; fi
}
node_netns() { netns_on && node_broker "$1" > /dev/null && echo "reliq-$1"; } # NODE: its namespace, if any
node_open() { port_open "$(node_port "$1" "$2")" "$(node_host "$1")"; } # NODE K: its K-th port answers

netns_exists() { [ -e "/run/netns/$1" ]; }
netns_ensure_tools() {
  command -v ip > /dev/null 2>&1 || apt_install iproute2 || return 1
  command -v nft > /dev/null 2>&1 || apt_install nftables || return 1
}

# netns_up: the bridge and every host's namespace (idempotent)
netns_up() {
  local h
  netns_on || return 0
  [ "$(id -u)" = 0 ] || { err "cluster: BROKERS_CLUSTER_NETNS=1 needs root (ip netns)"; return 1; }
  netns_ensure_tools || return 1
  if ! ip link show "$NETNS_BRIDGE" > /dev/null 2>&1; then
    ip link add "$NETNS_BRIDGE" type bridge && ip addr add "$(netns_ip host)/24" dev "$NETNS_BRIDGE" \
      && ip link set "$NETNS_BRIDGE" up || { err "netns: cannot create the bridge $NETNS_BRIDGE"; return 1; }
    log "netns: bridge $NETNS_BRIDGE, the host at $(netns_ip host)"
  fi
  for h in $NETNS_HOSTS; do netns_host_up "$h" || return 1; done
  netns_net_table || return 1
}
netns_host_up() { # NAME: its namespace, veth pair, address and hosts file
  local h=$1 ns=reliq-$1 veth=vr-$1 m
  mkdir -p "/etc/netns/$ns" || return 1
  { echo "127.0.0.1 localhost"
    for m in $(cluster_nodes rabbitmq); do echo "$(netns_ip "$m") reliq-$m"; done
  } > "/etc/netns/$ns/hosts"
  netns_exists "$ns" && ip link show "$veth" > /dev/null 2>&1 && return 0
  netns_exists "$ns" || ip netns add "$ns" || { err "netns: cannot add $ns"; return 1; }
  ip link show "$veth" > /dev/null 2>&1 || ip link add "$veth" type veth peer name eth0 netns "$ns" \
    || { err "netns: cannot link $ns to the bridge"; return 1; }
  ip link set "$veth" master "$NETNS_BRIDGE" up \
    && ip -n "$ns" addr replace "$(netns_ip "$h")/24" dev eth0 \
    && ip -n "$ns" link set eth0 up && ip -n "$ns" link set lo up \
    || { err "netns: cannot configure $ns"; return 1; }
}
# netns_down: namespaces, bridge and fault table gone, once no node runs in them
netns_down() {
  local h n
  netns_on || return 0
  for n in $(cluster_nodes rabbitmq) $(cluster_nodes kafka) $(cluster_nodes nats); do
    alive "$n" && { log "netns: $n still runs, the network stays"; return 0; }
  done
  nft delete table bridge reliq_net 2> /dev/null
  for h in $NETNS_HOSTS; do
    if netns_exists "reliq-$h"; then
      ip netns pids "reliq-$h" 2> /dev/null | xargs -r kill -KILL 2> /dev/null   # strays (a test's consumer)
      ip netns del "reliq-$h"
    fi
    ip link del "vr-$h" 2> /dev/null
    rm -rf "/etc/netns/reliq-$h"
  done
  ip link del "$NETNS_BRIDGE" 2> /dev/null
  log "netns: removed the namespaces and the bridge $NETNS_BRIDGE"
}

# The fault table: pairs (from . to) whose packets the bridge drops, and per host the
# share of its packets dropped either way.
netns_net_table() {
  nft list table bridge reliq_net > /dev/null 2>&1 && return 0
  nft -f - << 'EOF' || { err "netns: cannot install the nftables table bridge reliq_net"; return 1; }
table bridge reliq_net {
  set cut { type ipv4_addr . ipv4_addr; }
  map loss { type ipv4_addr : verdict; }
  chain lossy { numgen random mod 100 < 20 counter drop; }
  chain forward {
    type filter hook forward priority filter; policy accept;
    ip saddr . ip daddr @cut counter drop
    ip saddr vmap @loss
    ip daddr vmap @loss
  }
  # to and from the host's own address (its end of the bridge)
  chain input {
    type filter hook input priority filter; policy accept;
    ip saddr . ip daddr @cut counter drop
    ip saddr vmap @loss
  }
  chain output {
    type filter hook output priority filter; policy accept;
    ip saddr . ip daddr @cut counter drop
    ip daddr vmap @loss
  }
}
EOF
}

# `cluster net ...`
net_usage() {
  die "usage: $0 cluster net up | down | block A B... [--answers] | heal [A B...] | loss A PERCENT | slow A RATE | clear A | show
  A, B: rabbit-1..3, kafka-1..3, nats-1..3, consumer, host (BROKERS_CLUSTER_NETNS=1)
  up, down: the namespaces and the bridge alone (cluster up / down make and remove them)
  block: A and each B stop reaching each other (--answers: B's packets to A only: A's
         requests arrive, the answers are lost); heal: undo (no names: every block)
  loss:  PERCENT (1-100) of A's packets, both ways, dropped (one PERCENT for every lossy
         host: the last one given); slow: A's inbound link
         limited to RATE (tc tbf, e.g. 256kbit); clear: A's loss and slow undone"
}
net_addr() { netns_ip "$1" 2> /dev/null || die "cluster net: unknown host '$1' (rabbit-1..3, kafka-1..3, nats-1..3, consumer, host)"; }
cmd_cluster_net() {
  local sub=${1:-} a b answers=0 pairs=() args=() p
  netns_on || die "cluster net: the clusters are not in namespaces (BROKERS_CLUSTER_NETNS=1)"
  shift || true
  case $sub in
    up) netns_up; return ;;          # the network alone (cluster up makes it too)
    down) netns_down; return ;;      # once no node runs in it (cluster down does it too)
  esac
  netns_exists reliq-consumer || die "cluster net: no namespaces yet (scripts/brokers cluster up with BROKERS_CLUSTER_NETNS=1)"
  netns_net_table || return 1
  case $sub in
    block | heal)
      for p in "$@"; do case $p in --answers) answers=1 ;; *) args+=("$p") ;; esac; done
      if [ "$sub" = heal ] && [ ${#args[@]} -eq 0 ]; then
        nft flush set bridge reliq_net cut && log "net: every block healed"
        return
      fi
      [ ${#args[@]} -ge 2 ] || net_usage
      a=$(net_addr "${args[0]}")
      for p in "${args[@]:1}"; do
        b=$(net_addr "$p")
        pairs+=("$b . $a")
        [ $answers = 1 ] || pairs+=("$a . $b")
      done
      if [ "$sub" = block ]; then
        nft add element bridge reliq_net cut "{ $(IFS=,; echo "${pairs[*]}") }" || return 1
        log "net: ${args[0]} cut from ${args[*]:1}$([ $answers = 1 ] && echo " (answers only)")"
      else
        # each element alone: one that is not there (healed already) must not keep the others
        for p in "${pairs[@]}"; do nft delete element bridge reliq_net cut "{ $p }" 2> /dev/null; done
        log "net: ${args[0]} reaches ${args[*]:1} again"
      fi ;;
    loss)
      a=$(net_addr "${1:-}") p=${2:-}
      [[ $p =~ ^[0-9]+$ ]] && ((p >= 1 && p <= 100)) || net_usage
      nft delete element bridge reliq_net loss "{ $a }" 2> /dev/null
      local draw=(numgen random mod 100 "<" "$p")
      [ "$p" = 100 ] && draw=()            # numgen draws 0..99: `< 100` is refused
      nft flush chain bridge reliq_net lossy && nft add rule bridge reliq_net lossy "${draw[@]}" counter drop \
        && nft add element bridge reliq_net loss "{ $a : jump lossy }" || return 1
      log "net: $1 loses $p % of its packets" ;;
    slow)
      a=${1:-} p=${2:-}
      net_addr "$a" > /dev/null && [ -n "$p" ] || net_usage
      tc qdisc replace dev "vr-$a" root tbf rate "$p" burst 4kb latency 2s || return 1
      log "net: $a's inbound link limited to $p" ;;
    clear)
      a=${1:-}
      b=$(net_addr "$a")
      nft delete element bridge reliq_net loss "{ $b }" 2> /dev/null
      tc qdisc del dev "vr-$a" root 2> /dev/null
      log "net: $a's link is clean again" ;;
    show) nft list table bridge reliq_net; for a in $NETNS_HOSTS; do tc qdisc show dev "vr-$a"; done ;;
    *) net_usage ;;
  esac
}
