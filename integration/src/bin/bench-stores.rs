//! Benchmark of the durable stores: the inbox claim and the outbox relay, on PostgreSQL
//! (started by `scripts/brokers up`, `RELIQ_POSTGRES_URL`) and SQLite (a temporary file),
//! in the same run.
//!
//! ```sh
//! cargo run --release -p reliq-integration --bin bench-stores -- --messages 2000
//! cargo run --release -p reliq-integration --bin bench-stores -- --store sqlite --batch 50
//! ```
//!
//! Measures, per store:
//! - **inbox claim, single**: one transaction per claim (`BEGIN; claim; COMMIT`), so each
//!   claim pays a commit (a WAL flush on both stores);
//! - **inbox claim, batched**: `--batch` claims per transaction (default 100);
//! - **outbox relay**: `--messages` rows enqueued first (not timed), then one relay
//!   publishes them to the memory broker (batch sizes 10 and 100); msg/s from the relay's
//!   start until the last row is confirmed.
//!
//! Each store runs in an isolated schema / file, removed at the end.

use reliq_integration::settings;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure};
use reliq_core::{Broker, Destination, Message, MessageId, Relay, Subscription};
use reliq_integration::stores::{Harness, Lite, Pg, unique};
use reliq_memory::MemoryBroker;

fn ids(n: usize) -> Vec<MessageId> {
    let run = unique("bench");
    (0..n)
        .map(|i| MessageId::from(format!("{run}-{i}")))
        .collect()
}

/// Microseconds per claim, one transaction per `per_tx` claims.
async fn claims<H: Harness>(h: &H, n: usize, per_tx: usize) -> anyhow::Result<f64> {
    let consumer = unique("bench");
    let ids = ids(n);
    let started = Instant::now();
    for chunk in ids.chunks(per_tx) {
        let mut tx = h.begin().await?;
        for id in chunk {
            ensure!(h.claim(&mut tx, &consumer, id).await? == reliq_core::Claim::First);
        }
        h.commit(tx).await?;
    }
    Ok(started.elapsed().as_secs_f64() * 1e6 / n as f64)
}

/// Relay throughput in msg/s, `n` rows, `batch` rows per claim.
async fn relay<H: Harness>(h: &H, n: usize, batch: usize) -> anyhow::Result<f64> {
    let broker = Arc::new(MemoryBroker::new());
    let topic = unique("bench");
    let rx = broker.subscribe(&Subscription::new("sink", &topic)).await?;
    let destination = Destination::new(topic.as_str());
    let payload = format!("{{\"order\":42,\"pad\":\"{}\"}}", "x".repeat(100));
    for chunk in ids(n).chunks(500) {
        let mut tx = h.begin().await?;
        for id in chunk {
            let m = Message::with_id_and_payload(id.clone(), payload.clone());
            ensure!(h.enqueue(&mut tx, &destination, &m).await?);
        }
        h.commit(tx).await?;
    }
    let started = Instant::now();
    let handle = Relay::builder(h.outbox(), broker.clone() as Arc<dyn Broker>)
        .batch_size(batch)
        .poll_interval(Duration::from_millis(5))
        .build()?
        .start();
    let deadline = started + Duration::from_secs(600);
    while handle.stats().published < n as u64 {
        ensure!(Instant::now() < deadline, "relay did not finish in 600 s");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let elapsed = started.elapsed();
    let stats = handle.shutdown().await;
    ensure!(
        stats.published == n as u64 && stats.publish_failures == 0,
        "{stats:?}"
    );
    ensure!(h.unsent().await? == 0);
    drop(rx);
    Ok(n as f64 / elapsed.as_secs_f64())
}

async fn bench<H: Harness>(name: &str, n: usize, per_tx: usize) -> anyhow::Result<()> {
    let h = H::new().await?;
    // Warm the pool and the tables.
    claims(&h, 50, 10).await?;
    let single = claims(&h, n, 1).await?;
    let batched = claims(&h, n, per_tx).await?;
    let relay_10 = relay(&h, n, 10).await?;
    let relay_100 = relay(&h, n, 100).await?;
    h.cleanup().await?;
    println!(
        "| {name} | {single:.0} µs | {batched:.1} µs | {:.1}x | {relay_10:.0} msg/s | {relay_100:.0} msg/s |",
        single / batched
    );
    Ok(())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let n: usize = settings::arg("--messages").map_or(Ok(2000), |s| s.parse())?;
    let per_tx: usize = settings::arg("--batch").map_or(Ok(100), |s| s.parse())?;
    let store = settings::arg("--store").unwrap_or_else(|| "all".into());
    ensure!(
        n > 0 && per_tx > 0,
        "--messages and --batch must be positive"
    );
    println!(
        "{n} claims / rows per measure; batched = {per_tx} claims per transaction; relay to the memory broker"
    );
    println!(
        "| store | claim, 1 per tx | claim, {per_tx} per tx | ratio | relay, batch 10 | relay, batch 100 |"
    );
    println!("|---|---|---|---|---|---|");
    match store.as_str() {
        "postgres" => bench::<Pg>("PostgreSQL", n, per_tx).await,
        "sqlite" => bench::<Lite>("SQLite", n, per_tx).await,
        "all" => {
            bench::<Pg>("PostgreSQL", n, per_tx).await?;
            bench::<Lite>("SQLite", n, per_tx).await
        }
        other => bail!("--store postgres|sqlite|all, not {other}"),
    }
}
