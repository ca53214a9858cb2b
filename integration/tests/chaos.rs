//! Chaos on three-node clusters (`scripts/brokers cluster up`): the crash harness
//! (`reliq_integration::crash::run_with_faults`: orders through the outbox, the inventory consumer with its
//! durable inbox SIGKILLed 5 times, two of them between COMMIT and ack) with the leader of
//! the consumer's queue / partition / stream SIGKILLed mid-run and restarted 15 s later.
//! The harness's checker fails on any lost order, any double reservation, and any DLQ
//! entry other than the injected poison.
//!
//! Not in `just test` (a cluster costs ~50 s to start and nine processes): `just chaos`
//! starts the clusters, points the tests' URLs at them and runs this binary alone
//! (nextest profile `chaos`). A test here fails, rather than passing on a single node,
//! when its URL does not name three nodes.
//!
//! `RELIQ_CHAOS_ORDERS` (default 2,000), `RELIQ_CRASH_SEED` as in the crash harness.

use std::time::Duration;

use anyhow::{Context, bail, ensure};
use futures::FutureExt;
use reliq_integration::crash::{self, Backend, Scenario, Store};
use reliq_integration::settings;
use tokio::process::Command;
use tokio::time::Instant;

/// `scripts/brokers cluster ARGS…`, its stdout.
async fn cluster(args: &[&str]) -> anyhow::Result<String> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/brokers");
    let out = Command::new(script)
        .arg("cluster")
        .args(args)
        .output()
        .await
        .with_context(|| format!("running scripts/brokers cluster {args:?}"))?;
    ensure!(
        out.status.success(),
        "scripts/brokers cluster {args:?}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
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

/// Kill the leader once the run is under way, start it again 15 s later.
fn node_loss(backend: Backend) -> crash::Faults {
    Box::new(move |topic: String| {
        async move {
            let t0 = Instant::now();
            // The consumers are running and the relay is publishing: mid-run.
            tokio::time::sleep(Duration::from_secs(3)).await;
            let (broker, what) = led(backend, &topic);
            let leader = cluster(&["leader", broker, &what]).await?;
            cluster(&["kill", &leader]).await?;
            let killed = t0.elapsed();
            tokio::time::sleep(Duration::from_secs(15)).await;
            cluster(&["start", &leader]).await?;
            let back = t0.elapsed();
            let new_leader = cluster(&["leader", broker, &what]).await?;
            Ok(vec![format!(
                "{leader} (leader of {what}) SIGKILLed at +{:.1} s, started again at +{:.1} s and rejoined; leader now {new_leader}",
                killed.as_secs_f64(),
                back.as_secs_f64()
            )])
        }
        .boxed()
    })
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
    let orders = env("RELIQ_CHAOS_ORDERS").map_or(Ok(2000), |v| v.parse())?;
    let seed = env("RELIQ_CRASH_SEED").map_or_else(|| Ok(fastrand::u64(..)), |v| v.parse())?;
    println!("seed {seed} ({backend:?} cluster, {orders} orders)");
    let scenario = Scenario {
        backend,
        store: Store::Sqlite,
        orders,
        kills: 5,
        seed,
        child: env!("CARGO_BIN_EXE_crash-consumer").into(),
        timeout: Duration::from_secs(300 + u64::from(orders) / 10),
    };
    let report = crash::run_with_faults(scenario, node_loss(backend)).await?;
    println!("{report}");
    ensure!(!report.faults.is_empty(), "no node was killed");
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
