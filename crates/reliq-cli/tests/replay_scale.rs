//! Replay at scale with the built `reliq` command, on RabbitMQ and Kafka: a DLQ of
//! `RELIQ_SCALE_N` dead letters replayed with `--rate RELIQ_SCALE_RATE` — 6,000 at
//! 1,000/s in `just test` (a debug build: the command, this consumer and the broker then
//! fill both cores near 2,000/s); `just replay-scale` runs 100,000 at 5,000/s on a
//! release build:
//!
//! - the achieved rate is at least 0.9 × the rate asked for, every id is handled once by
//!   the consumer, and the DLQ is empty after;
//! - the command killed (SIGKILL) midway and started again: every id handled once (the
//!   consumer's inbox takes the copies the killed run sent but had not yet removed), none
//!   left in the DLQ.

mod support;

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, ensure};
use reliq_core::Broker;
use support::{Effects, consumer, dlq, json, park, unique, url, wait_for};

fn scale() -> (usize, u32) {
    let n = std::env::var("RELIQ_SCALE_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(6_000);
    let rate = std::env::var("RELIQ_SCALE_RATE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000);
    (n, rate)
}

/// How long filling the DLQ with `n` may take (through the consumer runtime).
fn fill_time(n: usize) -> Duration {
    Duration::from_secs(60 + n as u64 / 500)
}

/// Every parked id handled exactly once, nothing else, and the DLQ empty.
async fn all_handled_once(
    effects: &Effects,
    ids: &[reliq_core::MessageId],
    url: &str,
    consumer: &str,
    source: &str,
) -> anyhow::Result<()> {
    wait_for(
        "every replayed id handled",
        Duration::from_secs(120),
        || effects.count() >= ids.len(),
    )
    .await?;
    // Late duplicates would show up within a moment.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let seen = effects.snapshot();
    let twice = seen.values().filter(|n| **n > 1).count();
    ensure!(twice == 0, "{twice} ids had more than one effect");
    ensure!(
        seen.len() == ids.len(),
        "{} ids handled, {} parked",
        seen.len(),
        ids.len()
    );
    ensure!(
        ids.iter().all(|id| seen.contains_key(id)),
        "a handled id was not parked"
    );
    let stats = json(&mut dlq(url, consumer, source, &["stats", "--json"]), 0)?;
    ensure!(stats["count"] == 0, "left in the DLQ: {}", stats["count"]);
    Ok(())
}

async fn replays_at_the_rate(backend: &str) -> anyhow::Result<()> {
    let (n, rate) = scale();
    let url = url(backend);
    let (name, source) = (unique("scale"), unique("scale-src"));
    let broker: Arc<dyn Broker> = reliq::connect(&url).await?;
    let (handle, effects) = consumer(broker.clone(), &name, &source).await?;
    let ids = park(&broker, &handle, &source, n, fill_time(n)).await?;

    let mut replay = dlq(
        &url,
        &name,
        &source,
        &["replay", "--rate", &rate.to_string(), "--json"],
    );
    let (code, out, err) = support::run(&mut replay)?;
    if std::env::var("RELIQ_TEST_CLI_LOG").is_ok() {
        eprintln!("{err}");
    }
    ensure!(code == 0, "exit {code}\n{out}\n{err}");
    let outcome: serde_json::Value = serde_json::from_str(&out)?;
    let done = outcome["done"].as_u64().context("done")?;
    let achieved = outcome["rate_per_second"].as_f64().context("rate")?;
    eprintln!(
        "{backend}: replayed {done} of {n} at {achieved:.0}/s (asked {rate}/s) in {:.1} s",
        outcome["elapsed_seconds"].as_f64().unwrap_or_default()
    );
    ensure!(done == n as u64, "{outcome}");
    ensure!(
        achieved >= 0.9 * f64::from(rate),
        "achieved {achieved:.0}/s, asked {rate}/s: {outcome}\n{err}"
    );
    ensure!(
        achieved <= 1.1 * f64::from(rate),
        "achieved {achieved:.0}/s, over the {rate}/s asked: {outcome}"
    );
    all_handled_once(&effects, &ids, &url, &name, &source).await?;
    handle.shutdown().await;
    Ok(())
}

async fn a_replay_killed_midway_and_run_again_loses_and_doubles_nothing(
    backend: &str,
) -> anyhow::Result<()> {
    let (n, rate) = scale();
    let url = url(backend);
    let (name, source) = (unique("scale-kill"), unique("scale-kill-src"));
    let broker: Arc<dyn Broker> = reliq::connect(&url).await?;
    let (handle, effects) = consumer(broker.clone(), &name, &source).await?;
    let ids = park(&broker, &handle, &source, n, fill_time(n)).await?;

    let mut first = dlq(
        &url,
        &name,
        &source,
        &["replay", "--rate", &rate.to_string(), "--json"],
    )
    .stdout(std::process::Stdio::null())
    .stderr(std::process::Stdio::null())
    .spawn()
    .context("starting reliq")?;
    let third = ids.len() / 3;
    wait_for("a third replayed", Duration::from_secs(120), || {
        effects.count() >= third
    })
    .await?;
    first.kill().context("SIGKILL")?; // std's kill is SIGKILL on Unix
    let status = first.wait()?;
    ensure!(
        status.code().is_none(),
        "the replay ended by itself before the kill: {status}"
    );
    let before_second = effects.count();
    ensure!(
        before_second < ids.len(),
        "the whole replay finished before the kill"
    );

    let outcome = json(
        &mut dlq(
            &url,
            &name,
            &source,
            &["replay", "--rate", &rate.to_string(), "--json"],
        ),
        0,
    )?;
    eprintln!(
        "{backend}: killed after {before_second} handled; the second run replayed {}",
        outcome["done"]
    );
    ensure!(
        outcome["cancelled"] == false && outcome["failed"].as_array().is_some_and(Vec::is_empty),
        "{outcome}"
    );
    all_handled_once(&effects, &ids, &url, &name, &source).await?;
    handle.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rabbit_replays_at_the_rate_asked() -> anyhow::Result<()> {
    replays_at_the_rate("rabbit").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kafka_replays_at_the_rate_asked() -> anyhow::Result<()> {
    replays_at_the_rate("kafka").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rabbit_replay_killed_midway_loses_and_doubles_nothing() -> anyhow::Result<()> {
    a_replay_killed_midway_and_run_again_loses_and_doubles_nothing("rabbit").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kafka_replay_killed_midway_loses_and_doubles_nothing() -> anyhow::Result<()> {
    a_replay_killed_midway_and_run_again_loses_and_doubles_nothing("kafka").await
}
