//! Client clock skew: a consumer whose wall clock is 5 minutes ahead of or behind the
//! broker's still retries each message after its delay — not at once, not 5 minutes late.
//! The skew is `integration/skew/skew_clock.c` preloaded into the consumer's process
//! (compiled here with the system's C compiler; why not libfaketime: its header).
//!
//! The consumer (`skewed-consumer`) fails every message's first attempt; this process,
//! on the true clock, publishes the messages and times the gap between each one's two
//! handler calls from the child's output, on its own monotonic clock. Only the child's
//! wall clock skews, as on a host whose NTP is off; its monotonic clock does not.
//!
//! Each broker waits out a retry by its own mechanism: RabbitMQ (a TTL queue) and SQS
//! (the visibility timeout) by a relative delay, Kafka (a retry topic) by the record's
//! timestamp against the same consumer's clock, NATS by a scheduled message whose
//! absolute time the *server* fires — so reliq writes it in the server's clock (measured,
//! `reliq_nats`'s `clock` module). Without that, the NATS consumer behind the server
//! retried every message at once, and the one ahead held each retry 5 minutes.

use std::collections::HashMap;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use reliq_conformance::support::unique;
use reliq_core::{Destination, Message};
use reliq_integration::crash::{self, Backend};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;
use tokio::time::Instant;

/// The retry delay the consumer asks for.
const DELAY: Duration = Duration::from_secs(3);
/// Messages per run.
const MESSAGES: usize = 10;
/// How much later than its delay a retry may come (SQS visibility has whole seconds, a
/// Kafka relay polls): far below the 5 minutes of skew.
const LATE: Duration = Duration::from_secs(4);
/// How much earlier than its delay a retry may be seen here (the two handler calls are
/// timed through a pipe): far above what a retry fired at once would leave.
const EARLY: Duration = Duration::from_millis(300);

async fn retried_after_its_delay(backend: Backend, skew_minutes: i64) -> anyhow::Result<()> {
    let lib = reliq_integration::skew::library(Path::new(env!("CARGO_TARGET_TMPDIR")))?;
    let topic = unique("skew");
    let prefix = unique("skew");
    let mut child = Command::new(env!("CARGO_BIN_EXE_skewed-consumer"))
        .args(["--backend", backend.name(), "--topic", &topic])
        .args(["--group-prefix", &prefix])
        .args(["--delay-ms", &DELAY.as_millis().to_string()])
        .env("LD_PRELOAD", &lib)
        .env(
            reliq_integration::skew::SKEW_MS,
            (skew_minutes * 60_000).to_string(),
        )
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .context("starting skewed-consumer")?;
    // Each line is timed when it arrives, by a task of its own: read between publishes,
    // a line the child wrote while this test was still publishing would be timed late,
    // and its message's retry would look early (the publishes to a loaded SQS took
    // 1.7 s once).
    let stdout = child.stdout.take().context("the child's stdout")?;
    let (line_tx, mut line_rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut lines = BufReader::new(stdout).lines();
        loop {
            let line = lines.next_line().await;
            let last = !matches!(line, Ok(Some(_)));
            if line_tx.send((Instant::now(), line)).is_err() || last {
                break;
            }
        }
    });
    let mut next_line = async || -> anyhow::Result<(Instant, String)> {
        match tokio::time::timeout(Duration::from_secs(60), line_rx.recv()).await {
            Ok(Some((at, Ok(Some(line))))) => Ok((at, line)),
            Ok(Some((_, Ok(None))) | None) => bail!("skewed-consumer exited"),
            Ok(Some((_, Err(e)))) => Err(e.into()),
            Err(_) => bail!("skewed-consumer said nothing for 60 s"),
        }
    };

    // The skew is real: the child's wall clock is off by what was asked.
    let (_, clock) = next_line().await?;
    let child_ms: i64 = clock
        .strip_prefix("clock ")
        .context("first line")?
        .parse()?;
    let skew_ms = child_ms - reliq_integration::skew::unix_ms_now();
    ensure!(
        (skew_ms - skew_minutes * 60_000).abs() < 10_000,
        "the child's clock is {skew_ms} ms off ours, not {skew_minutes} min: the skew did not take"
    );
    let (_, ready) = next_line().await?;
    ensure!(ready == "ready", "expected `ready`, got `{ready}`");

    let broker = crash::connect(backend, &prefix).await?;
    let mut ids = Vec::new();
    for n in 0..MESSAGES {
        let message = Message::new(format!("order {n}"));
        ids.push(message.id().to_string());
        broker
            .publish(&Destination::from(topic.as_str()), message)
            .await?;
    }

    // Each message's calls, by attempt, as seen here.
    let mut calls: HashMap<String, Vec<(u32, Instant)>> = HashMap::new();
    let deadline = Instant::now() + DELAY + LATE + Duration::from_secs(60);
    while calls.values().filter(|c| c.len() >= 2).count() < MESSAGES {
        ensure!(
            Instant::now() < deadline,
            "not every message retried in time: {calls:?}"
        );
        let (at, line) = next_line().await?;
        let mut words = line.split(' ');
        if words.next() != Some("call") {
            continue;
        }
        let (Some(id), Some(attempt)) = (words.next(), words.next()) else {
            bail!("bad line `{line}`");
        };
        calls
            .entry(id.to_owned())
            .or_default()
            .push((attempt.parse()?, at));
    }
    drop(child.stdin.take());
    let status = tokio::time::timeout(Duration::from_secs(60), child.wait()).await??;
    ensure!(status.success(), "skewed-consumer: {status}");

    for id in &ids {
        let c = calls
            .get(id)
            .with_context(|| format!("{id} never handled"))?;
        ensure!(
            c.len() == 2 && c[0].0 == 1 && c[1].0 == 2,
            "{id}: calls {c:?}"
        );
        let waited = c[1].1 - c[0].1;
        ensure!(
            waited + EARLY >= DELAY,
            "{id} retried after {waited:?}, before its {DELAY:?} delay (clock {skew_minutes:+} min)"
        );
        ensure!(
            waited <= DELAY + LATE,
            "{id} retried after {waited:?}, long after its {DELAY:?} delay (clock {skew_minutes:+} min)"
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_consumer_behind_by_5_min_retries_after_its_delay() -> anyhow::Result<()> {
    retried_after_its_delay(Backend::Nats, -5).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_consumer_ahead_by_5_min_retries_after_its_delay() -> anyhow::Result<()> {
    retried_after_its_delay(Backend::Nats, 5).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_consumer_behind_by_5_min_retries_after_its_delay() -> anyhow::Result<()> {
    retried_after_its_delay(Backend::Kafka, -5).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_consumer_ahead_by_5_min_retries_after_its_delay() -> anyhow::Result<()> {
    retried_after_its_delay(Backend::Kafka, 5).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbit_consumer_behind_by_5_min_retries_after_its_delay() -> anyhow::Result<()> {
    retried_after_its_delay(Backend::Rabbit, -5).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbit_consumer_ahead_by_5_min_retries_after_its_delay() -> anyhow::Result<()> {
    retried_after_its_delay(Backend::Rabbit, 5).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqs_consumer_behind_by_5_min_retries_after_its_delay() -> anyhow::Result<()> {
    retried_after_its_delay(Backend::Sqs, -5).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqs_consumer_ahead_by_5_min_retries_after_its_delay() -> anyhow::Result<()> {
    retried_after_its_delay(Backend::Sqs, 5).await
}
