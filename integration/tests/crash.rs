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
//! `RELIQ_CRASH_ORDERS` (default 400) sets the order count, `RELIQ_CRASH_DB`
//! (`sqlite | postgres`) overrides each test's store, `RELIQ_CRASH_SEED` the kill moments;
//! `just crash-harness <backend> [orders]` runs one of them big.

use std::time::Duration;

use reliq_integration::crash::{self, Backend, Scenario, Store};

async fn scenario(backend: Backend, store: Store) -> anyhow::Result<()> {
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
        timeout: Duration::from_secs(120 + u64::from(orders) / 10),
        child_env: Vec::new(),
    })
    .await?;
    println!("{report}");
    Ok(())
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
