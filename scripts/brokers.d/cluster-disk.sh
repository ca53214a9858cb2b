# scripts/brokers.d/cluster-disk.sh - each cluster node's data on a small filesystem of its
# own, so one node's disk can be filled (`cluster fill NODE`) and freed (`cluster free NODE`)
# without touching the host's disk or the other nodes; sourced by scripts/brokers (not run).
#
# The filesystem is an ext4 image, DIR/cluster/<node>/disk.img (sparse: it takes on the
# host only what the node writes; BROKERS_CLUSTER_DISK, default 4G, is its size), loop
# mounted on the node's data directory when the node starts and unmounted by `cluster
# down`. Deleting a node's directory deletes its image with its data. Loop mounts need
# root and loop devices: without them the data stays on the host's disk (said once at
# start) and `cluster fill` refuses, naming why.

CLUSTER_DISK_SIZE=${BROKERS_CLUSTER_DISK:-4G}
FILLER=.reliq-disk-filler

node_data_dir() { # NODE: the directory the broker keeps its data in
  case $(node_broker "$1") in
    kafka) echo "$CDIR/$1/data" ;;
    nats) echo "$CDIR/$1/jetstream" ;;
    rabbitmq) echo "$CDIR/$1/mnesia" ;;
  esac
}

# node_disk_mount NODE: its data directory on its own filesystem (before the node starts).
# Data already in the directory (a cluster made before this existed) is moved onto it.
node_disk_mount() {
  local n=$1 d img tmp
  d=$(node_data_dir "$n")
  img=$CDIR/$n/disk.img
  mkdir -p "$d" || return 1
  mountpoint -q "$d" && return 0
  if [ ! -f "$img" ]; then
    truncate -s "$CLUSTER_DISK_SIZE" "$img" \
      && mkfs.ext4 -q -F -m 0 -E lazy_itable_init=1,lazy_journal_init=1 "$img" > /dev/null 2>&1 \
      || { rm -f "$img"; log "$n: no filesystem of its own (mkfs.ext4 failed): its data stays on the host's disk"; return 0; }
  fi
  if [ -n "$(ls -A "$d")" ]; then
    tmp=$CDIR/$n/disk.move
    mkdir -p "$tmp" && mount -o loop "$img" "$tmp" 2> /dev/null \
      || { rmdir "$tmp" 2> /dev/null; log "$n: no filesystem of its own (loop mount refused: root and loop devices needed): its data stays on the host's disk"; return 0; }
    log "$n: moving its data onto its own filesystem ($img)"
    cp -a "$d/." "$tmp/" && umount "$tmp" && rmdir "$tmp" && find "$d" -mindepth 1 -delete \
      || { umount "$tmp" 2> /dev/null; err "$n: moving $d onto $img failed"; return 1; }
  fi
  if ! mount -o loop "$img" "$d" 2> /dev/null; then
    log "$n: no filesystem of its own (loop mount refused: root and loop devices needed): its data stays on the host's disk"
    return 0
  fi
  # mkfs's lost+found in a Kafka log directory would be read as a partition directory
  rmdir "$d/lost+found" 2> /dev/null
  return 0
}

node_disk_unmount() { # NODE: after it stopped (a filler left by an interrupted run goes)
  local d
  d=$(node_data_dir "$1")
  rm -f "$d/$FILLER" "$d/$FILLER.tail"
  mountpoint -q "$d" || return 0
  umount "$d" 2> /dev/null || umount -l "$d" || { err "$1: cannot unmount $d"; return 1; }
}

cmd_cluster_fill() { # NODE: fill its data filesystem until a write fails (ENOSPC)
  local n=${1:-} d
  node_broker "$n" > /dev/null || die "usage: $0 cluster fill NODE (rabbit-1..3, kafka-1..3, nats-1..3)"
  d=$(node_data_dir "$n")
  mountpoint -q "$d" || { err "$n: $d is not a filesystem of its own (see the log of its start): cannot fill it alone"; return 1; }
  # fallocate takes the free blocks without writing them (the image stays sparse on the
  # host); dd takes what fallocate's rounding left
  rabbit_log_mark "$n"
  fallocate -l "$(df --output=avail -B1 "$d" | tail -n 1)" "$d/$FILLER" 2> /dev/null
  dd if=/dev/zero of="$d/$FILLER.tail" bs=64k status=none 2> /dev/null
  log "$n: data filesystem full ($(df --output=used,size -h "$d" | tail -n 1 | awk '{ print $1 " of " $2 }'), $(df --output=avail -B1 "$d" | tail -n 1) bytes free)"
}

# cmd_cluster_free NODE: delete the filler, then bring the node back as an operator would:
# started if its broker exited on the full disk (Kafka takes its only log directory
# offline and halts); restarted if it runs but does not serve: NATS disables JetStream
# on a write error, and a RabbitMQ node whose Raft log crashed on the full disk (ENOSPC
# in ra_log_wal) keeps running while the other nodes no longer list it as running, and one
# where any process crashed on ENOSPC may look well and is not (seen: Ra's coordination
# directory table left closed, every stream consume on the node crashing its channel and
# closing the client's connection with 541 INTERNAL_ERROR). The disk alarm itself
# RabbitMQ clears on its own. Prints what it did (stdout): `started`,
# `restarted` or `running`.
cmd_cluster_free() {
  local n=${1:-} d why
  node_broker "$n" > /dev/null || die "usage: $0 cluster free NODE (rabbit-1..3, kafka-1..3, nats-1..3)"
  d=$(node_data_dir "$n")
  rm -f "$d/$FILLER" "$d/$FILLER.tail"
  log "$n: data filesystem freed ($(df --output=avail -h "$d" | tail -n 1 | tr -d ' ') free)"
  if ! alive "$n"; then
    log "$n: exited while its disk was full; starting it"
    cmd_cluster_start "$n" >&2 && echo started
  elif why=$(node_serves "$n"); then
    echo running
  else
    log "$n: $why since its disk was full; restarting it"
    cmd_cluster_restart "$n" >&2 && echo restarted
  fi
}

# node_serves NODE: it does its part in the cluster (within 20 s for RabbitMQ, whose disk
# alarm clears up to 10 s after the space is back); otherwise says what is wrong
node_serves() {
  local n=$1 o t0=$SECONDS
  case $(node_broker "$n") in
    nats)
      curl -sf -m 5 "http://$(node_host "$n"):$(node_port "$n" 3)/healthz?js-enabled-only=true" > /dev/null \
        || { echo "JetStream is off"; return 1; } ;;
    rabbitmq)
      rabbit_crashed_on_enospc "$n" && { echo "processes of it crashed on ENOSPC (its log)"; return 1; }
      for o in $(cluster_nodes rabbitmq); do [ "$o" != "$n" ] && alive "$o" && break; done
      until rabbit_sees "$o" "$n" > /dev/null 2>&1; do
        ((SECONDS - t0 < 20)) || { echo "$o no longer lists it as running"; return 1; }
        sleep 1
      done ;;
  esac
  return 0
}

# rabbit_log_mark NODE: remember where the log of a RabbitMQ node ends (before a fill)
rabbit_log_mark() {
  [ "$(node_broker "$1")" = rabbitmq ] || return 0
  wc -c < "$CDIR/$1/log/$(rabbit_nodename "$1").log" > "$CDIR/$1/fill-logpos" 2> /dev/null || echo 0 > "$CDIR/$1/fill-logpos"
}
rabbit_crashed_on_enospc() { # NODE: its log names ENOSPC since the mark
  local pos
  pos=$(cat "$CDIR/$1/fill-logpos" 2> /dev/null) || pos=0
  tail -c "+$((pos + 1))" "$CDIR/$1/log/$(rabbit_nodename "$1").log" 2> /dev/null | grep -qi enospc
}

node_disk_note() { # NODE: "disk full" while a filler is in its data directory
  [ -e "$(node_data_dir "$1")/$FILLER" ] && echo "disk full"
  return 0
}
