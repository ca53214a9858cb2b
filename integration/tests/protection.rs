//! Downstream protection end to end: the orders example with its inventory database down
//! for the first seconds of the run, on real brokers. The consumer's circuit breaker
//! opens and consumption pauses at the broker, so the outage costs a bounded number of
//! failed calls and dead-letters nothing; every order is reserved once or (the poison
//! and unknown-SKU orders) dead-lettered, and none is lost.

use std::time::Duration;

use anyhow::ensure;
use reliq_examples::orders::{self, Db};

async fn outage(url: &str) -> anyhow::Result<()> {
    let broker = reliq::connect(url).await?;
    let topic = format!("orders-outage-{}", reliq::MessageId::generate());
    let dir = tempfile::tempdir()?;
    let db = Db::open(
        &format!("sqlite://{}", dir.path().join("orders.db").display()),
        None,
    )
    .await?;
    let n = 120;
    let expected_dead = orders::Expected::of(&orders::orders(n)?).dead.len();
    let summary = orders::run_with_outage(
        broker,
        &db,
        &topic,
        n,
        Duration::from_secs(180),
        Duration::from_secs(8),
    )
    .await?;
    db.close().await;
    ensure!(summary.lost == 0, "{summary}");
    ensure!(summary.outage_dead_lettered == 0, "{summary}");
    ensure!(
        summary.dead_lettered == expected_dead,
        "{summary}: {expected_dead} expected dead"
    );
    // Without the breaker every order would fail its four attempts during the outage
    // (the tiers are 0.2 s and 0.5 s): 480 failures and 120 dead letters.
    ensure!(
        summary.outage_failures > 0 && summary.outage_failures < u64::from(n) * 2,
        "{summary}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orders_through_a_database_outage_on_rabbit() -> anyhow::Result<()> {
    outage(&reliq_integration::settings::get("RELIQ_RABBIT_URL")).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orders_through_a_database_outage_on_kafka() -> anyhow::Result<()> {
    // Kafka's group ids are cluster-wide and the example's consumer is always `inventory`:
    // a prefix of its own keeps this run out of other runs' groups (the observability
    // test runs the example on Kafka too).
    let prefix = reliq_conformance::support::unique("outage");
    outage(&reliq_integration::kafka::url_with_group_prefix(&prefix)).await
}
