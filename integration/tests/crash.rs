//! The crash harness (`reliq_integration::crash`) on every landed backend: orders with
//! injected poison, unknown SKUs, transient failures and duplicate copies; the consumer
//! killed 5 times (every second kill between COMMIT and ack) and restarted; afterwards
//! every valid order is reserved exactly once, the inbox holds each id once, the DLQ
//! holds exactly the injected poison, nothing is lost.
//!
//! Real brokers: the consumer is a child process (`crash-consumer`) killed with SIGKILL.
//! Memory: the broker cannot outlive its process, so the consumer runs in-process and is
//! stopped with `ConsumerHandle::crash()` instead.
//!
//! The faulty-link runs (`*_through_a_lossy_link`, `*_through_a_flapping_link`,
//! `*_with_its_answers_held_now_and_then`) put the consumer behind a fault proxy that
//! degrades its link for the whole run (RabbitMQ and NATS; a single Kafka node advertises
//! its own address, so its clients would bypass the proxy — the chaos rounds cover Kafka).
//!
//! `RELIQ_CRASH_ORDERS` (default 400) sets the order count, `RELIQ_CRASH_DB`
//! (`sqlite | postgres`) overrides each test's store, `RELIQ_CRASH_SEED` the kill moments;
//! `just crash-harness <backend> [orders]` runs one of them big.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use reliq_integration::crash::{self, Backend, Scenario, Store};
use reliq_integration::packet_loss::PacketLoss;
use reliq_integration::proxy::FaultProxy;

async fn scenario(backend: Backend, store: Store) -> anyhow::Result<()> {
    scenario_with(backend, store, Vec::new(), Duration::ZERO).await
}

/// [`scenario`] with `child_env` for the consumer child (its broker URL through a proxy).
async fn scenario_with(
    backend: Backend,
    store: Store,
    child_env: Vec<(String, String)>,
    slack: Duration,
) -> anyhow::Result<()> {
    let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let orders = env("RELIQ_CRASH_ORDERS").map_or(Ok(400), |v| v.parse())?;
    let store = env("RELIQ_CRASH_DB").map_or(Ok(store), |v| Store::parse(&v))?;
    let seed = env("RELIQ_CRASH_SEED").map_or_else(|| Ok(fastrand::u64(..)), |v| v.parse())?;
    println!("seed {seed} ({backend:?}, {store:?}, {orders} orders)");
    let report = crash::run(Scenario {
        backend,
        store,
        orders,
        kills: 5,
        seed,
        child: env!("CARGO_BIN_EXE_crash-consumer").into(),
        timeout: Duration::from_secs(120 + u64::from(orders) / 10) + slack,
        child_env,
        pause: None,
        child_db_host: None,
        child_netns: None,
    })
    .await?;
    println!("{report}");
    Ok(())
}

/// What [`through_a_faulty_link`] does to the consumer's link for the whole run.
#[derive(Clone, Copy, Debug)]
enum LinkFault {
    /// The kernel drops this share (%) of the packets to and from the proxy's port
    /// (nftables, [`PacketLoss`]): TCP retransmits, so everything comes late.
    Loss(u8),
    /// Every byte held both ways for `held`, every `every` (a flapping partition: the
    /// peers see silence, no error).
    Flapping { held: Duration, every: Duration },
    /// Only the broker's answers held for `held`, every `every` (an asymmetric partition:
    /// the broker acts on acks and publishes the consumer hears nothing of).
    AnswersHeld { held: Duration, every: Duration },
}

/// The whole run, kills included, with the consumer's link to the broker faulty: it
/// reaches the broker through a [`FaultProxy`] whose link `fault` degrades — the
/// driver's own connections and the other tests' are whole. Every check of the harness
/// still holds: nothing lost, nothing done twice, every poison parked. `url_key`'s URL is
/// pointed at the proxy, with `params` added.
async fn through_a_faulty_link(
    backend: Backend,
    url_key: &str,
    params: &str,
    fault: LinkFault,
) -> anyhow::Result<()> {
    let url = reliq_integration::settings::get(url_key);
    let node = reliq_integration::settings::authority(&url).parse()?;
    let proxy = Arc::new(FaultProxy::start(node).await?);
    let mut via = reliq_integration::settings::with_hosts(&url, &proxy.addr().to_string());
    if !params.is_empty() {
        via.push(if via.contains('?') { '&' } else { '?' });
        via.push_str(params);
    }
    let child_env = vec![(url_key.to_owned(), via)];
    // NATS on PostgreSQL, as its plain run: every delivery counts as an attempt there, and
    // with SQLite in a loaded `just test` (a fresh-clone run, 2026-12-07) all three NATS
    // runs timed out short of every valid order, deliveries parked at their 4th attempt
    // (passing alone in 10-35 s).
    let store = match backend {
        Backend::Nats => Store::Postgres,
        _ => Store::Sqlite,
    };
    let (run, injected) = match fault {
        LinkFault::Loss(percent) => {
            let loss = PacketLoss::start(&[proxy.addr().port()], percent)?;
            let run = scenario_with(backend, store, child_env, FAULTY_LINK_SLACK).await;
            let counts = loss.stop()?;
            let injected = (counts.dropped > 0)
                .then(|| format!("{} of {} packets dropped", counts.dropped, counts.seen));
            (run, injected)
        }
        LinkFault::Flapping { held, every } | LinkFault::AnswersHeld { held, every } => {
            let answers_only = matches!(fault, LinkFault::AnswersHeld { .. });
            let flaps = Arc::new(AtomicU64::new(0));
            let flapping = tokio::spawn({
                let (proxy, flaps) = (proxy.clone(), flaps.clone());
                async move {
                    loop {
                        tokio::time::sleep(every - held).await;
                        if answers_only {
                            proxy.stall_answers();
                        } else {
                            proxy.stall();
                        }
                        tokio::time::sleep(held).await;
                        proxy.resume();
                        flaps.fetch_add(1, Ordering::SeqCst);
                    }
                }
            });
            let run = scenario_with(backend, store, child_env, FAULTY_LINK_SLACK).await;
            flapping.abort();
            proxy.resume();
            let flaps = flaps.load(Ordering::SeqCst);
            // Several holds, or the run hardly went through the fault.
            (run, (flaps >= 2).then(|| format!("held {flaps} times")))
        }
    };
    println!(
        "{fault:?}: {}, {} bytes through the proxy",
        injected.as_deref().unwrap_or("never injected"),
        proxy.bytes_moved()
    );
    run?;
    anyhow::ensure!(
        injected.is_some(),
        "{fault:?} was not injected (enough): the run did not go through a faulty link"
    );
    Ok(())
}

/// More time for a run through a faulty link: each dropped packet costs a retransmission
/// timeout, each hold its length (a loaded fresh-clone run took 144 s of the usual 160).
const FAULTY_LINK_SLACK: Duration = Duration::from_secs(120);

/// Stay behind the proxy after a reconnect (the NATS server advertises its own address).
const NATS_BEHIND_PROXY: &str = "reliq.ignore_discovered_servers=true";

// Dense enough that a 400-order run (10-20 s) goes through several: each hold is
// longer than a confirm takes, shorter than the clients' timeouts.
const FLAPPING: LinkFault = LinkFault::Flapping {
    held: Duration::from_millis(1_500),
    every: Duration::from_millis(3_000),
};

const ANSWERS_HELD: LinkFault = LinkFault::AnswersHeld {
    held: Duration::from_secs(2),
    every: Duration::from_secs(4),
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbit_through_a_lossy_link() -> anyhow::Result<()> {
    through_a_faulty_link(Backend::Rabbit, "RELIQ_RABBIT_URL", "", LinkFault::Loss(20)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_through_a_lossy_link() -> anyhow::Result<()> {
    through_a_faulty_link(
        Backend::Nats,
        "RELIQ_NATS_URL",
        NATS_BEHIND_PROXY,
        LinkFault::Loss(20),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbit_through_a_flapping_link() -> anyhow::Result<()> {
    through_a_faulty_link(Backend::Rabbit, "RELIQ_RABBIT_URL", "", FLAPPING).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_through_a_flapping_link() -> anyhow::Result<()> {
    through_a_faulty_link(Backend::Nats, "RELIQ_NATS_URL", NATS_BEHIND_PROXY, FLAPPING).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbit_with_its_answers_held_now_and_then() -> anyhow::Result<()> {
    through_a_faulty_link(Backend::Rabbit, "RELIQ_RABBIT_URL", "", ANSWERS_HELD).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_with_its_answers_held_now_and_then() -> anyhow::Result<()> {
    through_a_faulty_link(
        Backend::Nats,
        "RELIQ_NATS_URL",
        NATS_BEHIND_PROXY,
        ANSWERS_HELD,
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory() -> anyhow::Result<()> {
    scenario(Backend::Memory, Store::Sqlite).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbit() -> anyhow::Result<()> {
    scenario(Backend::Rabbit, Store::Sqlite).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka() -> anyhow::Result<()> {
    scenario(Backend::Kafka, Store::Sqlite).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats() -> anyhow::Result<()> {
    scenario(Backend::Nats, Store::Postgres).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqs() -> anyhow::Result<()> {
    scenario(Backend::Sqs, Store::Sqlite).await
}

/// A consumer frozen (SIGSTOP) for longer than its lease, session or heartbeat timeout
/// while a standby of its group runs, then thawed (SIGCONT): a zombie, which still holds
/// deliveries the standby was given meanwhile. No kills. Afterwards, as in every run:
/// every valid order reserved exactly once (the inbox absorbs the zombie's second
/// handling), the DLQ shows each injected order once and counts one dead letter per
/// order, nothing lost. A zombie can still *write* a second copy of a dead letter: NATS
/// drops it (the DLQ's `Nats-Msg-Id` window); on Kafka a record the zombie parked before
/// its source was committed is parked again by the standby; a RabbitMQ zombie publishes
/// its copies on a new connection after its deliveries were requeued; an SQS copy checked
/// before the freeze and sent after it lands (seed 9744058140251759339). Those copies
/// are of one dead letter (same id, replay count and payload): the DLQ readers fold them
/// into one entry, count it once and remove every copy with it.
///
/// The store is PostgreSQL, the database a group of consumer processes shares: a process
/// frozen inside a transaction holds only that transaction's rows. On one SQLite file
/// shared by two processes (not a deployment: SQLite is one process's embedded store) it
/// holds the file's single write lock, every claim of the standby fails `busy` for the
/// whole freeze, and healthy orders spent their attempts and were parked `exhausted`
/// (Kafka, seed 13595521845437706686).
async fn frozen(
    backend: Backend,
    pause: Duration,
    child_env: Vec<(String, String)>,
) -> anyhow::Result<()> {
    let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let orders = env("RELIQ_CRASH_ORDERS").map_or(Ok(400), |v| v.parse())?;
    let seed = env("RELIQ_CRASH_SEED").map_or_else(|| Ok(fastrand::u64(..)), |v| v.parse())?;
    println!("seed {seed} ({backend:?} frozen for {pause:?}, {orders} orders)");
    let report = crash::run(Scenario {
        backend,
        store: Store::Postgres,
        orders,
        kills: 0,
        seed,
        child: env!("CARGO_BIN_EXE_crash-consumer").into(),
        timeout: Duration::from_secs(120 + u64::from(orders) / 10) + pause,
        child_env,
        pause: Some(pause),
        child_db_host: None,
        child_netns: None,
    })
    .await?;
    println!("{report}");
    anyhow::ensure!(report.pause.is_some(), "no pause was done");
    println!(
        "{} deliveries held when frozen; one DLQ entry per parked order",
        report.held_when_frozen
    );
    Ok(())
}

/// `var`'s URL (the environment, else `brokers.env`) with `params` added to its query.
fn url_with(var: &str, params: &str) -> Vec<(String, String)> {
    let url = reliq_integration::settings::get(var);
    let sep = if url.contains('?') { '&' } else { '?' };
    vec![(var.to_owned(), format!("{url}{sep}{params}"))]
}

/// Session 6 s (the broker's minimum): frozen 15 s, the member is evicted and the standby
/// gets its partitions; thawed, it settles what it held before it learns so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_consumer_frozen_past_its_session() -> anyhow::Result<()> {
    let env = url_with(
        "RELIQ_KAFKA_URL",
        "session.timeout.ms=6000&heartbeat.interval.ms=1000",
    );
    frozen(Backend::Kafka, Duration::from_secs(15), env).await
}

/// Heartbeats every 2 s: frozen 10 s, RabbitMQ closes the connection and requeues its
/// unacked deliveries to the standby.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbit_consumer_frozen_past_its_heartbeat_timeout() -> anyhow::Result<()> {
    frozen(
        Backend::Rabbit,
        Duration::from_secs(10),
        url_with("RELIQ_RABBIT_URL", "heartbeat=2"),
    )
    .await
}

/// `ack_wait` 3 s: frozen 8 s, the server redelivers what it held to the standby.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_consumer_frozen_past_its_ack_wait() -> anyhow::Result<()> {
    frozen(Backend::Nats, Duration::from_secs(8), Vec::new()).await
}

/// Visibility 3 s: frozen 8 s, what it held becomes visible to the standby.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqs_consumer_frozen_past_its_visibility_timeout() -> anyhow::Result<()> {
    frozen(Backend::Sqs, Duration::from_secs(8), Vec::new()).await
}
