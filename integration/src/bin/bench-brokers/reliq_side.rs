//! The reliq side of each measurement: publishes through `Broker::publish` and the
//! consumer runtime draining a filled topic.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use reliq_conformance::support::unique;
use reliq_core::{
    Batch, BoxError, Broker, Consumer, Delivery, Destination, Message, Permanent, RetryPolicy,
    Transient,
};
use reliq_integration::settings;

use crate::measure::{Rate, cpu_time, print_thread_cpu, print_timeline, thread_cpu};
use crate::workload::{payload, publish_window_of, settle_after_fill};
use crate::{IN_FLIGHT, PREFETCH, RETRY_TIER};

async fn reliq_publish(broker: &Arc<dyn Broker>, topic: &str, n: usize) -> anyhow::Result<Rate> {
    reliq_publish_of(broker, topic, n, IN_FLIGHT).await
}

async fn reliq_publish_of(
    broker: &Arc<dyn Broker>,
    topic: &str,
    n: usize,
    window: usize,
) -> anyhow::Result<Rate> {
    let dest = Destination::new(topic);
    publish_window_of(n, window, |i| {
        let publish = broker.publish(&dest, Message::new(payload(i)));
        async move { Ok(publish.await?) }
    })
    .await
}

/// How the timed reliq consumer handles messages.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Handling {
    /// A per-message handler that does nothing.
    Each,
    /// Every message fails once (transient), then succeeds: the failure path.
    FailOnce,
    /// A batch handler (`start_batch`, batches of up to [`BATCH_SIZE`]) that does nothing.
    Batch,
    /// Every message fails permanently: each is dead-lettered. Done at its settlement.
    DeadLetter,
    /// Every message fails once (transient), waits [`RETRY_TIER`] in the broker, then
    /// succeeds: the retry path at the broker's limit.
    RetryOnce,
}

/// `batch_size` of the batch-handler runs: half the prefetch, so a second batch is
/// received while the first is settled.
const BATCH_SIZE: usize = PREFETCH as usize / 2;

/// Declare the consumer's topology, fill it, then time the runtime draining it.
pub async fn reliq_consume(
    broker: &Arc<dyn Broker>,
    handling: Handling,
    n: usize,
    fill_window: usize,
) -> anyhow::Result<Rate> {
    let topic = unique("bench");
    let builder = Consumer::builder(broker.clone(), "bench")
        .subscribe(topic.clone())
        .retry(
            RetryPolicy::tiers([if handling == Handling::RetryOnce {
                RETRY_TIER
            } else {
                Duration::from_secs(1)
            }])
            .max_attempts(3),
        )
        .max_in_flight(PREFETCH);
    drop(broker.subscribe(&builder.subscription()?).await?);
    reliq_publish_of(broker, &topic, n, fill_window).await?;
    settle_after_fill().await?;
    let done = Arc::new(AtomicU64::new(0));
    // Timed from the first delivery, like the raw consumers: group joins and
    // subscription set-up are not part of the throughput.
    // Ends at the handler call that completes the n-th message (not at the next tick of
    // the polling loop below).
    let first = Arc::new(std::sync::OnceLock::<Instant>::new());
    let last = Arc::new(std::sync::OnceLock::<Instant>::new());
    let (d2, f2, l2) = (done.clone(), first.clone(), last.clone());
    // The clock starts at the first delivery, failed or not: on the failure path the
    // first handler calls fail, and their retry publishes belong to what is timed.
    let seen = first.clone();
    // `--timeline-ms W`: every handler call's time and attempt, printed after the run
    // as counts per W ms since the first delivery (where a slow round's time goes).
    let timeline_bucket = settings::arg("--timeline-ms")
        .map(|v| v.parse::<u64>())
        .transpose()?
        .map(Duration::from_millis);
    let calls = Arc::new(std::sync::Mutex::new(Vec::<(Instant, u32)>::with_capacity(
        if timeline_bucket.is_some() { 2 * n } else { 0 },
    )));
    let record = timeline_bucket.map(|_| calls.clone());
    let by_thread = timeline_bucket.is_some() || std::env::args().any(|a| a == "--thread-cpu");
    let threads0 = by_thread.then(thread_cpu);
    let cpu0 = cpu_time();
    let count = move |handled: usize| {
        f2.get_or_init(Instant::now);
        let handled = handled as u64;
        if d2.fetch_add(handled, Ordering::Relaxed) + handled == n as u64 {
            l2.get_or_init(Instant::now);
        }
    };
    let handle = match handling {
        Handling::Batch => {
            builder
                .batch_size(BATCH_SIZE)
                .start_batch(move |batch: Batch| {
                    // Each payload, like the raw consumers.
                    batch.iter().for_each(|d| {
                        std::hint::black_box(d.payload());
                    });
                    count(batch.len());
                    async { Ok(()) }
                })
                .await?
        }
        Handling::Each | Handling::FailOnce | Handling::DeadLetter | Handling::RetryOnce => {
            builder
                .start(move |d: Delivery| {
                    seen.get_or_init(Instant::now);
                    if let Some(calls) = &record {
                        calls
                            .lock()
                            .expect("timeline")
                            .push((Instant::now(), d.attempt()));
                    }
                    std::hint::black_box(d.payload());
                    let result = if handling == Handling::DeadLetter {
                        Err(Permanent::msg("dead-letter path").into())
                    } else if matches!(handling, Handling::FailOnce | Handling::RetryOnce)
                        && d.attempt() == 1
                    {
                        Err(Transient::msg("fails once").into())
                    } else {
                        count(1);
                        Ok::<(), BoxError>(())
                    };
                    async move { result }
                })
                .await?
        }
    };
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        if handling == Handling::DeadLetter {
            // Done at the n-th settlement (the dead letter confirmed, the source acked):
            // seen within this loop's 1 ms tick.
            if handle.stats().dead_lettered >= n as u64 {
                let _ = last.set(Instant::now());
                break;
            }
        } else if done.load(Ordering::Relaxed) >= n as u64 {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "reliq consumer stalled: {:?}",
            handle.stats()
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let t0 = *first.get().context("no delivery")?;
    let t1 = *last.get().context("no last delivery")?;
    let rate = Rate {
        per_sec: n as f64 / t1.duration_since(t0).as_secs_f64(),
        cpu_us: (cpu_time() - cpu0).as_secs_f64() * 1e6 / n as f64,
    };
    if let Some(threads0) = &threads0 {
        print_thread_cpu(threads0, n);
    }
    handle.shutdown().await;
    if let Some(bucket) = timeline_bucket {
        print_timeline(t0, bucket, &calls.lock().expect("timeline"));
    }
    Ok(rate)
}

/// reliq's confirmed publish into a fresh topology (a bound consumer queue).
pub async fn reliq_publish_fresh(broker: &Arc<dyn Broker>, n: usize) -> anyhow::Result<Rate> {
    let topic = unique("bench-pub");
    let builder = Consumer::builder(broker.clone(), "sink").subscribe(topic.clone());
    drop(broker.subscribe(&builder.subscription()?).await?);
    reliq_publish(broker, &topic, n).await
}
