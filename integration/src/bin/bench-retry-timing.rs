//! Retry timing on a real broker (started by `scripts/brokers up`) or the embedded one:
//! how late a retry comes back against the delay its tier asked for.
//!
//! ```sh
//! cargo run --release -p reliq-integration --bin bench-retry-timing -- --broker kafka
//! cargo run --release -p reliq-integration --bin bench-retry-timing -- --broker rabbit --messages 1000 --tiers 2000,5000 --spacing-ms 10
//! ```
//!
//! `--messages` messages are published `--spacing-ms` apart (a steady stream, so the
//! retries of one tier are due one after another, as in production, not all at once).
//! The handler fails every attempt but the last transiently: attempt *k* fails, the
//! runtime sends it to tier *k*, and attempt *k + 1* arrives. The lateness of a retry is
//! (arrival of attempt *k + 1*) − (return of attempt *k*'s handler) − (tier *k*'s delay):
//! it includes the settle (the retry publish and its confirm), so it is an upper bound of
//! the broker's own lateness. A negative lateness is a retry that came back early.
//!
//! Reported per tier: p50 / p99 / max lateness, early retries, and the target check
//! (never early; p99 within max(+5 % of the delay, +250 ms)).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use reliq_conformance::support::unique;
use reliq_core::{
    BoxError, Broker, Consumer, Delivery, Destination, Message, RetryPolicy, Transient,
};
use reliq_integration::settings;

async fn connect(broker: &str) -> anyhow::Result<Arc<dyn Broker>> {
    reliq_integration::connect_by_name(broker).await
}

/// What the handler saw of one message: when each attempt's handler returned a failure.
#[derive(Default)]
struct Timeline {
    /// `failed[k - 1]`: when attempt `k` returned its transient failure.
    failed: Vec<Instant>,
    /// Lateness of each retry in ms, per tier (index = tier).
    late_ms: Vec<Vec<f64>>,
    finished: usize,
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let broker_name = settings::arg("--broker").context("--broker memory|rabbit|nats|kafka|sqs")?;
    let n: usize = settings::arg("--messages")
        .map(|v| v.parse())
        .transpose()?
        .unwrap_or(1000);
    let spacing = Duration::from_millis(
        settings::arg("--spacing-ms")
            .map(|v| v.parse())
            .transpose()?
            .unwrap_or(10),
    );
    let tiers: Vec<Duration> = settings::arg("--tiers")
        .unwrap_or_else(|| "2000".into())
        .split(',')
        .map(|ms| ms.trim().parse().map(Duration::from_millis))
        .collect::<Result<_, _>>()
        .context("--tiers: delays in ms, comma-separated")?;
    ensure!(!tiers.is_empty(), "--tiers: at least one delay");
    let attempts = u32::try_from(tiers.len() + 1)?;

    let broker = connect(&broker_name).await?;
    let topic = unique("retry-timing");
    let state = Arc::new(Mutex::new(HashMap::<String, Timeline>::new()));
    let seen = state.clone();
    let tier_count = tiers.len();
    let tier_ms: Vec<f64> = tiers.iter().map(|t| t.as_secs_f64() * 1e3).collect();
    let handle = Consumer::builder(broker.clone(), "timing")
        .subscribe(topic.clone())
        .retry(RetryPolicy::tiers(tiers.clone()).max_attempts(attempts))
        .max_in_flight(256)
        .start(move |d: Delivery| {
            let now = Instant::now();
            let key = String::from_utf8_lossy(d.payload()).into_owned();
            let attempt = d.attempt() as usize;
            let mut all = seen.lock().expect("timeline lock");
            let t = all.entry(key).or_default();
            if t.late_ms.is_empty() {
                t.late_ms = vec![Vec::new(); tier_count];
            }
            // Attempt k + 1 closes the wait of tier k (asked for when attempt k failed).
            if attempt >= 2
                && let Some(&failed) = t.failed.get(attempt - 2)
            {
                let waited = now.duration_since(failed).as_secs_f64() * 1e3;
                t.late_ms[attempt - 2].push(waited - tier_ms[attempt - 2]);
            }
            let result: Result<(), BoxError> = if attempt <= tier_count {
                if t.failed.len() < attempt {
                    t.failed.resize(attempt, now);
                }
                t.failed[attempt - 1] = Instant::now();
                Err(Transient::msg("timed retry").into())
            } else {
                t.finished += 1;
                Ok(())
            };
            async move { result }
        })
        .await?;
    let dest = Destination::new(&topic);
    let t0 = Instant::now();
    for i in 0..n {
        // A steady stream: message i leaves at t0 + i × spacing (not after the previous
        // confirm plus the spacing, which would drift).
        let at = t0 + spacing * u32::try_from(i)?;
        tokio::time::sleep_until(at.into()).await;
        broker
            .publish(&dest, Message::new(format!("m{i}").into_bytes()))
            .await?;
    }
    let longest: Duration = tiers.iter().sum();
    let deadline = Instant::now() + longest * 2 + Duration::from_secs(60);
    loop {
        let finished = state
            .lock()
            .expect("timeline lock")
            .values()
            .map(|t| t.finished)
            .sum::<usize>();
        if finished >= n {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "{finished} of {n} messages finished their retries: {:?}",
            handle.stats()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    handle.shutdown().await;

    let all = state.lock().expect("timeline lock");
    println!(
        "{broker_name}: {n} messages {} ms apart, each retried through tiers {:?}; lateness = arrival of the next attempt − failure − delay",
        spacing.as_millis(),
        tiers
    );
    let mut ok = true;
    for (k, tier) in tiers.iter().enumerate() {
        let mut late: Vec<f64> = all
            .values()
            .flat_map(|t| t.late_ms[k].iter().copied())
            .collect();
        late.sort_by(f64::total_cmp);
        let early = late.iter().filter(|&&l| l < 0.0).count();
        let bound = (tier.as_secs_f64() * 1e3 * 0.05).max(250.0);
        let p99 = percentile(&late, 99.0);
        let meets = early == 0 && p99 <= bound && late.len() == n;
        ok &= meets;
        println!(
            "  tier {} ms: {} retries, lateness p50 {:.0} / p99 {:.0} / max {:.0} ms, min {:.0} ms, early {early}; target (never early, p99 <= {bound:.0} ms): {}",
            tier.as_millis(),
            late.len(),
            percentile(&late, 50.0),
            p99,
            late.last().copied().unwrap_or(f64::NAN),
            late.first().copied().unwrap_or(f64::NAN),
            if meets { "met" } else { "NOT met" },
        );
    }
    if !ok {
        std::process::exit(1);
    }
    Ok(())
}
