//! Benchmark on a real broker (started by `scripts/brokers up`): reliq against the raw
//! client crate on the same broker, in the same run.
//!
//! ```sh
//! cargo run --release -p reliq-integration --bin bench-brokers -- --broker rabbit --messages 5000 --rounds 5
//! ```
//!
//! Each round measures both sides (alternating which goes first); the report gives the
//! median and the range per side and the ratio of the medians.
//!
//! Measures, each as msg/s and as a ratio reliq / raw:
//! - **publish**: `--messages` confirmed publishes, 64 in flight (reliq `Broker::publish`
//!   vs the raw client's confirmed publish);
//! - **consume**: a pre-filled queue/stream/topic drained with a no-op handler, prefetch
//!   256 (the reliq runtime vs a raw consumer that acks/commits each message; on Kafka,
//!   where librdkafka parses headers only when asked, a second raw consumer also reads
//!   each record's message id, as reliq does for every delivery);
//! - **failure path**: every message fails once (transient), is retried after the 1 s
//!   tier and then succeeds; timed from the first delivery to the N-th success (so the
//!   retry publishes and the tier's wait are inside the clock), and reported beside the
//!   broker's own limit for that work — one confirmed publish and two deliveries per
//!   message at the raw client's rates of the same run (`--only failure`: just this).
//! - **dead-letter path** (`--only dead-letter`): a pre-filled queue/stream/topic whose
//!   every message fails permanently, timed from the first delivery to the N-th dead
//!   letter settled (reliq's `dead_lettered` count), against a raw loop on the same
//!   broker doing the same broker work — consume, a confirmed publish of the message to
//!   a second queue/stream/topic, then the ack or commit — as fast as the client safely
//!   allows (up to the prefetch in flight; on Kafka a commit only past what is produced).
//! - **retry path** (`--only retry`): a pre-filled source whose every message fails once
//!   (transient), waits in the broker's first tier ([`RETRY_TIER`]) and then succeeds,
//!   timed from the first delivery to the N-th success; against the raw client doing that
//!   broker work as reliq's backend does — RabbitMQ: a confirmed publish to a TTL queue
//!   that dead-letters back, NATS: a confirmed `Nats-Schedule` message the server
//!   publishes back when due, both in one loop that acks the second delivery; Kafka: the
//!   dead-letter path's raw loop to a retry topic, and beside it a relay consumer that
//!   holds each copy until its timestamp plus the tier.
//!
//! `--timeline-ms W` (the per-message reliq rounds): after each round, reliq's handler calls
//! per W ms since the first delivery by attempt, and the round's CPU per message by
//! thread name — where a slow round's time goes. `--thread-cpu`: only the CPU by thread
//! (the timeline's recording costs a lock per call, too much for a consume round).

mod measure;
mod raw_kafka;
mod raw_nats;
mod raw_rabbit;
mod raw_sqs;
mod reliq_side;
mod workload;

use std::sync::Arc;
use std::time::Duration;

/// Built with `--features mimalloc`: mimalloc for every Rust allocation of both sides
/// (librdkafka's own allocations still use the C library's `malloc`).
#[cfg(feature = "mimalloc")]
// guide:mimalloc
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;
// guide:end

use anyhow::{Context, bail};
use reliq_core::Broker;
use reliq_integration::settings;

use crate::measure::{Rate, Series, median};
use crate::reliq_side::{Handling, reliq_consume, reliq_publish_fresh};

const IN_FLIGHT: usize = 64;
/// Publishes outstanding while filling a topic for a consume round (Kafka): the fill is
/// not measured, and at [`IN_FLIGHT`] it took most of a round (librdkafka lingers a few
/// milliseconds per batch), which kept the consume rounds too short to measure steadily.
const FILL_IN_FLIGHT: usize = 4096;
const PREFETCH: u32 = 256;

/// The retry path's tier: short, so the run measures the path rather than the wait.
const RETRY_TIER: Duration = Duration::from_millis(200);

async fn connect(broker: &str) -> anyhow::Result<Arc<dyn Broker>> {
    reliq_integration::connect_by_name(broker).await
}

async fn raw_publish(broker: &str, n: usize) -> anyhow::Result<Rate> {
    match broker {
        "rabbit" => raw_rabbit::publish(n).await,
        "nats" => raw_nats::publish(n).await,
        "sqs" => raw_sqs::publish(n).await,
        _ => raw_kafka::publish(n).await,
    }
}

/// The raw client doing the dead-letter path's broker work (consume, confirmed publish
/// to a second queue, ack).
async fn raw_forward(broker: &str, n: usize) -> anyhow::Result<Rate> {
    match broker {
        "rabbit" => raw_rabbit::forward(n).await,
        "nats" => raw_nats::forward(n).await,
        "kafka" => raw_kafka::forward(n).await,
        "sqs" => raw_sqs::forward(n).await,
        other => bail!("no raw dead-letter baseline for {other}"),
    }
}

/// The raw client doing the retry path's broker work the way reliq's backend does it:
/// RabbitMQ and NATS in one loop (a TTL queue dead-lettering back; a server schedule);
/// Kafka the dead-letter path's loop (consume, produce the copy, commit) to a retry
/// topic, and beside it a relay consumer holding each copy until its tier has passed.
async fn raw_retry(broker: &str, n: usize) -> anyhow::Result<Rate> {
    match broker {
        "rabbit" => raw_rabbit::retry(n).await,
        "nats" => raw_nats::retry(n).await,
        "kafka" => raw_kafka::retry(n).await,
        "sqs" => raw_sqs::retry(n).await,
        other => bail!("no raw retry baseline for {other}"),
    }
}

/// The raw baseline of a failure path: [`raw_forward`] for dead letters, [`raw_retry`]
/// for retries.
async fn raw_failure_path(broker: &str, handling: Handling, n: usize) -> anyhow::Result<Rate> {
    if handling == Handling::DeadLetter {
        raw_forward(broker, n).await
    } else {
        raw_retry(broker, n).await
    }
}

async fn raw_consume(broker: &str, n: usize) -> anyhow::Result<Rate> {
    match broker {
        "rabbit" => raw_rabbit::consume(n).await,
        "nats" => raw_nats::consume(n).await,
        "sqs" => raw_sqs::consume(n).await,
        _ => raw_kafka::consume(n, false).await,
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let broker_name = settings::arg("--broker").context("--broker rabbit|nats|kafka")?;
    let n: usize = settings::arg("--messages")
        .map(|v| v.parse())
        .transpose()?
        .unwrap_or(5000);
    let rounds: usize = settings::arg("--rounds")
        .map(|v| v.parse())
        .transpose()?
        .unwrap_or(5);
    let only = settings::arg("--only");
    // `batch`: only the batch-handler consumer and the raw one (for profiling).
    let (do_publish, do_consume) = match only.as_deref() {
        None | Some("failure") => (true, true),
        Some("publish") => (true, false),
        Some("consume" | "batch") => (false, true),
        Some("dead-letter" | "retry") => (false, false),
        Some(other) => {
            bail!("--only publish|consume|batch|failure|dead-letter|retry, not {other}")
        }
    };
    let per_message = only.as_deref() != Some("batch");
    // `failure`: the failure path, beside one round of the raw client's publish and
    // consume (its limit), without reliq's publish and consume rounds.
    let reliq_rounds = only.as_deref() != Some("failure");
    let broker = connect(&broker_name).await?;
    // Fills for the consume rounds: fast on Kafka (see FILL_IN_FLIGHT), as before elsewhere.
    let fill = if broker_name == "kafka" {
        FILL_IN_FLIGHT
    } else {
        IN_FLIGHT
    };
    // warm-up: connections, topology caches
    reliq_consume(&broker, Handling::Each, n.min(500), fill).await?;

    // Rounds alternate which side goes first, so a broker slowing down over the run (a
    // growing log, a GC) weighs on both sides alike.
    let (mut publish, mut consume) = (Series::default(), Series::default());
    let mut batched = Series::default();
    // `dead-letter` and `retry`: a failure path against the raw loop doing its work.
    let mut failure_path = Series::default();
    let failure_handling = match only.as_deref() {
        Some("dead-letter") => Some(Handling::DeadLetter),
        Some("retry") => Some(Handling::RetryOnce),
        _ => None,
    };
    for round in 0..rounds {
        if broker_name == "kafka" {
            raw_kafka::delete_bench_topics().await?;
        }
        let reliq_first = round.is_multiple_of(2);
        let reliq_first = reliq_first && reliq_rounds;
        let reliq_second = !round.is_multiple_of(2) && reliq_rounds;
        if do_publish {
            if reliq_first {
                publish.reliq.push(reliq_publish_fresh(&broker, n).await?);
            }
            publish.raw.push(raw_publish(&broker_name, n).await?);
            if reliq_second {
                publish.reliq.push(reliq_publish_fresh(&broker, n).await?);
            }
        }
        // Reliq first in even rounds, the raw loop first in odd ones.
        if let Some(handling) = failure_handling {
            failure_path
                .measure(
                    round.is_multiple_of(2),
                    reliq_consume(&broker, handling, n, fill),
                    raw_failure_path(&broker_name, handling, n),
                )
                .await?;
        }
        if do_consume {
            if reliq_first && per_message {
                consume
                    .reliq
                    .push(reliq_consume(&broker, Handling::Each, n, fill).await?);
            }
            if reliq_first {
                batched
                    .reliq
                    .push(reliq_consume(&broker, Handling::Batch, n, fill).await?);
            }
            let raw = raw_consume(&broker_name, n).await?;
            consume.raw.push(raw);
            batched.raw.push(raw);
            if broker_name == "kafka" && reliq_rounds {
                let raw = raw_kafka::consume(n, true).await?;
                consume.raw_reading_id.push(raw);
                batched.raw_reading_id.push(raw);
            }
            if reliq_rounds && matches!(broker_name.as_str(), "rabbit" | "nats" | "sqs") {
                let raw = match broker_name.as_str() {
                    "rabbit" => raw_rabbit::consume_fast(n).await?,
                    "nats" => raw_nats::consume_fast(n).await?,
                    _ => raw_sqs::consume_fast(n).await?,
                };
                consume.raw_limit.push(raw);
                batched.raw_limit.push(raw);
            }
            if reliq_second {
                batched
                    .reliq
                    .push(reliq_consume(&broker, Handling::Batch, n, fill).await?);
            }
            if reliq_second && per_message {
                consume
                    .reliq
                    .push(reliq_consume(&broker, Handling::Each, n, fill).await?);
            }
        }
    }
    println!(
        "{broker_name}: {n} messages x {rounds} rounds, {IN_FLIGHT} publishes in flight, prefetch {PREFETCH}, 2 worker threads"
    );
    if do_publish && reliq_rounds {
        println!("{}", publish.line("publish (confirmed):"));
    }
    match failure_handling {
        Some(Handling::DeadLetter) => println!("{}", failure_path.line("dead-letter path:")),
        Some(_) => println!(
            "{}",
            failure_path.line(&format!("retry path ({} ms tier):", RETRY_TIER.as_millis()))
        ),
        None => {}
    }
    if do_consume && reliq_rounds {
        if per_message {
            println!("{}", consume.line("consume (no-op):"));
        }
        println!("{}", batched.line("consume (batch handler):"));
    }
    if broker_name == "kafka" {
        raw_kafka::delete_bench_topics().await?;
    }
    if matches!(only.as_deref(), None | Some("failure")) {
        let failing = n.min(2000);
        let failure = reliq_consume(&broker, Handling::FailOnce, failing, fill).await?;
        let path = failing as f64 / failure.per_sec;
        // What the broker costs this work: per message, one confirmed publish (the retry
        // copy) and two deliveries, at the raw client's median rates of this run, done one
        // step after another (the runtime overlaps them, so it can come in under this).
        let raw_publish = median(&mut publish.raw.iter().map(|r| r.per_sec).collect::<Vec<_>>());
        let raw_consume = median(&mut consume.raw.iter().map(|r| r.per_sec).collect::<Vec<_>>());
        let limit = 1.0 / (1.0 / raw_publish + 2.0 / raw_consume);
        println!(
            "  failure path ({failing} messages, each failing once, retried after the 1 s tier; first delivery -> last success): {path:.2} s = reliq {:.0} msg/s, CPU {:.1} µs/msg\n  {:<20} the raw client doing that work (1 confirmed publish + 2 deliveries per message) at this run's raw rates ({raw_publish:.0} / {raw_consume:.0} msg/s), one step after another: {limit:.0} msg/s, 1 s + {:.2} s = {:.2} s (a pipelined path can beat it)",
            failure.per_sec,
            failure.cpu_us,
            "",
            failing as f64 / limit,
            1.0 + failing as f64 / limit,
        );
    }
    Ok(())
}
