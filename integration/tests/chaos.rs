//! Chaos on three-node clusters (`scripts/brokers cluster up`): the crash harness
//! (`reliq_integration::crash::run_with_faults`: orders through the outbox, the inventory
//! consumer with its durable inbox SIGKILLed 5 times, two of them between COMMIT and ack)
//! with twelve faults injected meanwhile, timed from the moment the orders are in the
//! outbox.
//!
//! The clusters run on loopback (`just chaos`) or with every node and the consumer a
//! host of its own (`just chaos-netns`: `BROKERS_CLUSTER_NETNS=1`, a network namespace
//! each on a bridge, `scripts/brokers.d/cluster-netns.sh`). On loopback the consumer
//! reaches each node through a [`FaultProxy`], which the link faults stall; in
//! namespaces it connects straight to the nodes and the link faults drop its packets on
//! the bridge (`scripts/brokers cluster net`), as a broken network does — silently, TCP
//! retransmitting — and the split can cut nodes off from each other:
//!
//! - **node loss** (+3 s): the leader of the consumer's queue / partition / stream
//!   SIGKILLed, started again 15 s later;
//! - **DLQ outage** (+10 s, 30 s): the consumer's DLQ refuses dead letters or does not
//!   confirm them (see [`dlq_outage`]); the DLQ must not grow meanwhile, and what was held
//!   back must land after;
//! - **stall** (+45 s, 10 s): every link of the consumer to the brokers cut both ways;
//! - **dependency partition** (+15 s, 30 s): the consumer cut off from its inbox database
//!   (PostgreSQL, through a [`FaultProxy`]) while the brokers stay reachable: its
//!   handler's claims fail, the consumer's circuit breaker opens and it stops taking
//!   messages — none may be parked for it (see [`database_partition`]);
//! - **leader partition** (+58 s, 12 s): the consumer cut off from the node leading its
//!   data only, both ways, while the nodes still reach each other (see
//!   [`leader_partition`]);
//! - **one-way partition** (+72 s, 12 s): the same node receives what the consumer sends
//!   and its answers are held: it acts on requests (commits, acks, confirms) the consumer
//!   hears nothing of — the ambiguous acknowledgement (see [`one_way_partition`]);
//! - **node pause** (+86 s, 20 s): the leader of the consumer's data frozen (SIGSTOP),
//!   then thawed (see [`node_pause`]);
//! - **packet loss** (+110 s, 60 s): 20 % of the packets between the consumer and every
//!   node dropped by the kernel (nftables; see [`lossy_links`]). The kernel here has no
//!   netem, so delay, duplication and reordering are not injected (TCP hides the last two
//!   from the clients; the loss's retransmissions make the delays);
//! - **disk full** (+125 s, 20 s): the data filesystem of the node leading the consumer's
//!   data (its own loop-mounted image) filled until writes fail, then freed and the node
//!   brought back as an operator would (see [`disk_full`]);
//! - **split** (+150 s, 15 s; namespaces only): the node leading the consumer's data cut
//!   off from the two others, the consumer still reaching all three (see [`split`]);
//! - **rolling restart** (+175 s): every node stopped gracefully and started again, one
//!   after the other, each back in the cluster before the next goes;
//! - **consumer pause**: after the kills a standby member joins the consumer's group,
//!   and the last consumer run is frozen (SIGSTOP) once it holds deliveries, for twice what
//!   the broker waits on a silent consumer ([`silence_limit`]: the Kafka session, the
//!   RabbitMQ heartbeat timeout, the NATS `ack_wait`), then thawed — a zombie, whose
//!   deliveries went to the standby meanwhile. The crash harness does it, between the
//!   kills and the end of the work, so its moment follows the kills, not the clock.
//!
//! Every consumer process of a round runs with its wall clock **skewed** 5 minutes ahead
//! (even seed) or behind (odd seed), as on a host whose NTP is off
//! ([`reliq_integration::skew`]); the round checks each process's clock was off by that.
//! Retry delays, leases and the NATS schedules must not depend on it; `max_age` (10 min in
//! the example) reads the consumer's clock against the producer's, so ahead it runs 5
//! minutes short — still beyond a round's length.
//!
//! The harness's checker then fails on any lost order, any double reservation, any DLQ
//! entry other than the injected poison or with another reason than its injected one, any
//! order shown more than once by the DLQ reader, and a DLQ count other than the orders
//! parked.
//!
//! Not in `just test` (a cluster costs ~50 s to start and nine processes): `just chaos`
//! starts the clusters, points the tests' URLs at them and runs this binary alone
//! (nextest profile `chaos`). A test here fails, rather than passing on a single node,
//! when its URL does not name three nodes.
//!
//! `RELIQ_CHAOS_ORDERS` (default 10,000, which keeps the consumer
//! busy through every fault), `RELIQ_CRASH_SEED` as in the crash harness,
//! `RELIQ_CHAOS_FAULTS=node,dlq,dbcut,stall,leadercut,oneway,nodepause,loss,diskfull,split,rolling,consumerpause` to
//! inject only some, `RELIQ_CHAOS_SKEW_MS` for another skew (0: none). The inbox and outbox are on PostgreSQL (`RELIQ_POSTGRES_URL`; `just
//! chaos` starts it).

use reliq_core::seam::lock;
use reliq_core::seam::secrets::redact_url;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use futures::FutureExt;
use reliq_integration::crash::{self, Backend, Scenario, Store};
use reliq_integration::packet_loss::PacketLoss;
use reliq_integration::proxy::FaultProxy;
use reliq_integration::settings;
use tokio::process::Command;
use tokio::time::Instant;

/// `scripts/brokers ARGS…`, its stdout.
async fn script(args: &[&str]) -> anyhow::Result<String> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/brokers");
    let out = Command::new(script)
        .args(args)
        .output()
        .await
        .with_context(|| format!("running scripts/brokers {args:?}"))?;
    ensure!(
        out.status.success(),
        "scripts/brokers {args:?}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// `scripts/brokers cluster ARGS…`, its stdout.
async fn cluster(args: &[&str]) -> anyhow::Result<String> {
    script(&[&["cluster"], args].concat()).await
}

/// What leads the consumer's data on `backend`, in `scripts/brokers cluster leader` terms.
fn led(backend: Backend, topic: &str) -> (&'static str, String) {
    let sub = reliq_examples::orders::subscription(topic);
    match backend {
        Backend::Rabbit => ("rabbitmq", reliq_rabbit::queue_name(&sub)),
        Backend::Kafka => ("kafka", format!("{topic}:0")),
        Backend::Nats => ("nats", reliq_nats::stream_name(topic)),
        other => unreachable!("no cluster for {other:?}"),
    }
}

/// When each fault starts (after the orders are in the outbox and the relay runs) and
/// how long it lasts. Apart, so each one's effect can be told from the others'; all
/// within the consumer's busy time at 10,000 orders (and the run waits for them).
const NODE_LOSS_AT: Duration = Duration::from_secs(3);
const NODE_DOWN: Duration = Duration::from_secs(15);
const DLQ_OUTAGE_AT: Duration = Duration::from_secs(10);
const DLQ_OUTAGE: Duration = Duration::from_secs(30);
const DB_CUT_AT: Duration = Duration::from_secs(15);
const DB_CUT: Duration = Duration::from_secs(30);
const STALL_AT: Duration = Duration::from_secs(45);
const STALL: Duration = Duration::from_secs(10);
const LEADER_CUT_AT: Duration = Duration::from_secs(58);
const LEADER_CUT: Duration = Duration::from_secs(12);
const ONE_WAY_AT: Duration = Duration::from_secs(72);
const ONE_WAY: Duration = Duration::from_secs(12);
const NODE_PAUSE_AT: Duration = Duration::from_secs(86);
const NODE_PAUSE: Duration = Duration::from_secs(20);
const LOSS_AT: Duration = Duration::from_secs(110);
const LOSS: Duration = Duration::from_secs(60);
const LOSS_PERCENT: u8 = 20;
const DISK_FULL_AT: Duration = Duration::from_secs(125);
const DISK_FULL: Duration = Duration::from_secs(20);
const SPLIT_AT: Duration = Duration::from_secs(150);
const SPLIT: Duration = Duration::from_secs(15);
const ROLLING_AT: Duration = Duration::from_secs(175);

/// The consumer pause's `RELIQ_CHAOS_FAULTS` name: the crash harness freezes the
/// consumer ([`Scenario::pause`]), not the fault task.
const CONSUMER_PAUSE: &str = "consumerpause";

/// The heartbeat timeout the round's RabbitMQ consumers ask for (`heartbeat=20`). With
/// the server's 60 s a consumer pause of twice that would freeze the last run for two
/// minutes, and a round could outlast what `max_age` (10 min) leaves a consumer whose
/// clock is 5 minutes ahead; longer than the 10 s stall and the 12 s partitions, which
/// then do not close the connection by themselves.
const RABBIT_HEARTBEAT: Duration = Duration::from_secs(20);

/// How long the broker waits on a silent consumer before it hands that consumer's
/// deliveries to another: the Kafka session (reliq's default `session.timeout.ms`), the
/// RabbitMQ heartbeat timeout ([`RABBIT_HEARTBEAT`]), the NATS `ack_wait` (the crash
/// harness's lease). A consumer frozen longer comes back a zombie.
fn silence_limit(backend: Backend) -> Duration {
    match backend {
        Backend::Kafka => reliq_kafka::DEFAULT_SESSION_TIMEOUT,
        Backend::Rabbit => RABBIT_HEARTBEAT,
        _ => crash::LEASE,
    }
}

/// Whether the round injects the fault `name`: `RELIQ_CHAOS_FAULTS=node,stall` picks
/// some, to look into one; unset or empty, every one.
fn fault_on(name: &str) -> bool {
    match std::env::var("RELIQ_CHAOS_FAULTS") {
        Ok(picked) if !picked.trim().is_empty() => picked.split(',').any(|p| p.trim() == name),
        _ => true,
    }
}

/// Every fault the fault task injects, by its `RELIQ_CHAOS_FAULTS` name.
const FAULTS: [&str; 11] = [
    "node",
    "dlq",
    "dbcut",
    "stall",
    "leadercut",
    "oneway",
    "nodepause",
    "loss",
    "diskfull",
    "split",
    "rolling",
];

/// The faults of one run, side by side: the leader killed and restarted, the DLQ
/// unavailable, the consumer cut off from its database, the consumer's connections
/// stalled, the consumer cut off from the leader
/// both ways and then one way, the leader frozen, the consumer's links lossy, the
/// leader's disk full, every node restarted in turn.
fn faults(backend: Backend, links: Arc<Links>, database: Arc<FaultProxy>) -> crash::Faults {
    Box::new(move |topic: String| {
        async move {
            let t0 = Instant::now();
            let (
                node,
                dlq,
                db_cut,
                stall,
                leader_cut,
                one_way,
                node_pause,
                loss,
                disk_full,
                split,
                rolling,
            ) = tokio::join!(
                injected("node", fault_on("node"), node_loss(backend, &topic, t0)),
                injected("dlq", fault_on("dlq"), dlq_outage(backend, &topic, t0)),
                injected(
                    "dbcut",
                    fault_on("dbcut"),
                    database_partition(&database, t0)
                ),
                injected("stall", fault_on("stall"), stall(&links, t0)),
                injected(
                    "leadercut",
                    fault_on("leadercut"),
                    leader_partition(backend, &topic, &links, t0)
                ),
                injected(
                    "oneway",
                    fault_on("oneway"),
                    one_way_partition(backend, &topic, &links, t0)
                ),
                injected(
                    "nodepause",
                    fault_on("nodepause"),
                    node_pause(backend, &topic, t0)
                ),
                injected("loss", fault_on("loss"), lossy_links(&links, t0)),
                injected(
                    "diskfull",
                    fault_on("diskfull"),
                    disk_full(backend, &topic, t0)
                ),
                injected(
                    "split",
                    fault_on("split"),
                    split(backend, &topic, &links, t0)
                ),
                injected("rolling", fault_on("rolling"), rolling_restart(backend, t0)),
            );
            // Every fault runs to its end (each heals what it broke) before a failed one
            // stops the run: dropped half-way, a rolling restart left a node stopped.
            [
                node, dlq, db_cut, stall, leader_cut, one_way, node_pause, loss, disk_full, split,
                rolling,
            ]
            .into_iter()
            .collect()
        }
        .boxed()
    })
}

/// `fault`'s account of itself, or that `name` was left out.
async fn injected(
    name: &str,
    on: bool,
    fault: impl Future<Output = anyhow::Result<String>>,
) -> anyhow::Result<String> {
    if on {
        fault.await.with_context(|| format!("fault `{name}`"))
    } else {
        Ok(format!("{name}: not injected"))
    }
}

/// Kill the leader of the consumer's data, start it again [`NODE_DOWN`] later.
async fn node_loss(backend: Backend, topic: &str, t0: Instant) -> anyhow::Result<String> {
    tokio::time::sleep_until(t0 + NODE_LOSS_AT).await;
    leader_out(backend, topic, t0, NODE_DOWN, ["kill", "start"]).await
}

/// Freeze the leader of the consumer's data (SIGSTOP) for [`NODE_PAUSE`], then thaw it:
/// longer than a Kafka broker's session with the controller (9 s), a NATS leader's
/// election timeout and a consumer's request timeouts, shorter than Erlang's net tick
/// (60 s), so RabbitMQ's other nodes do not see it as down. Its ports keep accepting
/// connections meanwhile: a frozen node answers nothing, which is not a closed port.
async fn node_pause(backend: Backend, topic: &str, t0: Instant) -> anyhow::Result<String> {
    tokio::time::sleep_until(t0 + NODE_PAUSE_AT).await;
    leader_out(backend, topic, t0, NODE_PAUSE, ["pause", "resume"]).await
}

/// Fill the data filesystem of the node leading the consumer's data (its own loop-mounted
/// image, `scripts/brokers cluster fill`) for [`DISK_FULL`], then free it and bring the
/// node back as an operator would (`cluster free`): Kafka takes its only log directory
/// offline and the broker exits (started again), NATS disables JetStream on the node
/// (restarted), RabbitMQ raises its disk alarm, which blocks publishers on every node
/// until it clears.
async fn disk_full(backend: Backend, topic: &str, t0: Instant) -> anyhow::Result<String> {
    tokio::time::sleep_until(t0 + DISK_FULL_AT).await;
    let (broker, what) = led(backend, topic);
    let node = cluster(&["leader", broker, &what]).await?;
    cluster(&["fill", &node]).await?;
    let filled = t0.elapsed();
    tokio::time::sleep(DISK_FULL).await;
    let freed = t0.elapsed();
    // `started` (it exited), `restarted` (JetStream was off) or `running`.
    let node_was = cluster(&["free", &node]).await?;
    Ok(format!(
        "{node} (leader of {what}): disk full +{:.1} → +{:.1} s, then {node_was} (back at +{:.1} s); leader now {}",
        filled.as_secs_f64(),
        freed.as_secs_f64(),
        t0.elapsed().as_secs_f64(),
        cluster(&["leader", broker, &what]).await?
    ))
}

/// Cut the consumer off from the node leading its data for [`LEADER_CUT`]: that node's
/// proxy holds every byte both ways, on open and new connections (packets dropped, not
/// refused), while the nodes still reach each other — the consumer on the small side of
/// a partition that isolates it from the leader only. RabbitMQ and NATS clients must move
/// to another node; a Kafka client cannot (the partition has one leader) and must wait it
/// out without losing its place.
async fn leader_partition(
    backend: Backend,
    topic: &str,
    links: &Links,
    t0: Instant,
) -> anyhow::Result<String> {
    tokio::time::sleep_until(t0 + LEADER_CUT_AT).await;
    cut_from_leader(backend, topic, links, t0, LEADER_CUT, Cut::BothWays).await
}

/// For [`ONE_WAY`], the node leading the consumer's data gets what the consumer sends
/// and its answers are held: it commits offsets, acknowledges and confirms publishes the
/// consumer does not hear of, so the consumer times out on work that was done (the
/// ambiguous acknowledgement), and sees it all arrive at once when the link heals.
async fn one_way_partition(
    backend: Backend,
    topic: &str,
    links: &Links,
    t0: Instant,
) -> anyhow::Result<String> {
    tokio::time::sleep_until(t0 + ONE_WAY_AT).await;
    cut_from_leader(backend, topic, links, t0, ONE_WAY, Cut::Answers).await
}

/// How long a partition waits for the consumer to hold a connection before it cuts
/// (short: the next fault is due 14 s after this one starts).
const CONNECTED_WAIT: Duration = Duration::from_secs(3);

/// `fault` on the proxy of the node leading the consumer's data for `held`, then its
/// links resumed whatever happens meanwhile. When the consumer holds no connection to
/// that node — a RabbitMQ client talks to one node of its choice, which the quorum
/// queue's leader need not be — the node it is connected to instead: a partition that
/// misses the consumer tests nothing.
async fn cut_from_leader(
    backend: Backend,
    topic: &str,
    links: &Links,
    t0: Instant,
    held: Duration,
    cut: Cut,
) -> anyhow::Result<String> {
    // The consumer can be between connections when the fault is due (restarted after a
    // kill, or reconnecting): give it a moment to hold one, so the partition cuts it
    // rather than nobody (round R's leader cut on RabbitMQ found 0 connections).
    let connected_by = Instant::now() + CONNECTED_WAIT;
    while links.busiest().await.is_none() && Instant::now() < connected_by {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (broker, what) = led(backend, topic);
    let leader = cluster(&["leader", broker, &what]).await?;
    let mut index = node_index(&leader)?;
    let mut node = format!("{leader} (leader of {what})");
    let open = links.connections().await;
    if open.get(index).copied().unwrap_or(0) == 0
        && let Some((busiest, _)) = links.busiest().await
    {
        index = busiest;
        node = format!(
            "{} (the consumer's; {leader} leads {what})",
            node_names(backend)[index]
        );
    }
    let open = open.get(index).copied().unwrap_or(0);
    links.cut(index, cut).await?;
    let from = t0.elapsed();
    tokio::time::sleep(held).await;
    links.heal(index, cut).await?;
    Ok(format!(
        "the consumer's link to {node}, {open} connection(s) open: {} +{:.1} → +{:.1} s{}",
        cut.how(),
        from.as_secs_f64(),
        t0.elapsed().as_secs_f64(),
        links.via()
    ))
}

/// From [`SPLIT_AT`] for [`SPLIT`], the node leading the consumer's data cut off from
/// the two others — a symmetric minority/majority split — while the consumer still
/// reaches every node: on the minority side with the old leader, whose writes cannot be
/// replicated, and beside a majority that elects a new one. Namespaces only (on
/// loopback the nodes share one link that no proxy sits in).
async fn split(
    backend: Backend,
    topic: &str,
    links: &Links,
    t0: Instant,
) -> anyhow::Result<String> {
    let Links::Netns { .. } = links else {
        return Ok("split: not injected (needs the clusters in namespaces)".to_owned());
    };
    tokio::time::sleep_until(t0 + SPLIT_AT).await;
    let (broker, what) = led(backend, topic);
    let leader = cluster(&["leader", broker, &what]).await?;
    let others: Vec<&str> = node_names(backend)
        .into_iter()
        .filter(|n| *n != leader)
        .collect();
    let args = |verb| [&["net", verb, leader.as_str()], others.as_slice()].concat();
    cluster(&args("block")).await?;
    let from = t0.elapsed();
    tokio::time::sleep(SPLIT).await;
    cluster(&args("heal")).await?;
    let healed = t0.elapsed();
    let new_leader = cluster(&["leader", broker, &what]).await?;
    Ok(format!(
        "{leader} (leader of {what}) cut off from {} +{:.1} → +{:.1} s; leader now {new_leader}",
        others.join(" and "),
        from.as_secs_f64(),
        healed.as_secs_f64()
    ))
}

/// Take the node that leads the consumer's data out (`scripts/brokers cluster <out>`) for
/// `held`, then bring it back (`<back>`) whatever happens meanwhile: a node left dead or
/// frozen would hang the rest of the run.
async fn leader_out(
    backend: Backend,
    topic: &str,
    t0: Instant,
    held: Duration,
    [out, back]: [&str; 2],
) -> anyhow::Result<String> {
    let (broker, what) = led(backend, topic);
    let leader = cluster(&["leader", broker, &what]).await?;
    cluster(&[out, &leader]).await?;
    let taken = t0.elapsed();
    tokio::time::sleep(held).await;
    cluster(&[back, &leader]).await?;
    let returned = t0.elapsed();
    let new_leader = cluster(&["leader", broker, &what]).await?;
    Ok(format!(
        "{leader} (leader of {what}): {out} at +{:.1} s, {back} at +{:.1} s; leader now {new_leader}",
        taken.as_secs_f64(),
        returned.as_secs_f64()
    ))
}

/// The cluster's nodes, in the order the URLs list them.
fn node_names(backend: Backend) -> [&'static str; 3] {
    match backend {
        Backend::Rabbit => ["rabbit-1", "rabbit-2", "rabbit-3"],
        Backend::Kafka => ["kafka-1", "kafka-2", "kafka-3"],
        Backend::Nats => ["nats-1", "nats-2", "nats-3"],
        other => unreachable!("no cluster for {other:?}"),
    }
}

/// `rabbit-2`, `kafka-3`, `nats-1`: its index in [`node_names`].
fn node_index(node: &str) -> anyhow::Result<usize> {
    node.rsplit_once('-')
        .and_then(|(_, n)| n.parse::<usize>().ok())
        .and_then(|n| n.checked_sub(1))
        .filter(|i| *i < 3)
        .with_context(|| format!("`{node}` is not a cluster node"))
}

/// Restart every node of the cluster in turn, as an upgrade does: each stopped
/// gracefully and started again, the next one only once it has rejoined (`scripts/brokers
/// cluster restart`).
async fn rolling_restart(backend: Backend, t0: Instant) -> anyhow::Result<String> {
    tokio::time::sleep_until(t0 + ROLLING_AT).await;
    let began = t0.elapsed();
    let mut steps = Vec::new();
    for node in node_names(backend) {
        let from = t0.elapsed();
        cluster(&["restart", node]).await?;
        steps.push(format!(
            "{node} +{:.1} → +{:.1} s",
            from.as_secs_f64(),
            t0.elapsed().as_secs_f64()
        ));
    }
    Ok(format!(
        "rolling restart from +{:.1} s: {}",
        began.as_secs_f64(),
        steps.join(", ")
    ))
}

/// Make the consumer's DLQ refuse (or not confirm) dead letters for [`DLQ_OUTAGE`],
/// keeping what it holds: RabbitMQ — the parking stream's writer process suspended (a
/// publish is never confirmed); Kafka — the DLQ topic's `max.message.bytes` set to 1
/// (every record is refused as too large; a `min.insync.replicas` above the replica count
/// would not do: Kafka 4 caps it at the replication factor); NATS — the
/// DLQ stream capped at the messages it holds with `discard: new` (a publish is refused).
async fn dlq_outage(backend: Backend, topic: &str, t0: Instant) -> anyhow::Result<String> {
    tokio::time::sleep_until(t0 + DLQ_OUTAGE_AT).await;
    let sub = reliq_examples::orders::subscription(topic);
    let reader = crash::connect(backend, &reliq_conformance::support::unique("chaos"))
        .await?
        .dead_letters(&sub)
        .await?;
    // A count may hang while the DLQ is unavailable (RabbitMQ asks the stream's
    // suspended writer): `None` then, with the reason logged. On RabbitMQ the DLQ is
    // counted by a complete read (browse, with its fence): `count` reads the stream's
    // member on the connection's node, which after the node loss can be behind its
    // leader, and a short first count reads as growth (110 → 180 in one run).
    let complete_count = async || -> Result<u64, reliq_core::BrokerError> {
        if backend != Backend::Rabbit {
            return Ok(reader.count().await?.count);
        }
        let (mut total, mut cursor) = (0u64, reliq_core::Cursor::start());
        loop {
            let page = reader.browse(&cursor, 5_000).await?;
            total += page.entries.len() as u64;
            if page.at_end {
                return Ok(total);
            }
            cursor = page.next;
        }
    };
    let count = async || match tokio::time::timeout(Duration::from_secs(10), complete_count()).await
    {
        Ok(Ok(c)) => Some(c),
        Ok(Err(e)) => {
            eprintln!("counting the DLQ failed: {e}");
            None
        }
        Err(_) => {
            eprintln!("counting the DLQ timed out (10 s)");
            None
        }
    };
    let (what, how, start, end) = match backend {
        Backend::Rabbit => {
            let parking = reliq_rabbit::Names::of(&sub).parking;
            // Counted before the suspension (a complete read appends a fence, which a
            // suspended writer never confirms); not counted during it: the growth check
            // is Kafka's and NATS's (dead letters parked between this count and the
            // suspension, a second or two of `rabbitmqctl`, would read as growth).
            let start = count().await;
            let node = suspend_rabbit_stream_writer(&parking, DLQ_OUTAGE).await?;
            let blocked = t0.elapsed();
            tokio::time::sleep_until(t0 + blocked + DLQ_OUTAGE).await;
            let end = None;
            (
                format!("stream {parking}"),
                format!(
                    "writer on {node} suspended at +{:.1} s",
                    blocked.as_secs_f64()
                ),
                start,
                end,
            )
        }
        Backend::Kafka => {
            let name = sub.dead_letter_name();
            let bootstrap = settings::authority(&settings::get("RELIQ_KAFKA_URL")).to_owned();
            let configs = |change: &'static [&'static str]| {
                let (bootstrap, name) = (bootstrap.clone(), name.clone());
                async move {
                    let mut args = vec![
                        "kafka",
                        "configs",
                        "--bootstrap-server",
                        &bootstrap,
                        "--alter",
                        "--entity-type",
                        "topics",
                        "--entity-name",
                        &name,
                    ];
                    args.extend_from_slice(change);
                    script(&args).await
                }
            };
            configs(&["--add-config", "max.message.bytes=1"]).await?;
            let blocked = t0.elapsed();
            // The change reaches every broker through the metadata log, and a produce
            // sent before it may still be appended: counted once it is in force — and
            // once two counts 1 s apart agree. A count reads each partition's high
            // watermark, which a partition's new leader reports behind its log until its
            // followers fetch again: a round whose node loss came just before read 17 at
            // the start and 18 at the end, with nothing to append it (suspected; the
            // grown entry was not kept).
            tokio::time::sleep(Duration::from_secs(3)).await;
            let mut start = count().await;
            for _ in 0..5 {
                tokio::time::sleep(Duration::from_secs(1)).await;
                let again = count().await;
                if again == start {
                    break;
                }
                eprintln!("the DLQ's count moved from {start:?} to {again:?} as the outage began");
                start = again;
            }
            tokio::time::sleep_until(t0 + blocked + DLQ_OUTAGE).await;
            let end = count().await;
            configs(&["--delete-config", "max.message.bytes"]).await?;
            (
                format!("topic {name}"),
                format!(
                    "max.message.bytes 1 (every record refused as too large) at +{:.1} s",
                    blocked.as_secs_f64()
                ),
                start,
                end,
            )
        }
        Backend::Nats => {
            let name = reliq_nats::dead_letter_stream(&sub);
            let servers: Vec<async_nats::ServerAddr> =
                settings::authority(&settings::get("RELIQ_NATS_URL"))
                    .split(',')
                    .map(|h| format!("nats://{h}").parse())
                    .collect::<Result<_, _>>()?;
            let js = async_nats::jetstream::new(async_nats::connect(servers).await?);
            // A cap of 0 means no cap: wait until something is parked.
            let (held, open) = loop {
                // Getting a stream reads its info (`STREAM.INFO`).
                let info = through_election("DLQ stream info", || async {
                    let stream = js.get_stream(&name).await?;
                    anyhow::Ok(stream.cached_info().clone())
                })
                .await?;
                if info.state.messages > 0 {
                    break (info.state.messages, info.config);
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            };
            let capped = async_nats::jetstream::stream::Config {
                max_messages: i64::try_from(held)?,
                discard: async_nats::jetstream::stream::DiscardPolicy::New,
                ..open.clone()
            };
            through_election("capping the DLQ stream", || js.update_stream(&capped)).await?;
            let blocked = t0.elapsed();
            let start = count().await;
            tokio::time::sleep(DLQ_OUTAGE).await;
            let end = count().await;
            through_election("uncapping the DLQ stream", || js.update_stream(&open)).await?;
            (
                format!("stream {name}"),
                format!(
                    "capped at its {held} messages, discard new, at +{:.1} s",
                    blocked.as_secs_f64()
                ),
                start,
                end,
            )
        }
        other => unreachable!("no cluster for {other:?}"),
    };
    let back = t0.elapsed();
    // Nothing was parked while the route was down (where the DLQ could be counted then);
    // what was held back lands once it is up again.
    if let (Some(start), Some(end)) = (start, end)
        && start != end
    {
        // Which entries: the latest by their dead-letter time (the consumer's clock, off
        // by the round's skew), to tell a late count from a real append.
        let mut entries = Vec::new();
        let mut cursor = reliq_core::Cursor::start();
        loop {
            let page = reader.browse(&cursor, 5_000).await?;
            entries.extend(page.entries.iter().map(|e| {
                let at = e.record().map(|r| r.dead_lettered_at).ok();
                (at, format!("{} at {}", e.id(), e.position))
            }));
            if page.at_end {
                break;
            }
            cursor = page.next;
        }
        entries.sort();
        let latest: Vec<_> = entries.iter().rev().take(3).collect();
        bail!(
            "the DLQ grew from {start} to {end} entries while unavailable (until +{:.1} s); \
             the latest entries by dead-letter time: {latest:?}",
            back.as_secs_f64()
        );
    }
    // How soon the held-back dead letters land (the checker then requires every one of
    // them): reported, not required within a bound — on Kafka a rebalance after the
    // stall may re-read far back before the consumer reaches them again.
    let held_at = end.or(start);
    let mut landed = None;
    while let Some(held_at) = held_at
        && t0.elapsed() < back + Duration::from_secs(60)
    {
        if let Some(now) = count().await
            && now > held_at
        {
            landed = Some((now, t0.elapsed() - back));
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let after = landed.map_or("none within 60 s".to_owned(), |(now, after)| {
        format!("{now} {:.1} s after", after.as_secs_f64())
    });
    let held = |c: Option<u64>| c.map_or("?".to_owned(), |c| c.to_string());
    Ok(format!(
        "DLQ {what} unavailable: {how}, available again at +{:.1} s; entries {} at the start, {} at the end, {after}",
        back.as_secs_f64(),
        held(start),
        held(end),
    ))
}

/// Suspend the writer (leader) process of RabbitMQ stream `stream` for `outage`, on its
/// node, through the first node that answers; that node's name. The suspension is held
/// by a process spawned there (a suspension ends with the process that made it), which
/// resumes the writer when the time is up, whatever happens to this test.
/// A JetStream API call, tried again while it fails for up to 30 s: the injector runs
/// beside the node loss, and until a new meta leader is elected JetStream API requests
/// time out. (The calls here are idempotent: setting a stream's config twice is once.)
async fn through_election<T, E, F, Fut>(what: &str, mut call: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, E>>,
    E: Into<anyhow::Error>,
{
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match call().await {
            Ok(v) => return Ok(v),
            Err(e) if Instant::now() < deadline => {
                eprintln!("{what}: {}; trying again", e.into());
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => return Err(e.into().context(format!("{what} (tried for 30 s)"))),
        }
    }
}

async fn suspend_rabbit_stream_writer(stream: &str, outage: Duration) -> anyhow::Result<String> {
    // The writer the queue record names may be on a node just killed (its leader
    // moving): refused at once (`not_running`), and asked again until a live one is
    // named.
    let expr = format!(
        "{{ok, Q}} = rabbit_amqqueue:lookup(rabbit_misc:r(<<\"/\">>, queue, <<\"{stream}\">>)), \
         Pid = amqqueue:get_pid(Q), \
         true = is_pid(Pid) andalso rpc:call(node(Pid), erlang, is_process_alive, [Pid], 2000) =:= true \
             orelse error(not_running), \
         Self = self(), \
         spawn(node(Pid), fun() -> true = erlang:suspend_process(Pid), Self ! suspended, \
                                   timer:sleep({}), erlang:resume_process(Pid) end), \
         receive suspended -> node(Pid) after 5000 -> error(not_suspended) end.",
        outage.as_millis()
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut last = None;
    while Instant::now() < deadline {
        for node in ["rabbit-1", "rabbit-2", "rabbit-3"] {
            match cluster(&["rabbitmqctl", node, "eval", &expr]).await {
                Ok(out) => return Ok(out),
                Err(e) => last = Some(e),
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    Err(last.unwrap_or_else(|| anyhow::anyhow!("no RabbitMQ node")))
        .with_context(|| format!("suspending the writer of stream {stream}"))
}

/// Cut the consumer off from its inbox database for [`DB_CUT`] (its proxy holds every
/// byte both ways, on open and new connections), the brokers still reachable. Every
/// claim fails or hangs until the pool's timeout; the orders consumer's circuit breaker
/// (`reliq_examples::orders::breaker`) opens and the consumer stops taking deliveries
/// until a probe gets through — a dependency outage must not spend the messages'
/// attempts and park healthy orders as `exhausted` (the checker fails on any such entry).
async fn database_partition(database: &FaultProxy, t0: Instant) -> anyhow::Result<String> {
    held_both_ways("to its database", &[database], t0, DB_CUT_AT, DB_CUT).await
}

/// Cut every link of the consumer to the brokers both ways for [`STALL`] (through the
/// proxies: every byte held; in namespaces: every packet dropped).
async fn stall(links: &Links, t0: Instant) -> anyhow::Result<String> {
    tokio::time::sleep_until(t0 + STALL_AT).await;
    // As a partition does: a consumer between connections gets a moment to hold one.
    let connected_by = Instant::now() + CONNECTED_WAIT;
    while links.busiest().await.is_none() && Instant::now() < connected_by {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let open: usize = links.connections().await.iter().sum();
    ensure!(
        open > 0,
        "no consumer connection to the brokers at +{} s{}",
        STALL_AT.as_secs(),
        links.via()
    );
    links.all_links(true).await?;
    let from = t0.elapsed();
    tokio::time::sleep(STALL).await;
    links.all_links(false).await?;
    Ok(format!(
        "the consumer's {open} connection(s) to the brokers cut both ways at +{:.1} s, healed at +{:.1} s{}",
        from.as_secs_f64(),
        t0.elapsed().as_secs_f64(),
        links.via()
    ))
}

/// From `at`, hold every byte through `proxies` both ways for `held`, then let them move.
async fn held_both_ways(
    what: &str,
    proxies: &[&FaultProxy],
    t0: Instant,
    at: Duration,
    held: Duration,
) -> anyhow::Result<String> {
    tokio::time::sleep_until(t0 + at).await;
    // As a partition does: a consumer between connections gets a moment to hold one.
    let open = || proxies.iter().map(|p| p.connections()).sum::<usize>();
    let connected_by = Instant::now() + CONNECTED_WAIT;
    while open() == 0 && Instant::now() < connected_by {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let open = open();
    ensure!(
        open > 0,
        "no consumer connection {what} goes through its fault proxy at +{} s",
        at.as_secs()
    );
    proxies.iter().for_each(|p| p.stall());
    let from = t0.elapsed();
    tokio::time::sleep(held).await;
    proxies.iter().for_each(|p| p.resume());
    Ok(format!(
        "the consumer's {open} connection(s) {what} held both ways at +{:.1} s, moving again at +{:.1} s",
        from.as_secs_f64(),
        t0.elapsed().as_secs_f64()
    ))
}

/// From [`LOSS_AT`] for [`LOSS`], the kernel drops [`LOSS_PERCENT`] % of the packets
/// between the consumer and every node (the nodes' own links and the database's are
/// whole): TCP retransmits, so requests and answers come late, some after the clients
/// gave up on them. Through the proxies: an nftables table on their ports; in
/// namespaces: on the bridge, every packet to or from the consumer's address.
async fn lossy_links(links: &Links, t0: Instant) -> anyhow::Result<String> {
    tokio::time::sleep_until(t0 + LOSS_AT).await;
    match links {
        Links::Proxies(proxies) => {
            let ports: Vec<u16> = proxies.0.iter().map(|p| p.addr().port()).collect();
            let moved = || proxies.0.iter().map(FaultProxy::bytes_moved).sum::<u64>();
            let before = moved();
            let loss = PacketLoss::start(&ports, LOSS_PERCENT)?;
            let from = t0.elapsed();
            tokio::time::sleep(LOSS).await;
            let counts = loss.stop()?;
            Ok(format!(
                "{LOSS_PERCENT} % of the packets to and from the brokers dropped +{:.1} → +{:.1} s: {} of {}, {:.1} MB moved meanwhile",
                from.as_secs_f64(),
                t0.elapsed().as_secs_f64(),
                counts.dropped,
                counts.seen,
                (moved() - before) as f64 / 1e6
            ))
        }
        Links::Netns { .. } => {
            let percent = LOSS_PERCENT.to_string();
            cluster(&["net", "loss", CONSUMER_HOST, &percent]).await?;
            let from = t0.elapsed();
            tokio::time::sleep(LOSS).await;
            let dropped = lossy_drops().await;
            cluster(&["net", "clear", CONSUMER_HOST]).await?;
            Ok(format!(
                "{LOSS_PERCENT} % of the consumer's packets dropped on the bridge +{:.1} → +{:.1} s: {dropped} dropped",
                from.as_secs_f64(),
                t0.elapsed().as_secs_f64(),
            ))
        }
    }
}

/// Packets the bridge's loss chain dropped so far (`?` when `nft` did not say).
async fn lossy_drops() -> String {
    let listed = Command::new("nft")
        .args(["list", "chain", "bridge", "reliq_net", "lossy"])
        .output()
        .await;
    listed
        .ok()
        .and_then(|out| {
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            let after = text.split("counter packets ").nth(1)?;
            after.split_whitespace().next().map(str::to_owned)
        })
        .unwrap_or_else(|| "?".to_owned())
}

/// The consumer's host in `scripts/brokers cluster net` terms, and its namespace.
const CONSUMER_HOST: &str = "consumer";
const CONSUMER_NETNS: &str = "reliq-consumer";

/// Whether the clusters run in network namespaces (`BROKERS_CLUSTER_NETNS=1`, which
/// `just chaos-netns` sets for the script and this binary alike).
fn in_namespaces() -> bool {
    std::env::var("BROKERS_CLUSTER_NETNS").is_ok_and(|v| v == "1")
}

/// A cut of the consumer's link to one node.
#[derive(Clone, Copy, Debug)]
enum Cut {
    /// Nothing passes either way.
    BothWays,
    /// The node gets what the consumer sends; its answers are lost (held, through a
    /// proxy).
    Answers,
}

impl Cut {
    fn how(self) -> &'static str {
        match self {
            Self::BothWays => "cut both ways",
            Self::Answers => "answers lost",
        }
    }
}

/// Where the faults act on the consumer's links to the cluster's nodes.
enum Links {
    /// Loopback clusters: the consumer connects through a fault proxy per node.
    Proxies(Proxies),
    /// Clusters in network namespaces: the consumer is a host of its own
    /// ([`CONSUMER_NETNS`]) and a fault drops its packets on the bridge (`scripts/brokers
    /// cluster net`), as a broken network does: silently, with TCP retransmitting.
    Netns {
        /// The nodes' addresses, in [`node_names`] order.
        nodes: Vec<std::net::IpAddr>,
        names: [&'static str; 3],
    },
}

impl Links {
    /// Open connections of the consumer to each node (index `i`: node `i + 1`).
    async fn connections(&self) -> Vec<usize> {
        match self {
            Self::Proxies(proxies) => proxies.0.iter().map(FaultProxy::connections).collect(),
            Self::Netns { nodes, .. } => {
                // `ss` in the consumer's namespace: the established TCP connections'
                // peers (the consumer's children are the only processes there).
                let listed = Command::new("ip")
                    .args([
                        "netns",
                        "exec",
                        CONSUMER_NETNS,
                        "ss",
                        "-Htn",
                        "state",
                        "established",
                    ])
                    .output()
                    .await;
                let text = listed
                    .map(|out| String::from_utf8_lossy(&out.stdout).into_owned())
                    .unwrap_or_default();
                let peers: Vec<std::net::IpAddr> = text
                    .lines()
                    .filter_map(|line| line.split_whitespace().last())
                    .filter_map(|peer| peer.parse::<SocketAddr>().ok())
                    .map(|peer| peer.ip())
                    .collect();
                nodes
                    .iter()
                    .map(|node| peers.iter().filter(|p| *p == node).count())
                    .collect()
            }
        }
    }

    /// The node the consumer holds the most connections to, if any.
    async fn busiest(&self) -> Option<(usize, usize)> {
        self.connections()
            .await
            .into_iter()
            .enumerate()
            .filter(|(_, open)| *open > 0)
            .max_by_key(|(_, open)| *open)
    }

    async fn cut(&self, node: usize, cut: Cut) -> anyhow::Result<()> {
        match self {
            Self::Proxies(proxies) => {
                let proxy = proxies.0.get(node).context("no such node")?;
                match cut {
                    Cut::BothWays => proxy.stall(),
                    Cut::Answers => proxy.stall_answers(),
                }
            }
            Self::Netns { names, .. } => {
                net(&["block", CONSUMER_HOST, names[node]], cut).await?;
            }
        }
        Ok(())
    }

    async fn heal(&self, node: usize, cut: Cut) -> anyhow::Result<()> {
        match self {
            Self::Proxies(proxies) => proxies.0.get(node).context("no such node")?.resume(),
            Self::Netns { names, .. } => {
                net(&["heal", CONSUMER_HOST, names[node]], cut).await?;
            }
        }
        Ok(())
    }

    /// Cut every link of the consumer both ways (`cut`), or heal them all.
    async fn all_links(&self, cut: bool) -> anyhow::Result<()> {
        match self {
            Self::Proxies(proxies) if cut => proxies.stall(),
            Self::Proxies(proxies) => proxies.resume(),
            Self::Netns { names, .. } => {
                let verb = if cut { "block" } else { "heal" };
                let args = [&[verb, CONSUMER_HOST], names.as_slice()].concat();
                net(&args, Cut::BothWays).await?;
            }
        }
        Ok(())
    }

    /// How the faults reach the links, for the reports.
    fn via(&self) -> &'static str {
        match self {
            Self::Proxies(_) => " (fault proxies)",
            Self::Netns { .. } => " (on the bridge)",
        }
    }
}

/// `scripts/brokers cluster net ARGS… [--answers]`.
async fn net(args: &[&str], cut: Cut) -> anyhow::Result<String> {
    let mut all = vec!["net"];
    all.extend_from_slice(args);
    if let Cut::Answers = cut {
        all.push("--answers");
    }
    cluster(&all).await
}

/// One fault proxy per cluster node, between the consumer (the harness's child) and
/// that node.
struct Proxies(Vec<FaultProxy>);

/// The nodes a cluster URL names (its password kept out of an error).
fn node_addrs(url: &str) -> anyhow::Result<Vec<SocketAddr>> {
    settings::authority(url)
        .split(',')
        .map(|h| {
            h.trim()
                .parse()
                .with_context(|| format!("node `{h}` of {}", redact_url(url)))
        })
        .collect()
}

impl Proxies {
    /// Proxies for the nodes of `url`, and the URL the consumer connects with instead.
    async fn start(backend: Backend, url: &str) -> anyhow::Result<(Self, String)> {
        let nodes = node_addrs(url)?;
        let mut proxies = Vec::new();
        if backend == Backend::Kafka {
            // A Kafka client reaches the brokers the metadata names: the cluster's
            // PROXIED listeners advertise these ports (scripts/brokers).
            let ports = |key: &str| -> anyhow::Result<Vec<u16>> {
                settings::get(key)
                    .split(',')
                    .map(|p| p.trim().parse().with_context(|| format!("{key}: `{p}`")))
                    .collect()
            };
            let listeners = ports("KAFKA_CLUSTER_PROXIED_PORTS")?;
            let at = ports("KAFKA_CLUSTER_PROXY_PORTS")?;
            for (listen, upstream) in at.into_iter().zip(listeners) {
                let local = |port| SocketAddr::from(([127, 0, 0, 1], port));
                proxies.push(FaultProxy::start_on(local(listen), local(upstream)).await?);
            }
        } else {
            for node in nodes {
                proxies.push(FaultProxy::start(node).await?);
            }
        }
        let hosts: Vec<String> = proxies.iter().map(|p| p.addr().to_string()).collect();
        let mut via = settings::with_hosts(url, &hosts.join(","));
        if backend == Backend::Nats {
            // Stay behind the proxies after a reconnect (the cluster advertises its
            // servers' own addresses).
            via.push_str(if via.contains('?') { "&" } else { "?" });
            via.push_str("reliq.ignore_discovered_servers=true");
        }
        Ok((Self(proxies), via))
    }

    fn stall(&self) {
        self.0.iter().for_each(FaultProxy::stall);
    }

    fn resume(&self) {
        self.0.iter().for_each(FaultProxy::resume);
    }
}

async fn chaos(backend: Backend, url_key: &str) -> anyhow::Result<()> {
    let url = settings::get(url_key);
    let hosts = url
        .split_once("://")
        .map(|(_, rest)| rest.split(['/', '?']).next().unwrap_or(""))
        .map(|authority| {
            authority
                .rsplit('@')
                .next()
                .unwrap_or("")
                .split(',')
                .count()
        })
        .unwrap_or(0);
    if hosts < 3 {
        bail!(
            "{url_key}={url} names {hosts} node(s): run this through `just chaos` (a three-node cluster)"
        );
    }
    let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let orders = env("RELIQ_CHAOS_ORDERS").map_or(Ok(10_000), |v| v.parse())?;
    let seed = env("RELIQ_CRASH_SEED").map_or_else(|| Ok(fastrand::u64(..)), |v| v.parse())?;
    println!("seed {seed} ({backend:?} cluster, {orders} orders)");
    let netns = in_namespaces();
    let (links, via) = if netns {
        let nodes = node_addrs(&url)?.iter().map(SocketAddr::ip).collect();
        println!(
            "consumer in the network namespace {CONSUMER_NETNS}, straight to the nodes: {}",
            redact_url(&url)
        );
        let names = node_names(backend);
        (Links::Netns { nodes, names }, url.clone())
    } else {
        let (proxies, via) = Proxies::start(backend, &url).await?;
        println!("consumer through the fault proxies: {}", redact_url(&via));
        (Links::Proxies(proxies), via)
    };
    let links = Arc::new(links);
    // The consumer's own way to its database, through a proxy the faults can cut (in
    // namespaces it listens on the host's address on the bridge).
    let db_url = settings::get("RELIQ_POSTGRES_URL");
    let db_node: SocketAddr = settings::authority(&db_url)
        .parse()
        .with_context(|| format!("the host of RELIQ_POSTGRES_URL={db_url}"))?;
    let database = Arc::new(if netns {
        let host: std::net::IpAddr = format!("{}.1", settings::get("BROKERS_NETNS_NET"))
            .parse()
            .context("BROKERS_NETNS_NET (brokers.env): the bridge's network, e.g. 10.77.0")?;
        FaultProxy::start_on(SocketAddr::new(host, 0), db_node).await?
    } else {
        FaultProxy::start(db_node).await?
    });
    let skew_ms: i64 = match env("RELIQ_CHAOS_SKEW_MS") {
        Some(ms) => ms
            .parse()
            .context("RELIQ_CHAOS_SKEW_MS takes milliseconds")?,
        None if seed % 2 == 0 => 300_000,
        None => -300_000,
    };
    println!("the consumers' clocks skewed by {:+} s", skew_ms / 1000);
    let pause = fault_on(CONSUMER_PAUSE).then(|| silence_limit(backend) * 2);
    if let Some(pause) = pause {
        println!("the last consumer run frozen for {pause:?}, a standby joining after the kills");
    }
    let via = match backend {
        Backend::Rabbit => {
            let sep = if via.contains('?') { '&' } else { '?' };
            format!("{via}{sep}heartbeat={}", RABBIT_HEARTBEAT.as_secs())
        }
        _ => via,
    };
    let mut child_env = vec![(url_key.to_owned(), via)];
    if skew_ms != 0 {
        child_env.extend(reliq_integration::skew::child_env(
            Path::new(env!("CARGO_TARGET_TMPDIR")),
            skew_ms,
        )?);
    }
    let scenario = Scenario {
        backend,
        store: Store::Postgres,
        orders,
        kills: 5,
        seed,
        child: env!("CARGO_BIN_EXE_crash-consumer").into(),
        timeout: Duration::from_secs(300 + u64::from(orders) / 10) + pause.unwrap_or_default(),
        child_env,
        pause,
        child_db_host: Some(database.addr().to_string()),
        child_netns: netns.then(|| CONSUMER_NETNS.to_owned()),
    };
    // The proxies live until the run is over, whatever becomes of the fault task.
    let report =
        crash::run_with_faults(scenario, faults(backend, links.clone(), database.clone())).await?;
    drop((links, database));
    println!("{report}");
    ensure!(
        report.faults.len() == FAULTS.len(),
        "faults: {:?}",
        report.faults
    );
    ensure!(
        report.pause.is_some() == pause.is_some(),
        "consumer pause asked: {pause:?}, done: {:?}",
        report.pause
    );
    // A consumer frozen while holding nothing is no zombie: that pause tested nothing.
    ensure!(
        pause.is_none() || report.held_when_frozen > 0,
        "the frozen consumer held no deliveries: {:?}",
        report.pause
    );
    let offsets = &report.clock_offsets_ms;
    ensure!(
        offsets.len() == report.runs && offsets.iter().all(|ms| (ms - skew_ms).abs() < 20_000),
        "the consumers' clocks were off by {offsets:?} ms, not {skew_ms}: the skew did not take"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbit_cluster() -> anyhow::Result<()> {
    chaos(Backend::Rabbit, "RELIQ_RABBIT_URL").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_cluster() -> anyhow::Result<()> {
    chaos(Backend::Kafka, "RELIQ_KAFKA_URL").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_cluster() -> anyhow::Result<()> {
    chaos(Backend::Nats, "RELIQ_NATS_URL").await
}

/// The cluster URL `url_key` names, split: everything before the hosts (scheme and
/// credentials), the hosts, and everything after them (path and query).
fn url_hosts(url_key: &str) -> anyhow::Result<(String, Vec<String>, String)> {
    let url = settings::get(url_key);
    let (scheme, rest) = url.split_once("://").context("no scheme in the URL")?;
    let split = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(split);
    let (user, hosts) = match authority.rsplit_once('@') {
        Some((user, hosts)) => (format!("{user}@"), hosts),
        None => (String::new(), authority),
    };
    let hosts: Vec<String> = hosts.split(',').map(str::to_owned).collect();
    ensure!(
        hosts.len() >= 3,
        "{url_key}={url} names {} node(s): run this through `just chaos`",
        hosts.len()
    );
    Ok((format!("{scheme}://{user}"), hosts, tail.to_owned()))
}

/// The cluster URL `url_key` names, one single-node URL per host (credentials, path and
/// query kept): to reach one node on purpose.
fn node_urls(url_key: &str) -> anyhow::Result<Vec<String>> {
    let (prefix, hosts, tail) = url_hosts(url_key)?;
    Ok(hosts
        .iter()
        .map(|host| format!("{prefix}{host}{tail}"))
        .collect())
}

/// The cluster URL `url_key` names with its host `first` (0-based) moved to the front:
/// a client of it connects there first.
fn cluster_url_from(url_key: &str, first: usize) -> anyhow::Result<String> {
    let (prefix, mut hosts, tail) = url_hosts(url_key)?;
    ensure!(first < hosts.len(), "{url_key} has no host {first}");
    let host = hosts.remove(first);
    hosts.insert(0, host);
    Ok(format!("{prefix}{}{tail}", hosts.join(",")))
}

/// Publish `ids` to RabbitMQ queue `queue` through the default exchange with confirms,
/// through the node at `url` (a raw client: the dead-letter reader reads any entry).
async fn publish_raw(url: &str, queue: &str, ids: &[String]) -> anyhow::Result<()> {
    use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
    let conn = lapin::Connection::connect(url, lapin::ConnectionProperties::default()).await?;
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    let mut pending = Vec::with_capacity(ids.len());
    for id in ids {
        let props = lapin::BasicProperties::default()
            .with_message_id(id.as_str().into())
            .with_delivery_mode(2);
        pending.push(
            ch.basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions::default(),
                id.as_bytes(),
                props,
            )
            .await?,
        );
    }
    for p in pending {
        ensure!(p.await?.is_ack(), "a publish to {queue} was not confirmed");
    }
    let _ = conn.close(200, "done".into()).await;
    Ok(())
}

/// Suspend, on `node`, the process that replicates RabbitMQ stream `stream` from its
/// leader to its member on `replica` (osiris's replica reader), for `outage`: the member
/// stays up and answers, but receives nothing (no entry, no committed offset) meanwhile.
async fn suspend_rabbit_stream_replication(
    node: &str,
    stream: &str,
    replica: &str,
    outage: Duration,
) -> anyhow::Result<String> {
    let expr = format!(
        "{{ok, Q}} = rabbit_amqqueue:lookup(rabbit_misc:r(<<\"/\">>, queue, <<\"{stream}\">>)), \
         #{{name := StreamId}} = amqqueue:get_type_state(Q), \
         Feeds = fun(P) -> case proc_lib:initial_call(P) of \
             {{osiris_replica_reader, init, _}} -> \
                 L = tuple_to_list(sys:get_state(P)), \
                 lists:member(StreamId, L) andalso \
                 lists:any(fun(E) -> is_pid(E) andalso node(E) =:= '{replica}@localhost' end, L); \
             _ -> false end end, \
         [Pid] = [P || P <- erlang:processes(), Feeds(P)], Self = self(), \
         spawn(fun() -> true = erlang:suspend_process(Pid), Self ! suspended, \
                        timer:sleep({}), erlang:resume_process(Pid) end), \
         receive suspended -> Pid after 5000 -> error(not_suspended) end.",
        outage.as_millis()
    );
    cluster(&["rabbitmqctl", node, "eval", &expr])
        .await
        .with_context(|| format!("suspending the replication of {stream} to {replica}"))
}

/// A dead-letter read served by a member of the stream that is behind its leader returns
/// every entry, each once. RabbitMQ serves a stream consumer from the stream's member on
/// the connection's node, and a member holds (and delivers) only what its leader last
/// told it was committed — a message the leader sends without waiting, dropped when the
/// nodes' link is down: after a node loss a member can stay behind until the stream is
/// written again (chaos round 1 of 2026-12-02 missed 9 poison orders so). Here the
/// leader's replication to rabbit-2 is suspended for 6 s while dead letters are parked,
/// and the reader reads through rabbit-2 meanwhile: without the reader's fence it
/// answered with the first 100 entries only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbit_dead_letters_read_on_a_lagging_replica() -> anyhow::Result<()> {
    use reliq_core::Broker;
    let nodes = node_urls("RELIQ_RABBIT_URL")?;
    let sub = reliq_examples::orders::subscription(&reliq_conformance::support::unique("fence"));
    // Declared through rabbit-1: the stream's leader is there, rabbit-2 and rabbit-3
    // hold replicas.
    let parking = dlq_stream_led_by_rabbit_1(&nodes, &sub).await?;
    let ids: Vec<String> = (0..600).map(|i| format!("fence-{i}")).collect();
    publish_raw(&nodes[0], &parking, &ids[..100]).await?;
    let reader = reliq_rabbit::RabbitBroker::connect(&nodes[1])
        .await?
        .dead_letters(&sub)
        .await?;
    suspend_rabbit_stream_replication("rabbit-1", &parking, "rabbit-2", Duration::from_secs(6))
        .await?;
    // Confirmed by rabbit-1 and rabbit-3: a quorum without rabbit-2.
    publish_raw(&nodes[0], &parking, &ids[100..]).await?;
    let started = Instant::now();
    let seen = browse_ids(reader.as_ref(), 250).await?;
    println!(
        "read {} entries through rabbit-2 in {:.1} s",
        seen.len(),
        started.elapsed().as_secs_f64()
    );
    let mut sorted = seen.clone();
    sorted.sort();
    sorted.dedup();
    ensure!(
        sorted.len() == seen.len(),
        "{} entries read twice",
        seen.len() - sorted.len()
    );
    let missing: Vec<&String> = ids
        .iter()
        .filter(|id| sorted.binary_search(id).is_err())
        .collect();
    ensure!(
        missing.is_empty() && seen.len() == ids.len(),
        "read {} of {} entries through the lagging replica; missing {:?}…",
        seen.len(),
        ids.len(),
        &missing[..missing.len().min(5)]
    );
    Ok(())
}

/// A dead-letter read whose connection is on a node without a member of the stream
/// reads through another node of the URL. RabbitMQ serves a stream consumer only from a
/// member on the connection's node and otherwise refuses it with `PRECONDITION_FAILED`
/// ("does not have a replica on the local node"); chaos round P (seed
/// 5211333207330061400) got that refusal from a node 10 s after a rolling restart, and
/// the checker's DLQ read failed. Here rabbit-2's member of the stream is removed
/// (`rabbit_stream_queue:delete_replica`) and the reader's URL lists rabbit-2 first: a
/// raw consumer on rabbit-2 is refused (the case holds), and browse, get and count
/// still answer every entry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbit_dead_letters_read_through_another_node_when_the_first_holds_no_member()
-> anyhow::Result<()> {
    use lapin::options::BasicConsumeOptions;
    use lapin::types::{AMQPValue, FieldTable};
    use reliq_core::{Broker, MessageId};
    let nodes = node_urls("RELIQ_RABBIT_URL")?;
    let sub = reliq_examples::orders::subscription(&reliq_conformance::support::unique("nomember"));
    let parking = dlq_stream_led_by_rabbit_1(&nodes, &sub).await?;
    let ids: Vec<String> = (0..300).map(|i| format!("nomember-{i}")).collect();
    publish_raw(&nodes[0], &parking, &ids).await?;
    let removed = cluster(&[
        "rabbitmqctl",
        "rabbit-1",
        "eval",
        &format!(
            "rabbit_stream_queue:delete_replica(<<\"/\">>, <<\"{parking}\">>, 'rabbit-2@localhost')."
        ),
    ])
    .await?;
    ensure!(removed == "ok", "delete_replica answered {removed}");

    // The case holds: rabbit-2 refuses a stream consumer (the coordinator removes the
    // member asynchronously: wait for it).
    let raw = lapin::Connection::connect(&nodes[1], lapin::ConnectionProperties::default()).await?;
    let deadline = Instant::now() + Duration::from_secs(15);
    let refusal = loop {
        let ch = raw.create_channel().await?;
        ch.basic_qos(10, Default::default()).await?;
        let mut args = FieldTable::default();
        args.insert("x-stream-offset".into(), AMQPValue::LongLongInt(0));
        match ch
            .basic_consume(
                parking.as_str().into(),
                "".into(),
                BasicConsumeOptions::default(),
                args,
            )
            .await
        {
            Err(e) => break e.to_string(),
            Ok(_) if Instant::now() < deadline => {
                let _ = ch.close(200, "again".into()).await;
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
            Ok(_) => bail!("rabbit-2 still serves {parking} 15 s after its member was removed"),
        }
    };
    let _ = raw.close(200, "done".into()).await;
    ensure!(
        refusal.contains("does not have a replica on the local node"),
        "rabbit-2 refused the stream consumer otherwise: {refusal}"
    );

    let reader = reliq_rabbit::RabbitBroker::connect(&cluster_url_from("RELIQ_RABBIT_URL", 1)?)
        .await?
        .dead_letters(&sub)
        .await?;
    let seen = browse_ids(reader.as_ref(), 128).await?;
    ensure!(
        seen == ids,
        "browsed {} entries through the URL that starts at rabbit-2, expected {} in order",
        seen.len(),
        ids.len()
    );
    let last = MessageId::from(ids[ids.len() - 1].as_str());
    ensure!(
        reader.get(&last).await?.is_some_and(|e| e.id() == &last),
        "get {last} through the URL that starts at rabbit-2 found nothing"
    );
    let count = reader.count().await?;
    ensure!(
        count.count == ids.len() as u64,
        "count through the URL that starts at rabbit-2: {} of {}",
        count.count,
        ids.len()
    );
    Ok(())
}

/// Declare `sub`'s dead-letter objects through rabbit-1 (`nodes[0]`), which then leads
/// the dead-letter stream (a stream's leader is the declaring client's node), checked;
/// the stream's name.
async fn dlq_stream_led_by_rabbit_1(
    nodes: &[String],
    sub: &reliq_core::Subscription,
) -> anyhow::Result<String> {
    reliq_rabbit::RabbitBroker::connect(&nodes[0])
        .await?
        .declare_dead_letter_queue(sub)
        .await?;
    let parking = reliq_rabbit::Names::of(sub).parking;
    let leader = cluster(&["leader", "rabbitmq", &parking]).await?;
    ensure!(
        leader == "rabbit-1",
        "the dead-letter stream's leader is {leader}, not rabbit-1"
    );
    Ok(parking)
}

/// The ids of every entry of a DLQ, in order, browsed `page` at a time.
async fn browse_ids(
    reader: &dyn reliq_core::DeadLetters,
    page: usize,
) -> anyhow::Result<Vec<String>> {
    let mut ids = Vec::new();
    let mut cursor = reliq_core::Cursor::start();
    loop {
        let read = reader.browse(&cursor, page).await?;
        ids.extend(read.entries.iter().map(|e| e.id().as_str().to_owned()));
        if read.at_end {
            return Ok(ids);
        }
        cursor = read.next;
    }
}

/// How the raw publisher of the stream-leader tests uses its one channel.
#[derive(Clone, Copy, Debug, PartialEq)]
enum StreamChannel {
    /// Every publish on the channel is an append to the stream (as reliq's stream
    /// appends go out since round S).
    StreamOnly,
    /// The channel also publishes to a quorum queue before each append (as reliq's
    /// shared publisher did with retry copies and dead letters until round S), so its
    /// publish sequence runs ahead of its stream writer's sequence.
    SharedWithQuorumQueue,
}

/// What [`publish_across_stream_leader_restart`] saw.
struct StreamLeaderRun {
    stream: String,
    /// Stream appends published, and those confirmed with a plain ack.
    published: u64,
    confirmed: std::collections::BTreeSet<u64>,
    /// Read back from the stream.
    stored: std::collections::BTreeSet<u64>,
}

impl StreamLeaderRun {
    /// Confirmed appends that are not in the stream.
    fn lost(&self) -> Vec<u64> {
        self.confirmed.difference(&self.stored).copied().collect()
    }

    fn report(&self, channel: StreamChannel) {
        let lost = self.lost();
        println!(
            "{channel:?}: published {}, confirmed {}, stored {}, confirmed and not stored {} \
             (first {:?}, last {:?})",
            self.published,
            self.confirmed.len(),
            self.stored.len(),
            lost.len(),
            lost.first(),
            lost.last()
        );
    }
}

/// Raw AMQP, no reliq code: publish numbered appends with confirms (32 in flight) to a
/// new stream on one long-lived channel through a node that does not lead it, restart
/// the stream's leader (a graceful stop and start, as in a rolling restart), keep
/// publishing for a while, then read the stream whole.
async fn publish_across_stream_leader_restart(
    channel: StreamChannel,
) -> anyhow::Result<StreamLeaderRun> {
    use futures::StreamExt;
    use lapin::options::{
        BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions,
    };
    use lapin::types::{AMQPValue, FieldTable};
    use std::collections::BTreeSet;
    use std::sync::atomic::{AtomicBool, Ordering};
    let nodes = node_urls("RELIQ_RABBIT_URL")?;
    let stream = reliq_conformance::support::unique("leaderstop");
    let side = format!("{stream}.side");
    // A stream's leader is the declaring client's node: rabbit-1. Published through
    // rabbit-2, read through rabbit-3.
    let declare =
        lapin::Connection::connect(&nodes[0], lapin::ConnectionProperties::default()).await?;
    let ch = declare.create_channel().await?;
    for (name, kind) in [(&stream, "stream"), (&side, "quorum")] {
        let mut args = FieldTable::default();
        args.insert("x-queue-type".into(), AMQPValue::LongString(kind.into()));
        ch.queue_declare(
            name.as_str().into(),
            QueueDeclareOptions {
                durable: true,
                ..QueueDeclareOptions::default()
            },
            args,
        )
        .await?;
    }
    let _ = declare.close(200, "declared".into()).await;
    let leader = cluster(&["leader", "rabbitmq", &stream]).await?;
    ensure!(
        leader == "rabbit-1",
        "the stream's leader is {leader}, not rabbit-1"
    );

    let stop = Arc::new(AtomicBool::new(false));
    let publisher = {
        let url = nodes[1].clone();
        let (stream, side, stop) = (stream.clone(), side.clone(), stop.clone());
        tokio::spawn(async move {
            let mut confirmed = BTreeSet::new();
            let mut n = 0u64;
            let publish = |ch: &lapin::Channel, queue: &str, id: u64| {
                let props = lapin::BasicProperties::default()
                    .with_message_id(id.to_string().into())
                    .with_delivery_mode(2);
                let (ch, queue) = (ch.clone(), queue.to_owned());
                async move {
                    ch.basic_publish(
                        "".into(),
                        queue.as_str().into(),
                        BasicPublishOptions {
                            mandatory: true,
                            ..BasicPublishOptions::default()
                        },
                        &id.to_be_bytes(),
                        props,
                    )
                    .await
                }
            };
            'connect: while !stop.load(Ordering::SeqCst) {
                let Ok(conn) =
                    lapin::Connection::connect(&url, lapin::ConnectionProperties::default()).await
                else {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue;
                };
                // One channel for as long as it lives: the stream client it holds sees
                // the leader change.
                let Ok(ch) = conn.create_channel().await else {
                    continue 'connect;
                };
                if ch
                    .confirm_select(ConfirmSelectOptions::default())
                    .await
                    .is_err()
                {
                    continue 'connect;
                }
                while !stop.load(Ordering::SeqCst) {
                    let mut pending = Vec::new();
                    for _ in 0..32 {
                        n += 1;
                        if channel == StreamChannel::SharedWithQuorumQueue
                            && publish(&ch, &side, n).await.is_err()
                        {
                            continue 'connect;
                        }
                        match publish(&ch, &stream, n).await {
                            Ok(p) => pending.push((n, p)),
                            Err(_) => continue 'connect,
                        }
                    }
                    // One deadline for the batch: appends the broker never confirms
                    // must not hold the run for 10 s each.
                    let deadline = Instant::now() + Duration::from_secs(10);
                    for (id, p) in pending {
                        if let Ok(Ok(lapin::Confirmation::Ack(None))) =
                            tokio::time::timeout_at(deadline, p).await
                        {
                            confirmed.insert(id);
                        }
                    }
                }
            }
            (confirmed, n)
        })
    };
    tokio::time::sleep(Duration::from_secs(3)).await;
    let started = Instant::now();
    cluster(&["restart", "rabbit-1"]).await?;
    println!(
        "rabbit-1 restarted in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    tokio::time::sleep(Duration::from_secs(5)).await;
    stop.store(true, Ordering::SeqCst);
    let (confirmed, published) = publisher.await?;
    println!(
        "the stream's leader is now {}",
        cluster(&["leader", "rabbitmq", &stream]).await?
    );

    // Read it whole through rabbit-3: until 3 s pass without a delivery.
    let reader =
        lapin::Connection::connect(&nodes[2], lapin::ConnectionProperties::default()).await?;
    let ch = reader.create_channel().await?;
    ch.basic_qos(1000, Default::default()).await?;
    let mut args = FieldTable::default();
    args.insert(
        "x-stream-offset".into(),
        AMQPValue::LongString("first".into()),
    );
    let mut consumer = ch
        .basic_consume(
            stream.as_str().into(),
            "".into(),
            BasicConsumeOptions::default(),
            args,
        )
        .await?;
    let mut stored = BTreeSet::new();
    while let Ok(Some(d)) = tokio::time::timeout(Duration::from_secs(3), consumer.next()).await {
        let d = d?;
        if let Some(id) = d.properties.message_id().as_ref() {
            stored.insert(id.as_str().parse::<u64>()?);
        }
        d.ack(Default::default()).await?;
    }
    let _ = reader.close(200, "read".into()).await;
    Ok(StreamLeaderRun {
        stream,
        published,
        confirmed,
        stored,
    })
}

/// Every append to a RabbitMQ stream that the broker confirms is in the stream, also
/// when the stream's leader is restarted meanwhile — on a channel that appends to that
/// stream only, as reliq's dead letters, ledger records and read fences go out
/// (`reliq-rabbit`'s `Inner::publish_to`). See the next test for why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbit_stream_keeps_every_publish_confirmed_across_a_leader_restart() -> anyhow::Result<()>
{
    let run = publish_across_stream_leader_restart(StreamChannel::StreamOnly).await?;
    run.report(StreamChannel::StreamOnly);
    let lost = run.lost();
    ensure!(
        lost.is_empty(),
        "{} appends confirmed by RabbitMQ are not in stream {} after its leader's restart \
         (first {:?}, last {:?})",
        lost.len(),
        run.stream,
        lost.first(),
        lost.last()
    );
    ensure!(
        run.stored.len() > 1000,
        "only {} appends stored: the run published too little to mean anything",
        run.stored.len()
    );
    Ok(())
}

/// Why reliq appends to each stream on a channel of the stream's own: on RabbitMQ
/// before 4.0.0 a channel that publishes to a stream *and* elsewhere loses confirmed
/// appends when the stream's leader changes. The channel re-sends its unconfirmed
/// appends to the new leader numbered with its own publish sequence (ahead of its
/// stream writer's sequence, by the publishes that went elsewhere) — osiris then takes
/// every later append of the channel, numbered by the writer, for a duplicate: drops it
/// and confirms it. Fixed in rabbitmq-server 4.0.0 (#12236, `resend_all`). Chaos round S
/// lost 200 confirmed dead letters so (reliq's one publishing channel also carried the
/// retry copies). Here the same channel publishes to a quorum queue before each append:
/// before 4.0 confirmed appends must be missing (else this test no longer shows why the
/// channels are apart), from 4.0 none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbit_stream_on_a_channel_shared_with_a_quorum_queue_loses_confirmed_appends_before_4_0()
-> anyhow::Result<()> {
    let version = cluster(&["rabbitmqctl", "rabbit-2", "version"]).await?;
    let major: u32 = version
        .trim()
        .split('.')
        .next()
        .and_then(|m| m.parse().ok())
        .with_context(|| format!("RabbitMQ's version: {version:?}"))?;
    let run = publish_across_stream_leader_restart(StreamChannel::SharedWithQuorumQueue).await?;
    run.report(StreamChannel::SharedWithQuorumQueue);
    let lost = run.lost().len();
    if major < 4 {
        ensure!(
            lost > 0,
            "RabbitMQ {} kept every confirmed append of a channel shared with a quorum queue \
             across the stream's leader change: the resend bug did not show",
            version.trim()
        );
    } else {
        ensure!(
            lost == 0,
            "RabbitMQ {} lost {lost} confirmed appends of a channel shared with a quorum queue",
            version.trim()
        );
    }
    Ok(())
}

/// reliq's dead letters are all in the dead-letter stream after the stream's leader
/// restarts mid-run, with retry copies (to quorum queues) published between them — the
/// mix that lost round S's dead letters on one shared channel (see the test above). The
/// stream is declared on rabbit-1 (its leader); the consumer connects through rabbit-2,
/// so its connection survives rabbit-1's restart and its channels see the leader
/// change. Even messages fail permanently (dead-lettered), odd ones transiently once
/// (retried after 200 ms). Fails with a shared publishing channel: dead letters acked
/// at the source and missing from the stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbit_dead_letters_are_all_in_the_stream_after_its_leader_restarts() -> anyhow::Result<()>
{
    use reliq_core::{
        BoxError, Broker, Consumer, Delivery, Destination, Message, Permanent, RetryPolicy,
        Transient,
    };
    use std::collections::BTreeSet;
    const TOTAL: u64 = 8_000;
    let nodes = node_urls("RELIQ_RABBIT_URL")?;
    let topic = reliq_conformance::support::unique("dlqleader");
    let sub = reliq_examples::orders::subscription(&topic);
    let parking = dlq_stream_led_by_rabbit_1(&nodes, &sub).await?;

    let broker: Arc<dyn Broker> = Arc::new(
        reliq_rabbit::RabbitBroker::connect(&cluster_url_from("RELIQ_RABBIT_URL", 1)?).await?,
    );
    let handle = Consumer::builder(broker.clone(), &sub.consumer)
        .subscribe(topic.clone())
        .retry(RetryPolicy::tiers([Duration::from_millis(200)]))
        .max_in_flight(64)
        .start(move |delivery: Delivery| async move {
            let n: u64 = std::str::from_utf8(delivery.payload())?.parse()?;
            if n.is_multiple_of(2) {
                Err::<(), BoxError>(Permanent::msg(format!("{n} is even")).into())
            } else if delivery.attempt() <= 1 {
                Err(Transient::msg(format!("{n}: not yet")).into())
            } else {
                Ok(())
            }
        })
        .await?;
    let publisher = {
        let (broker, dest) = (broker.clone(), Destination::new(topic.clone()));
        tokio::spawn(async move {
            for n in 0..TOTAL {
                // Paced, so the run spans the restart: ~16 s in all.
                if n.is_multiple_of(100) {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                let message = Message::new(n.to_string()).with_id(format!("dlqleader-{n}"));
                while let Err(e) = broker.publish(&dest, message.clone()).await {
                    tracing::warn!(error = %e, "publishing again");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        })
    };
    tokio::time::sleep(Duration::from_secs(4)).await;
    let started = Instant::now();
    cluster(&["restart", "rabbit-1"]).await?;
    println!(
        "rabbit-1 restarted in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    publisher.await?;
    let deadline = Instant::now() + Duration::from_secs(90);
    while handle.stats().dead_lettered < TOTAL / 2 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let stats = handle.stats();
    handle.shutdown().await;
    println!(
        "the DLQ stream's leader is now {}; {stats:?}",
        cluster(&["leader", "rabbitmq", &parking]).await?
    );
    ensure!(
        stats.dead_lettered >= TOTAL / 2,
        "{} of {} dead letters confirmed within 90 s",
        stats.dead_lettered,
        TOTAL / 2
    );

    let reader = broker.dead_letters(&sub).await?;
    let stored: BTreeSet<String> = browse_ids(reader.as_ref(), 512)
        .await?
        .into_iter()
        .collect();
    let missing: Vec<String> = (0..TOTAL)
        .step_by(2)
        .map(|n| format!("dlqleader-{n}"))
        .filter(|id| !stored.contains(id))
        .collect();
    ensure!(
        missing.is_empty(),
        "{} dead letters confirmed to reliq (their sources acked) are not in {parking}: {:?}…",
        missing.len(),
        &missing[..missing.len().min(5)]
    );
    Ok(())
}

/// A Kafka member whose partitions flow control paused, and whose assignment is then
/// lost (its connections stalled past the session timeout) and given back, consumes
/// those partitions again. librdkafka keeps a partition's pause across a rebalance; the
/// receiver's new partition state said "not paused", so nothing resumed them and the
/// member fetched nothing for good (chaos seed 16328554269714791920 stalled so after the
/// stall). Here: every handler waits at a gate, so the buffer fills and the partitions
/// are paused; the proxies stall the member's connections for 9 s (session timeout 6 s:
/// the assignment is lost); the gate opens during the stall, so the buffer drains
/// before the partitions come back; then every record must be processed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_paused_partitions_are_consumed_after_a_lost_assignment() -> anyhow::Result<()> {
    use reliq_core::{BoxError, Broker, Consumer, Delivery, Destination, Message, RetryPolicy};
    use std::collections::HashSet;
    const TOTAL: usize = 600;
    let url = settings::get("RELIQ_KAFKA_URL");
    node_urls("RELIQ_KAFKA_URL")?;
    let (proxies, via) = Proxies::start(Backend::Kafka, &url).await?;
    let topic = reliq_conformance::support::unique("paused-lost");
    let publisher = reliq_kafka::KafkaBroker::connect(&url)?;
    publisher
        .ensure_topics(std::slice::from_ref(&topic))
        .await?;
    let dest = Destination::new(topic.clone());
    let mut ids = HashSet::new();
    for i in 0..TOTAL {
        let m = Message::new(format!("{i}")).with_key(format!("k{i}"));
        ids.insert(m.id().as_str().to_owned());
        publisher.publish(&dest, m).await?;
    }
    let member = reliq_kafka::KafkaBroker::connect(&format!(
        "{via}&reliq.group.prefix={}.",
        reliq_conformance::support::unique("paused")
    ))?;
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let done = Arc::new(std::sync::Mutex::new(HashSet::new()));
    let (g, d) = (gate.clone(), done.clone());
    let handle = Consumer::builder(Arc::new(member) as Arc<dyn Broker>, "c")
        .subscribe(topic.clone())
        .retry(RetryPolicy::tiers([Duration::from_secs(1)]))
        .max_in_flight(4)
        .start(move |delivery: Delivery| {
            let (g, d) = (g.clone(), d.clone());
            async move {
                drop(g.acquire().await?);
                lock(&d).insert(delivery.id().as_str().to_owned());
                Ok::<(), BoxError>(())
            }
        })
        .await?;
    // The buffer fills within the first second; a second more and the partitions pause.
    tokio::time::sleep(Duration::from_secs(4)).await;
    proxies.stall();
    tokio::time::sleep(Duration::from_secs(7)).await;
    // The assignment is lost by now: the buffer drains (its records dropped as revoked).
    gate.add_permits(tokio::sync::Semaphore::MAX_PERMITS / 2);
    tokio::time::sleep(Duration::from_secs(2)).await;
    proxies.resume();
    let count = || lock(&done).len();
    let deadline = Instant::now() + Duration::from_secs(60);
    while count() < TOTAL && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let stats = handle.stats();
    handle.shutdown().await;
    drop(proxies);
    let processed = lock(&done).clone();
    ensure!(
        processed == ids,
        "{} of {TOTAL} records processed within 60 s of the stall's end ({stats:?})",
        processed.len()
    );
    Ok(())
}

/// A RabbitMQ node's disk full: its disk alarm blocks every publisher of the cluster, so
/// the consumer's dead-letter copies are neither confirmed nor refused. They must be held
/// — not acknowledged, not released into a redelivery loop — and land once the alarm
/// clears: 200 poison messages are refused by the handler while rabbit-2's disk is full,
/// and after it is freed every one of them is in the DLQ, once. A consumer that settled
/// its source on an unconfirmed copy would lose what the blocked connection dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbit_dead_letters_held_through_a_disk_alarm() -> anyhow::Result<()> {
    use reliq_core::{BoxError, Broker, Consumer, Delivery, Destination, Message, Permanent};
    use std::collections::HashSet;
    const TOTAL: usize = 200;
    let url = settings::get("RELIQ_RABBIT_URL");
    node_urls("RELIQ_RABBIT_URL")?;
    let broker: Arc<dyn Broker> = Arc::new(reliq_rabbit::RabbitBroker::connect(&url).await?);
    let source = reliq_conformance::support::unique("disk-alarm");
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let g = gate.clone();
    let handle = Consumer::builder(broker.clone(), "c")
        .subscribe(source.clone())
        .start(move |_d: Delivery| {
            let g = g.clone();
            async move {
                drop(g.acquire().await?);
                Err::<(), BoxError>(Permanent::msg("order refers to a missing sku").into())
            }
        })
        .await?;
    let dest = Destination::new(source.clone());
    let mut ids = HashSet::new();
    for i in 0..TOTAL {
        let m = Message::new(format!("{i}"));
        ids.insert(m.id().clone());
        broker.publish(&dest, m).await?;
    }
    cluster(&["fill", "rabbit-2"]).await?;
    let filled = Instant::now();
    let outcome = async {
        // RabbitMQ looks at its free space every few seconds (up to 10 s apart when there
        // was plenty): the handler refuses everything once the alarm is up.
        let alarms = || {
            cluster(&[
                "rabbitmqctl",
                "rabbit-2",
                "eval",
                "rabbit_alarm:get_alarms().",
            ])
        };
        while !alarms().await?.contains("disk") {
            ensure!(
                filled.elapsed() < Duration::from_secs(30),
                "no disk alarm 30 s after rabbit-2's disk was filled"
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        println!(
            "disk alarm up {:.1} s after the fill",
            filled.elapsed().as_secs_f64()
        );
        gate.add_permits(tokio::sync::Semaphore::MAX_PERMITS / 2);
        tokio::time::sleep(Duration::from_secs(15)).await;
        Ok::<_, anyhow::Error>(handle.stats())
    }
    .await;
    // `running`, or `restarted` when its Raft log crashed on the full disk.
    let freed = cluster(&["free", "rabbit-2"]).await;
    let during = outcome?;
    println!(
        "rabbit-2's disk full for {:.1} s, then {}; meanwhile {during:?}",
        filled.elapsed().as_secs_f64(),
        freed?
    );
    ensure!(
        during.settle_failures > 0 && during.dead_lettered < TOTAL as u64,
        "the disk alarm blocked no dead-letter copy: {during:?}"
    );
    let deadline = Instant::now() + Duration::from_secs(90);
    while handle.stats().dead_lettered < TOTAL as u64 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let after = handle.shutdown().await.stats;
    let dlq = broker
        .dead_letters(&reliq_core::Subscription::new("c", source.as_str()))
        .await?;
    let parked = reliq_conformance::support::browse_all(dlq.as_ref()).await?;
    let parked_ids: HashSet<_> = parked.iter().map(|e| e.id().clone()).collect();
    let count = dlq.count().await?.count;
    ensure!(
        parked_ids == ids && parked.len() == TOTAL && count == TOTAL as u64,
        "after the alarm: {} entries ({} distinct, {} of the {TOTAL} published), count {count}; {after:?}",
        parked.len(),
        parked_ids.len(),
        parked_ids.intersection(&ids).count()
    );
    Ok(())
}
