//! Tests that stop and start a real broker (`scripts/brokers down|up` for one broker).
//! They disturb every other test on that broker, so `just test` runs this binary on its
//! own, after the rest (nextest profile `disruptive`, one test at a time); the default
//! profile leaves it out. Run by hand: `cargo nextest run --workspace --profile disruptive`.

use std::collections::HashSet;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::{Context as _, ensure};
use reliq_conformance::Backend;
use reliq_conformance::support::{Recorder, unique, wait_until};
use reliq_core::{
    BoxError, Broker, Consumer, Delivery, Destination, MemoryInbox, Message, MessageId,
    RetryPolicy, Subscription, Transient,
};
use reliq_integration::kafka::KafkaBackend;
use reliq_integration::nats::NatsBackend;
use reliq_integration::rabbit::RabbitBackend;
use reliq_rabbit::{RabbitBroker, RabbitOptions, Reconnect};

/// Stop and start one broker of `scripts/brokers` (data kept), on a blocking thread.
async fn restart(broker: &'static str) -> anyhow::Result<Duration> {
    tokio::task::spawn_blocking(move || {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/brokers");
        let started = std::time::Instant::now();
        for action in ["down", "up"] {
            let out = Command::new(script)
                .arg(action)
                .env("BROKERS_ONLY", broker)
                .output()
                .with_context(|| format!("running {script} {action}"))?;
            ensure!(
                out.status.success(),
                "scripts/brokers {action} {broker} failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(started.elapsed())
    })
    .await?
}

/// A connection that keeps reconnecting through a broker restart (~15 s here).
async fn patient_rabbit() -> anyhow::Result<Arc<dyn Broker>> {
    let url = reliq_integration::settings::get("RELIQ_RABBIT_URL");
    let options = RabbitOptions {
        reconnect: Reconnect {
            max_failures: 60,
            initial: Duration::from_millis(200),
            max: Duration::from_secs(2),
        },
        ..RabbitBackend::options()
    };
    Ok(Arc::new(RabbitBroker::connect_with(&url, options).await?))
}

/// `service` (a broker of `scripts/brokers`) restarted while 1,000 messages (or more,
/// until the broker is back) are being published and consumed (every seventh fails once and waits for its retry in the
/// broker): every confirmed message is processed, exactly once with the inbox, nothing
/// is dead-lettered, and the restart really cut the clients off (a publish stalled for
/// seconds: the backends reconnect inside `publish`; one that fails anyway is retried by
/// the publisher with the same id).
async fn restart_mid_run_loses_nothing(
    backend: &dyn Backend,
    broker: Arc<dyn Broker>,
    service: &'static str,
) -> anyhow::Result<()> {
    const TOTAL: usize = 1_000;
    let topic = unique("restart");
    backend.declare_source(&broker, &topic).await?;
    let tiers = backend.tiers();
    let rec = Recorder::new();
    let inbox = Arc::new(MemoryInbox::new());
    let r = rec.clone();
    let consumer = Consumer::builder(broker.clone(), "c")
        .subscribe(topic.clone())
        .retry(RetryPolicy::tiers(tiers).max_attempts(5))
        .inbox(inbox.clone())
        .max_in_flight(32)
        .settle_backoff(Duration::from_millis(100), Duration::from_secs(1))
        .start(move |d: Delivery| {
            let r = r.clone();
            async move {
                r.call(&d);
                let n: usize = std::str::from_utf8(d.payload())?.parse()?;
                if n.is_multiple_of(7) && d.attempt() == 1 {
                    return Err(Transient::msg("first attempt of every seventh fails").into());
                }
                r.effect(d.id());
                Ok::<(), BoxError>(())
            }
        })
        .await?;

    let confirmed = Arc::new(AtomicUsize::new(0));
    let publish_errors = Arc::new(AtomicU32::new(0));
    // Set when the broker is back. The publisher keeps going until then (and 50 messages
    // past it), so publishes are in flight while the broker is down however long its
    // shutdown takes (NATS flushing many streams: seconds).
    let restarted = Arc::new(AtomicBool::new(false));
    let publisher = {
        let (broker, confirmed, errors, restarted) = (
            broker.clone(),
            confirmed.clone(),
            publish_errors.clone(),
            restarted.clone(),
        );
        let dest = Destination::new(topic.clone());
        tokio::spawn(async move {
            let mut ids = Vec::with_capacity(TOTAL);
            let mut longest = Duration::ZERO;
            let mut after_restart = 0;
            let mut n = 0;
            while n < TOTAL || after_restart < 50 {
                if restarted.load(Ordering::Relaxed) {
                    after_restart += 1;
                }
                let started = tokio::time::Instant::now();
                let m = Message::new(n.to_string());
                ids.push(m.id().clone());
                // Retried with the same id until confirmed: a publish cut off before
                // its confirm may still have reached the queue (the inbox absorbs it).
                let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
                while let Err(e) = broker.publish(&dest, m.clone()).await {
                    errors.fetch_add(1, Ordering::Relaxed);
                    anyhow::ensure!(
                        tokio::time::Instant::now() < deadline,
                        "message {n} unconfirmed for 120 s: {e}"
                    );
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
                longest = longest.max(started.elapsed());
                confirmed.fetch_add(1, Ordering::Relaxed);
                n += 1;
                tokio::time::sleep(Duration::from_millis(8)).await;
            }
            Ok::<_, anyhow::Error>((ids, longest))
        })
    };

    wait_until("300 messages confirmed", Duration::from_secs(60), || {
        confirmed.load(Ordering::Relaxed) >= 300
    })
    .await?;
    let took = restart(service).await?;
    restarted.store(true, Ordering::Relaxed);
    let (ids, longest_publish) = publisher.await??;
    ensure!(
        longest_publish >= Duration::from_secs(3),
        "the restart ({took:?}) never held up a publish (longest {longest_publish:?})"
    );
    println!(
        "restart took {took:?}; longest publish {longest_publish:?}; publish errors {}",
        publish_errors.load(Ordering::Relaxed)
    );

    wait_until("every message processed", Duration::from_secs(60), || {
        rec.effect_count() >= ids.len()
    })
    .await
    .with_context(|| {
        // Which messages (by number) and how far each got: a retry stuck in a tier
        // shows as a single attempt.
        let effects = rec.effects();
        let calls = rec.calls();
        let missing: Vec<String> = (ids.iter().enumerate())
            .filter(|(_, id)| !effects.contains_key(*id))
            .map(|(n, id)| {
                let attempts = calls.iter().filter(|c| &c.id == id).count();
                format!("{n} ({attempts} calls)")
            })
            .collect();
        format!("unprocessed: {missing:?}")
    })?;
    // A short quiet period: a late duplicate would show up as a second effect.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let effects = rec.effects();
    let published: HashSet<&MessageId> = ids.iter().collect();
    ensure!(
        effects.len() == ids.len(),
        "{} distinct effects of {} messages",
        effects.len(),
        ids.len()
    );
    for (id, n) in &effects {
        ensure!(published.contains(id), "effect for unknown id {id}");
        ensure!(*n == 1, "{id} applied {n} times");
    }
    let stats = consumer.stats();
    ensure!(stats.dead_lettered == 0, "{stats:?}");
    // Every seventh message fails its first attempt and goes through a retry — unless
    // the broker counts every delivery as an attempt (NATS) and the restart swallowed
    // its first delivery (sent, never received): it then arrives as attempt 2 and
    // succeeds without a retry. A retry cut off by the restart is a settle failure
    // (released, delivered again).
    let calls = rec.calls();
    let sevenths: Vec<&MessageId> = ids.iter().step_by(7).collect();
    let late = sevenths
        .iter()
        .filter(|id| {
            calls
                .iter()
                .filter(|c| &c.id == **id)
                .map(|c| c.attempt)
                .min()
                .is_some_and(|first| first > 1)
        })
        .count();
    ensure!(
        late == 0 || broker.capabilities().attempts_count_every_delivery,
        "{late} messages were first seen at attempt > 1 on a broker that carries the attempt in a header"
    );
    ensure!(
        stats.retried as usize + late + stats.settle_failures as usize >= sevenths.len(),
        "{} of {} failing messages accounted for ({late} first seen late): {stats:?}",
        stats.retried as usize + late + stats.settle_failures as usize,
        sevenths.len()
    );
    consumer.shutdown().await;

    let mut sub = Subscription::new("c", topic.clone());
    sub.retry_tiers = tiers.to_vec();
    let dlq = broker.dead_letters(&sub).await?;
    let parked = dlq.count().await?;
    ensure!(parked.count == 0, "something was dead-lettered: {parked:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbit_restart_mid_run_loses_nothing() -> anyhow::Result<()> {
    restart_mid_run_loses_nothing(&RabbitBackend::new(), patient_rabbit().await?, "rabbitmq").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_restart_mid_run_loses_nothing() -> anyhow::Result<()> {
    let backend = NatsBackend::new();
    let broker = backend.connect().await?;
    restart_mid_run_loses_nothing(&backend, broker, "nats").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_restart_mid_run_loses_nothing() -> anyhow::Result<()> {
    let backend = KafkaBackend::new();
    let broker = backend.connect().await?;
    restart_mid_run_loses_nothing(&backend, broker, "kafka").await
}
