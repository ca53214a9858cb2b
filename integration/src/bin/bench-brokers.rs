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

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Built with `--features mimalloc`: mimalloc for every Rust allocation of both sides
/// (librdkafka's own allocations still use the C library's `malloc`).
#[cfg(feature = "mimalloc")]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use anyhow::{Context, bail, ensure};
use futures::StreamExt;
use futures::stream::FuturesOrdered;
use reliq_conformance::support::unique;
use reliq_core::{
    Batch, BoxError, Broker, Consumer, Delivery, Destination, Message, MessageId, Permanent,
    RetryPolicy, Transient,
};
use reliq_integration::settings;

const IN_FLIGHT: usize = 64;
/// Publishes outstanding while filling a topic for a consume round (Kafka): the fill is
/// not measured, and at [`IN_FLIGHT`] it took most of a round (librdkafka lingers a few
/// milliseconds per batch), which kept the consume rounds too short to measure steadily.
const FILL_IN_FLIGHT: usize = 4096;
const PREFETCH: u32 = 256;

fn payload(i: usize) -> Vec<u8> {
    format!("{{\"n\":{i},\"pad\":\"{}\"}}", "x".repeat(100)).into_bytes()
}

async fn connect(broker: &str) -> anyhow::Result<Arc<dyn Broker>> {
    reliq_integration::connect_by_name(broker).await
}

/// Time `n` confirmed publishes, [`IN_FLIGHT`] outstanding at a time: `publish(i)` is
/// the i-th publish, resolving once the broker confirmed it. Every side of every broker
/// publishes through this, so they differ only in the client calls.
async fn publish_window<F, Fut>(n: usize, publish: F) -> anyhow::Result<Rate>
where
    F: FnMut(usize) -> Fut,
    Fut: Future<Output = anyhow::Result<()>>,
{
    publish_window_of(n, IN_FLIGHT, publish).await
}

/// After a fill, before a timed consume: flush the fill's dirty pages (`sync`), so the
/// kernel's writeback of the broker's log — ~0.6 GB a round at 1 M records — does not
/// land in the middle of the next measurement on one side or the other.
async fn settle_after_fill() -> anyhow::Result<()> {
    let status = tokio::process::Command::new("sync").status().await?;
    ensure!(status.success(), "sync failed: {status}");
    Ok(())
}

/// [`publish_window`] with `window` publishes outstanding.
async fn publish_window_of<F, Fut>(n: usize, window: usize, mut publish: F) -> anyhow::Result<Rate>
where
    F: FnMut(usize) -> Fut,
    Fut: Future<Output = anyhow::Result<()>>,
{
    let (t0, cpu0) = (Instant::now(), cpu_time());
    let mut pending = futures::stream::FuturesUnordered::new();
    for i in 0..n {
        if pending.len() >= window
            && let Some(r) = pending.next().await
        {
            r?;
        }
        pending.push(publish(i));
    }
    while let Some(r) = pending.next().await {
        r?;
    }
    Ok(Rate::since(n, t0, cpu0))
}

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
enum Handling {
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

/// The retry path's tier: short, so the run measures the path rather than the wait.
const RETRY_TIER: Duration = Duration::from_millis(200);

/// `batch_size` of the batch-handler runs: half the prefetch, so a second batch is
/// received while the first is settled.
const BATCH_SIZE: usize = PREFETCH as usize / 2;

/// Declare the consumer's topology, fill it, then time the runtime draining it.
async fn reliq_consume(
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

/// Handler calls per `bucket` since `t0`, by attempt: one line per bucket with any.
fn print_timeline(t0: Instant, bucket: Duration, calls: &[(Instant, u32)]) {
    let mut rows = std::collections::BTreeMap::<u128, [usize; 3]>::new();
    for (at, attempt) in calls {
        let slot = at.duration_since(t0).as_millis() / bucket.as_millis().max(1);
        rows.entry(slot).or_default()[(*attempt as usize).clamp(1, 3) - 1] += 1;
    }
    println!(
        "  timeline ({} ms buckets): from ms: attempt 1, 2, 3+",
        bucket.as_millis()
    );
    for (slot, [a1, a2, a3]) in rows {
        println!(
            "    {:>6}: {a1:>6} {a2:>6} {a3:>6}",
            slot * bucket.as_millis()
        );
    }
}

mod raw_rabbit {
    use super::*;
    use lapin::options::{
        BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
        ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
    };
    use lapin::types::{AMQPValue, FieldTable};
    use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};

    async fn channel() -> anyhow::Result<(Connection, Channel, String)> {
        let conn = Connection::connect(
            &settings::get("RELIQ_RABBIT_URL"),
            ConnectionProperties::default(),
        )
        .await?;
        let ch = conn.create_channel().await?;
        ch.confirm_select(ConfirmSelectOptions::default()).await?;
        let queue = unique("bench-raw");
        let mut args = FieldTable::default();
        args.insert(
            "x-queue-type".into(),
            AMQPValue::LongString("quorum".into()),
        );
        ch.queue_declare(
            queue.as_str().into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            args,
        )
        .await?;
        // Same broker work as reliq's publish: a durable topic exchange routing to the
        // queue, persistent messages carrying a message id (a UUID, as reliq's).
        ch.exchange_declare(
            queue.as_str().into(),
            lapin::ExchangeKind::Topic,
            ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
        ch.queue_bind(
            queue.as_str().into(),
            queue.as_str().into(),
            "#".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
        Ok((conn, ch, queue))
    }

    async fn fill(ch: &Channel, queue: &str, n: usize) -> anyhow::Result<Rate> {
        publish_window(n, |i| async move {
            let confirm = ch
                .basic_publish(
                    queue.into(),
                    "".into(),
                    BasicPublishOptions {
                        mandatory: true,
                        ..Default::default()
                    },
                    &payload(i),
                    BasicProperties::default()
                        .with_delivery_mode(2)
                        .with_message_id(MessageId::generate().as_str().into()),
                )
                .await?;
            ensure!(confirm.await?.is_ack(), "broker nacked a publish");
            Ok(())
        })
        .await
    }

    pub async fn publish(n: usize) -> anyhow::Result<Rate> {
        let (_conn, ch, queue) = channel().await?;
        fill(&ch, &queue, n).await
    }

    /// A queue filled with `n` messages and a consumer on it (prefetch [`PREFETCH`]).
    async fn filled(n: usize) -> anyhow::Result<(Connection, Channel, String, lapin::Consumer)> {
        let (conn, ch, queue) = channel().await?;
        fill(&ch, &queue, n).await?;
        ch.basic_qos(u16::try_from(PREFETCH)?, BasicQosOptions::default())
            .await?;
        let consumer = ch
            .basic_consume(
                queue.as_str().into(),
                "raw".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        Ok((conn, ch, queue, consumer))
    }

    pub async fn consume(n: usize) -> anyhow::Result<Rate> {
        let (_conn, _ch, _, mut consumer) = filled(n).await?;
        let cpu0 = cpu_time();
        let mut t0 = None;
        for _ in 0..n {
            let d = consumer.next().await.context("consumer ended")??;
            t0.get_or_insert_with(Instant::now);
            d.ack(BasicAckOptions::default()).await?;
        }
        let t0 = t0.context("no delivery")?;
        Ok(Rate::since(n, t0, cpu0))
    }

    /// The fastest safe consume lapin allows: each delivery handled, then acknowledged
    /// with one `multiple` ack per 64 deliveries (and the rest at the end) instead of an
    /// awaited ack each — the limit the runtime is measured against, beside the idiom.
    pub async fn consume_fast(n: usize) -> anyhow::Result<Rate> {
        let (_conn, ch, _, mut consumer) = filled(n).await?;
        let cpu0 = cpu_time();
        let mut t0 = None;
        for i in 0..n {
            let d = consumer.next().await.context("consumer ended")??;
            t0.get_or_insert_with(Instant::now);
            std::hint::black_box(&d.data);
            if i % 64 == 63 || i + 1 == n {
                ch.basic_ack(d.delivery_tag, BasicAckOptions { multiple: true })
                    .await?;
            }
        }
        let t0 = t0.context("no delivery")?;
        Ok(Rate::since(n, t0, cpu0))
    }

    /// Declare the durable quorum queue `name` (with `args` besides its type) and open a
    /// channel with publisher confirms to copy deliveries into it.
    async fn target_queue(
        conn: &Connection,
        ch: &Channel,
        name: &str,
        args: Vec<(&str, AMQPValue)>,
    ) -> anyhow::Result<Channel> {
        let mut table = FieldTable::default();
        table.insert(
            "x-queue-type".into(),
            AMQPValue::LongString("quorum".into()),
        );
        for (key, value) in args {
            table.insert(key.into(), value);
        }
        ch.queue_declare(
            name.into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            table,
        )
        .await?;
        let publisher = conn.create_channel().await?;
        publisher
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        Ok(publisher)
    }

    /// Publish `d` (body and properties as they came) to `queue`, mandatory, and wait for
    /// the broker's confirm.
    async fn copy_to(
        publisher: &Channel,
        queue: &str,
        d: &lapin::message::Delivery,
    ) -> anyhow::Result<()> {
        let confirm = publisher
            .basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..Default::default()
                },
                &d.data,
                d.properties.clone(),
            )
            .await?;
        ensure!(confirm.await?.is_ack(), "broker nacked a publish");
        Ok(())
    }

    /// The retry path's broker work, as reliq's RabbitMQ topology does it: each message
    /// consumed, published (confirmed) to a quorum TTL queue of [`RETRY_TIER`] whose
    /// expired messages the broker dead-letters back to the source (at least once), and
    /// acked; delivered again (it now has an `x-death` header), and acked. N messages,
    /// 2N deliveries, timed from the first delivery to the N-th second one acked.
    pub async fn retry(n: usize) -> anyhow::Result<Rate> {
        let (conn, ch, queue, consumer) = filled(n).await?;
        let retry_queue: Arc<str> = format!("{queue}.retry").into();
        let ttl = i64::try_from(RETRY_TIER.as_millis())?;
        let publisher = target_queue(
            &conn,
            &ch,
            &retry_queue,
            vec![
                ("x-dead-letter-exchange", AMQPValue::LongString("".into())),
                (
                    "x-dead-letter-routing-key",
                    AMQPValue::LongString(queue.as_str().into()),
                ),
                ("x-overflow", AMQPValue::LongString("reject-publish".into())),
                (
                    "x-dead-letter-strategy",
                    AMQPValue::LongString("at-least-once".into()),
                ),
                ("x-message-ttl", AMQPValue::LongLongInt(ttl)),
            ],
        )
        .await?;
        let deliveries = consumer.map(|d| d.map_err(anyhow::Error::from));
        let both = forward_loop(
            2 * n,
            deliveries,
            |d: lapin::message::Delivery| {
                let (publisher, retry_queue) = (publisher.clone(), retry_queue.clone());
                async move {
                    let retried = d
                        .properties
                        .headers()
                        .as_ref()
                        .is_some_and(|h| h.inner().keys().any(|k| k.as_str() == "x-death"));
                    if !retried {
                        copy_to(&publisher, &retry_queue, &d).await?;
                    }
                    d.ack(BasicAckOptions::default()).await?;
                    anyhow::Ok(())
                }
            },
            |()| Ok(()),
        )
        .await?;
        Ok(both.per_message_of_two())
    }

    /// The dead-letter path's broker work: each message consumed, published to a second
    /// quorum queue (persistent, mandatory, confirmed), then acked.
    pub async fn forward(n: usize) -> anyhow::Result<Rate> {
        let (conn, ch, queue, consumer) = filled(n).await?;
        let dlq: Arc<str> = format!("{queue}.dlq").into();
        let publisher = target_queue(&conn, &ch, &dlq, Vec::new()).await?;
        let deliveries = consumer.map(|d| d.map_err(anyhow::Error::from));
        forward_loop(
            n,
            deliveries,
            |d: lapin::message::Delivery| {
                let (publisher, dlq) = (publisher.clone(), dlq.clone());
                async move {
                    copy_to(&publisher, &dlq, &d).await?;
                    d.ack(BasicAckOptions::default()).await?;
                    anyhow::Ok(())
                }
            },
            |()| Ok(()),
        )
        .await
    }
}

/// Drive a raw forwarding loop: take the next message while fewer than [`PREFETCH`] are
/// in flight, start its `forward` (publish, confirm, ack), and hand each finished one, in
/// the order received, to `done`; timed from the first message to the n-th finished.
async fn forward_loop<T, C, Fut>(
    n: usize,
    mut messages: impl futures::Stream<Item = anyhow::Result<T>> + Unpin,
    mut forward: impl FnMut(T) -> Fut,
    mut done: impl FnMut(C) -> anyhow::Result<()>,
) -> anyhow::Result<Rate>
where
    Fut: Future<Output = anyhow::Result<C>>,
{
    let cpu0 = cpu_time();
    let (mut received, mut finished, mut t0) = (0usize, 0usize, None);
    let mut in_flight = FuturesOrdered::new();
    while finished < n {
        tokio::select! {
            Some(r) = in_flight.next(), if !in_flight.is_empty() => {
                done(r?)?;
                finished += 1;
            }
            m = messages.next(), if received < n && in_flight.len() < PREFETCH as usize => {
                let m = m.context("the consumer ended")??;
                t0.get_or_insert_with(Instant::now);
                received += 1;
                in_flight.push_back(forward(m));
            }
        }
    }
    Ok(Rate::since(n, t0.context("no delivery")?, cpu0))
}

mod raw_nats {
    use super::*;
    use async_nats::jetstream::{self, consumer::pull, stream};

    async fn stream_with(n_fill: usize) -> anyhow::Result<(jetstream::Context, String, Rate)> {
        let client = async_nats::connect(settings::get("RELIQ_NATS_URL")).await?;
        let js = jetstream::new(client);
        let name = unique("bench-raw");
        js.create_stream(stream::Config {
            name: name.clone(),
            subjects: vec![name.clone()],
            ..Default::default()
        })
        .await?;
        let rate = publish_window(n_fill, |i| {
            let (js, subject) = (js.clone(), name.clone());
            async move {
                // Same server work as reliq's publish: deduplication by message id.
                let mut headers = async_nats::HeaderMap::new();
                headers.insert("Nats-Msg-Id", MessageId::generate().as_str());
                js.publish_with_headers(subject, headers, payload(i).into())
                    .await?
                    .await?;
                Ok(())
            }
        })
        .await?;
        Ok((js, name, rate))
    }

    pub async fn publish(n: usize) -> anyhow::Result<Rate> {
        Ok(stream_with(n).await?.2)
    }

    pub async fn consume(n: usize) -> anyhow::Result<Rate> {
        let (js, name, _) = stream_with(n).await?;
        let mut messages = messages_of(&js, &name).await?;
        let cpu0 = cpu_time();
        let mut t0 = None;
        for _ in 0..n {
            let m = messages.next().await.context("stream ended")??;
            t0.get_or_insert_with(Instant::now);
            m.double_ack().await.map_err(|e| anyhow::anyhow!("{e}"))?;
        }
        let t0 = t0.context("no delivery")?;
        Ok(Rate::since(n, t0, cpu0))
    }

    /// A pull consumer's messages on stream `name` (explicit acks, [`PREFETCH`] pending).
    async fn messages_of(
        js: &jetstream::Context,
        name: &str,
    ) -> anyhow::Result<impl futures::Stream<Item = anyhow::Result<jetstream::Message>> + Unpin>
    {
        let consumer = js
            .get_stream(name)
            .await?
            .create_consumer(pull::Config {
                durable_name: Some("raw".into()),
                ack_policy: jetstream::consumer::AckPolicy::Explicit,
                max_ack_pending: i64::from(PREFETCH),
                ..Default::default()
            })
            .await?;
        Ok(consumer
            .messages()
            .await?
            .map(|m| m.map_err(|e| anyhow::anyhow!("{e}"))))
    }

    /// The fastest safe consume async-nats allows with confirmed acks (reliq's NATS
    /// default): each message handled, its `double_ack` started at once and up to the
    /// prefetch of them awaited together instead of one after another.
    pub async fn consume_fast(n: usize) -> anyhow::Result<Rate> {
        let (js, name, _) = stream_with(n).await?;
        let messages = messages_of(&js, &name).await?;
        forward_loop(
            n,
            messages,
            |m: jetstream::Message| async move {
                std::hint::black_box(&m.payload);
                m.double_ack().await.map_err(|e| anyhow::anyhow!("{e}"))
            },
            |()| Ok(()),
        )
        .await
    }

    /// The retry path's broker work, as reliq's NATS backend does it: each message's
    /// first delivery scheduled again on the server (a `Nats-Schedule: @at` message to a
    /// subject of its own, targeting the stream's due subject; the `PubAck` awaited)
    /// and double-acked; the copy, published by the server when due, double-acked. N
    /// messages, 2N deliveries, timed from the first delivery to the N-th second one.
    pub async fn retry(n: usize) -> anyhow::Result<Rate> {
        let client = async_nats::connect(settings::get("RELIQ_NATS_URL")).await?;
        let js = jetstream::new(client);
        let name = unique("bench-raw");
        let due: Arc<str> = format!("{name}.due").into();
        js.create_stream(stream::Config {
            name: name.clone(),
            subjects: vec![name.clone(), format!("{name}.at.>"), due.to_string()],
            allow_message_schedules: true,
            ..Default::default()
        })
        .await?;
        publish_window(n, |i| {
            let (js, subject) = (js.clone(), name.clone());
            async move {
                let mut headers = async_nats::HeaderMap::new();
                headers.insert("Nats-Msg-Id", MessageId::generate().as_str());
                js.publish_with_headers(subject, headers, payload(i).into())
                    .await?
                    .await?;
                Ok(())
            }
        })
        .await?;
        // Only the source and the due copies: the schedules themselves stay unread.
        let consumer = js
            .get_stream(&name)
            .await?
            .create_consumer(pull::Config {
                durable_name: Some("raw".into()),
                ack_policy: jetstream::consumer::AckPolicy::Explicit,
                max_ack_pending: i64::from(PREFETCH),
                filter_subjects: vec![name.clone(), due.to_string()],
                ..Default::default()
            })
            .await?;
        let messages = consumer
            .messages()
            .await?
            .map(|m| m.map_err(|e| anyhow::anyhow!("{e}")));
        let both = forward_loop(
            2 * n,
            messages,
            |m: jetstream::Message| {
                let (js, due, source) = (js.clone(), due.clone(), name.clone());
                async move {
                    if m.subject.as_str() == source {
                        let seq = m
                            .info()
                            .map_err(|e| anyhow::anyhow!("{e}"))?
                            .stream_sequence;
                        let at = std::time::SystemTime::now() + RETRY_TIER;
                        let mut headers = m.headers.clone().unwrap_or_default();
                        headers.insert(
                            "Nats-Schedule",
                            format!("@at {}", reliq_core::headers::format_time(at)).as_str(),
                        );
                        headers.insert("Nats-Schedule-Target", &*due);
                        headers.insert("Nats-Msg-Id", format!("retry:{seq}").as_str());
                        js.publish_with_headers(
                            format!("{source}.at.{seq}"),
                            headers,
                            m.payload.clone(),
                        )
                        .await?
                        .await?;
                    }
                    m.double_ack().await.map_err(|e| anyhow::anyhow!("{e}"))
                }
            },
            |()| Ok(()),
        )
        .await?;
        Ok(both.per_message_of_two())
    }

    /// The dead-letter path's broker work: each message consumed, published to a second
    /// stream with its headers and a deduplication id (the server's ack awaited), then
    /// acked with the server's confirmation (as reliq's NATS acks are).
    pub async fn forward(n: usize) -> anyhow::Result<Rate> {
        let (js, name, _) = stream_with(n).await?;
        let dlq = format!("{name}-dlq");
        js.create_stream(stream::Config {
            name: dlq.clone(),
            subjects: vec![dlq.clone()],
            ..Default::default()
        })
        .await?;
        let messages = messages_of(&js, &name).await?;
        forward_loop(
            n,
            messages,
            |m: jetstream::Message| {
                let (js, dlq) = (js.clone(), dlq.clone());
                async move {
                    let mut headers = m.headers.clone().unwrap_or_default();
                    headers.insert("Nats-Msg-Id", MessageId::generate().as_str());
                    js.publish_with_headers(dlq, headers, m.payload.clone())
                        .await?
                        .await?;
                    m.double_ack().await.map_err(|e| anyhow::anyhow!("{e}"))?;
                    anyhow::Ok(())
                }
            },
            |()| Ok(()),
        )
        .await
    }
}

mod raw_kafka {
    use super::*;
    use rdkafka::ClientConfig;
    use rdkafka::Message as _;
    use rdkafka::consumer::{CommitMode, Consumer as _, StreamConsumer};
    use rdkafka::message::{Header, Headers as _, OwnedHeaders};
    use rdkafka::producer::{FutureProducer, FutureRecord};

    fn bootstrap() -> String {
        settings::authority(&settings::get("RELIQ_KAFKA_URL")).to_owned()
    }

    /// Partitions of the raw side's topics: the same as the topics reliq creates
    /// (`reliq.partitions`, default 3), so both sides fetch and produce the same shape.
    /// (Auto-created, they had the broker's one partition, whose single fetch stream
    /// capped the raw consumer at ~0.6 M msg/s in some rounds.)
    const PARTITIONS: i32 = 3;

    async fn create(topic: &str) -> anyhow::Result<()> {
        use rdkafka::admin::{AdminOptions, NewTopic, TopicReplication};
        let admin = admin()?;
        let new = NewTopic::new(topic, PARTITIONS, TopicReplication::Fixed(1));
        for result in admin.create_topics([&new], &AdminOptions::new()).await? {
            result.map_err(|(t, e)| anyhow::anyhow!("creating {t}: {e}"))?;
        }
        Ok(())
    }

    fn admin() -> anyhow::Result<rdkafka::admin::AdminClient<rdkafka::client::DefaultClientContext>>
    {
        Ok(ClientConfig::new()
            .set("bootstrap.servers", bootstrap())
            .create()?)
    }

    async fn fill(topic: &str, n: usize, window: usize) -> anyhow::Result<Rate> {
        create(topic).await?;
        let producer: FutureProducer = ClientConfig::new()
            .set("bootstrap.servers", bootstrap())
            .set("acks", "all")
            .set("enable.idempotence", "true")
            .create()?;
        publish_window_of(n, window, |i| {
            let producer = producer.clone();
            async move {
                // The records reliq publishes: a producer-chosen message id in a header
                // (an idempotent consumer needs one; the id is also ~40 % of the record's
                // bytes here, so without it the raw side fetched less).
                let id = MessageId::generate();
                let headers = OwnedHeaders::new_with_capacity(1).insert(Header {
                    key: reliq_core::headers::MESSAGE_ID,
                    value: Some(id.as_str()),
                });
                producer
                    .send(
                        FutureRecord::<(), _>::to(topic)
                            .payload(&payload(i))
                            .headers(headers),
                        Duration::from_secs(30),
                    )
                    .await
                    .map_err(|(e, _)| anyhow::anyhow!("{e}"))?;
                Ok(())
            }
        })
        .await
    }

    pub async fn publish(n: usize) -> anyhow::Result<Rate> {
        fill(&unique("bench-raw"), n, IN_FLIGHT).await
    }

    /// Delete every topic this benchmark made (names starting `bench`, retry and DLQ
    /// topics included). A round of 1 M-record consumes writes ~0.6 GB; left behind, the
    /// broker's log and its GC grow run after run, and the rates drift with them.
    pub async fn delete_bench_topics() -> anyhow::Result<()> {
        use rdkafka::admin::AdminOptions;
        let admin = admin()?;
        let names: Vec<String> = admin
            .inner()
            .fetch_metadata(None, Duration::from_secs(10))?
            .topics()
            .iter()
            .map(|t| t.name().to_owned())
            .filter(|n| n.starts_with("bench"))
            .collect();
        if names.is_empty() {
            return Ok(());
        }
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        for result in admin.delete_topics(&names, &AdminOptions::new()).await? {
            if let Err((topic, e)) = result {
                eprintln!("could not delete {topic}: {e}");
            }
        }
        Ok(())
    }

    /// A consumer of `topic` in a group of its own, committing by hand.
    fn consumer_of(topic: &str) -> anyhow::Result<StreamConsumer> {
        let consumer: StreamConsumer = ClientConfig::new()
            .set("bootstrap.servers", bootstrap())
            .set("group.id", unique("bench-raw-group"))
            .set("enable.auto.commit", "false")
            .set("auto.offset.reset", "earliest")
            // reliq's fetch settings (`KafkaConfig::consumer`), so both sides fetch alike.
            // With librdkafka's default `fetch.queue.backoff.ms` (1 s) a consumer that
            // drains its fetch queue faster than that waits out the back-off: the raw
            // side ran at ~0.4–0.65 M msg/s in some rounds and ~1.6–2.0 M in others.
            .set("fetch.wait.max.ms", "100")
            .set("queued.min.messages", "100000")
            .set("fetch.queue.backoff.ms", "10")
            .set("fetch.error.backoff.ms", "20")
            .set("queued.max.messages.kbytes", "4096")
            .create()?;
        consumer.subscribe(&[topic])?;
        Ok(consumer)
    }

    /// Drain a topic of `n` records like reliq's (each with a message id header),
    /// reading each payload, and each message id when `reads_id`.
    pub async fn consume(n: usize, reads_id: bool) -> anyhow::Result<Rate> {
        let topic = unique("bench-raw");
        fill(&topic, n, FILL_IN_FLIGHT).await?;
        settle_after_fill().await?;
        let consumer = consumer_of(&topic)?;
        let cpu0 = cpu_time();
        let mut first = None;
        for i in 0..n {
            let m = consumer.recv().await?;
            first.get_or_insert_with(Instant::now);
            // What a handler gets: the payload (reliq's handler is handed it too).
            std::hint::black_box(m.payload());
            if reads_id {
                // ... and, like reliq's handler, the message id. librdkafka parses a
                // record's headers on first access: this is that parse.
                let id = m.headers().and_then(|h| {
                    h.iter()
                        .find(|h| h.key == reliq_core::headers::MESSAGE_ID)
                        .and_then(|h| h.value)
                        .map(|v| MessageId::from(String::from_utf8_lossy(v).as_ref()))
                });
                std::hint::black_box(id);
            }
            // Manual commits, asynchronous, every 100 records and at the end.
            if i % 100 == 99 || i + 1 == n {
                consumer.commit_message(&m, CommitMode::Async)?;
            }
        }
        let t0 = first.context("no record")?;
        Ok(Rate::since(n, t0, cpu0))
    }

    /// The dead-letter path's broker work: each record consumed, produced to a second
    /// topic with its key and headers (acks=all, idempotent, the delivery report
    /// awaited), and its offset committed (asynchronously, every 100 records) only once
    /// it and every record before it are produced.
    pub async fn forward(n: usize) -> anyhow::Result<Rate> {
        forward_then(n, None).await
    }

    /// The retry path's broker work as reliq's Kafka backend does it: [`forward`]'s loop
    /// to a retry topic while a relay — a second consumer, in its own group — reads the
    /// retry topic and holds each record until its timestamp plus the tier, then handles
    /// it (commits every 100). Timed from the first source delivery to the n-th record
    /// handled after its tier.
    pub async fn retry(n: usize) -> anyhow::Result<Rate> {
        forward_then(n, Some(RETRY_TIER)).await
    }

    /// [`forward`], and with `relay_after` the relay of [`retry`] on the second topic.
    async fn forward_then(n: usize, relay_after: Option<Duration>) -> anyhow::Result<Rate> {
        use rdkafka::TopicPartitionList;
        use rdkafka::message::OwnedMessage;
        let topic = unique("bench-raw");
        fill(&topic, n, FILL_IN_FLIGHT).await?;
        let dlq = format!("{topic}-dlq");
        create(&dlq).await?;
        settle_after_fill().await?;
        let producer: FutureProducer = ClientConfig::new()
            .set("bootstrap.servers", bootstrap())
            .set("acks", "all")
            .set("enable.idempotence", "true")
            .create()?;
        let cpu0 = cpu_time();
        let relay = match relay_after {
            Some(tier) => Some(tokio::spawn(relay(consumer_of(&dlq)?, n, tier))),
            None => None,
        };
        let consumer = consumer_of(&topic)?;
        let first = std::sync::OnceLock::new();
        let records = consumer.stream().map(|m| {
            first.get_or_init(Instant::now);
            m.map(|m| m.detach()).map_err(anyhow::Error::from)
        });
        // Per partition, the offset after the last record produced in order.
        let mut produced = std::collections::BTreeMap::<i32, i64>::new();
        let commit = |produced: &std::collections::BTreeMap<i32, i64>| -> anyhow::Result<()> {
            let mut tpl = TopicPartitionList::new();
            for (partition, next) in produced {
                tpl.add_partition_offset(&topic, *partition, rdkafka::Offset::Offset(*next))?;
            }
            consumer.commit(&tpl, CommitMode::Async)?;
            Ok(())
        };
        let mut since_commit = 0;
        let rate = forward_loop(
            n,
            records,
            |m: OwnedMessage| {
                let (producer, dlq) = (producer.clone(), dlq.clone());
                async move {
                    let mut record = FutureRecord::<[u8], [u8]>::to(&dlq)
                        .payload(m.payload().unwrap_or_default());
                    if let Some(key) = m.key() {
                        record = record.key(key);
                    }
                    if let Some(headers) = m.headers() {
                        record = record.headers(headers.clone());
                    }
                    producer
                        .send(record, Duration::from_secs(30))
                        .await
                        .map_err(|(e, _)| anyhow::anyhow!("{e}"))?;
                    anyhow::Ok((m.partition(), m.offset()))
                }
            },
            |(partition, offset)| {
                produced.insert(partition, offset + 1);
                since_commit += 1;
                if since_commit == 100 {
                    commit(&produced)?;
                    since_commit = 0;
                }
                Ok(())
            },
        )
        .await?;
        commit(&produced)?;
        let Some(relay) = relay else {
            return Ok(rate);
        };
        let handled = relay.await??;
        let t0 = *first.get().context("no delivery")?;
        Ok(Rate {
            per_sec: n as f64 / handled.duration_since(t0).as_secs_f64(),
            cpu_us: (cpu_time() - cpu0).as_secs_f64() * 1e6 / n as f64,
        })
    }

    /// Read `n` records of a retry topic, each handled (its payload read) once its
    /// timestamp plus `tier` has passed, committing every 100; returns when the n-th was.
    async fn relay(consumer: StreamConsumer, n: usize, tier: Duration) -> anyhow::Result<Instant> {
        use std::time::{SystemTime, UNIX_EPOCH};
        for i in 0..n {
            let m = consumer.recv().await?;
            let written = m
                .timestamp()
                .to_millis()
                .context("a record without a timestamp")?;
            let due = UNIX_EPOCH + Duration::from_millis(u64::try_from(written)?) + tier;
            if let Ok(wait) = due.duration_since(SystemTime::now()) {
                tokio::time::sleep(wait).await;
            }
            std::hint::black_box(m.payload());
            if i % 100 == 99 || i + 1 == n {
                consumer.commit_message(&m, CommitMode::Async)?;
            }
        }
        Ok(Instant::now())
    }
}

/// One side's measurement: messages per second (wall clock) and the process's CPU time
/// per message (user + system, every thread — the client library's I/O threads too).
/// The CPU figure is the steadier one on a shared machine: it does not depend on how
/// long the broker took to answer.
#[derive(Clone, Copy, Debug)]
struct Rate {
    per_sec: f64,
    cpu_us: f64,
}

impl Rate {
    /// The rate of messages handled in two deliveries each, from the rate of deliveries.
    fn per_message_of_two(self) -> Self {
        Self {
            per_sec: self.per_sec / 2.0,
            cpu_us: self.cpu_us * 2.0,
        }
    }

    /// `n` messages from `t0` (wall) and `cpu0` (CPU) to now.
    fn since(n: usize, t0: Instant, cpu0: Duration) -> Self {
        Self {
            per_sec: n as f64 / t0.elapsed().as_secs_f64(),
            cpu_us: (cpu_time() - cpu0).as_secs_f64() * 1e6 / n as f64,
        }
    }
}

/// CPU time (user + system) this process has used so far.
/// CPU time per thread of this process so far (`/proc/self/task/*/schedstat`), keyed by
/// thread id, with the thread's name: with `--timeline-ms`, which threads spent a
/// round's CPU.
fn thread_cpu() -> std::collections::BTreeMap<u64, (String, Duration)> {
    let mut threads = std::collections::BTreeMap::new();
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return threads;
    };
    for task in tasks.flatten() {
        let Some(tid) = task.file_name().to_str().and_then(|t| t.parse().ok()) else {
            continue;
        };
        let read = |file: &str| std::fs::read_to_string(task.path().join(file)).ok();
        let ran = read("schedstat")
            .and_then(|s| s.split_whitespace().next()?.parse().ok())
            .map(Duration::from_nanos);
        if let (Some(name), Some(ran)) = (read("comm"), ran) {
            threads.insert(tid, (name.trim().to_owned(), ran));
        }
    }
    threads
}

/// The threads that ran between two [`thread_cpu`] readings, most CPU first, grouped by
/// name (with how many threads of that name ran).
fn print_thread_cpu(before: &std::collections::BTreeMap<u64, (String, Duration)>, n: usize) {
    let mut by_name = std::collections::BTreeMap::<String, (Duration, usize)>::new();
    for (tid, (name, ran)) in thread_cpu() {
        let start = before.get(&tid).map_or(Duration::ZERO, |(_, r)| *r);
        let spent = ran.saturating_sub(start);
        if !spent.is_zero() {
            let entry = by_name.entry(name).or_default();
            entry.0 += spent;
            entry.1 += 1;
        }
    }
    let mut rows: Vec<_> = by_name.into_iter().collect();
    rows.sort_by_key(|(_, (spent, _))| std::cmp::Reverse(*spent));
    println!("  CPU per message by thread name (threads):");
    for (name, (spent, count)) in rows {
        println!(
            "    {name:<20} {:>6.1} µs ({count})",
            spent.as_secs_f64() * 1e6 / n as f64
        );
    }
}

fn cpu_time() -> Duration {
    // SAFETY: `getrusage` only writes the struct it is given.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut usage);
        usage
    };
    let micros = |t: libc::timeval| {
        Duration::from_secs(u64::try_from(t.tv_sec).unwrap_or(0))
            + Duration::from_micros(u64::try_from(t.tv_usec).unwrap_or(0))
    };
    micros(usage.ru_utime) + micros(usage.ru_stime)
}

/// The median of `xs` (sorted in place).
fn median(xs: &mut [f64]) -> f64 {
    xs.sort_by(f64::total_cmp);
    let mid = xs.len() / 2;
    if xs.len().is_multiple_of(2) {
        (xs[mid - 1] + xs[mid]) / 2.0
    } else {
        xs[mid]
    }
}

/// One measurement per side and round; reported as median (min–max).
#[derive(Default)]
struct Series {
    reliq: Vec<Rate>,
    raw: Vec<Rate>,
    /// Kafka: the raw consumer that also reads each record's message id (see
    /// `raw_kafka::consume`), reported on a second line.
    raw_reading_id: Vec<Rate>,
    /// RabbitMQ, NATS and SQS: the fastest safe raw consume (`consume_fast`), beside the
    /// plain idiom: "vs the limit".
    raw_limit: Vec<Rate>,
}

impl Series {
    /// One round of both sides, in the order given.
    async fn measure(
        &mut self,
        reliq_first: bool,
        reliq: impl Future<Output = anyhow::Result<Rate>>,
        raw: impl Future<Output = anyhow::Result<Rate>>,
    ) -> anyhow::Result<()> {
        if reliq_first {
            self.reliq.push(reliq.await?);
            self.raw.push(raw.await?);
        } else {
            self.raw.push(raw.await?);
            self.reliq.push(reliq.await?);
        }
        Ok(())
    }

    fn line(&self, what: &str) -> String {
        let range = |xs: &[f64]| {
            let (lo, hi) = xs
                .iter()
                .fold((f64::MAX, 0.0f64), |(lo, hi), x| (lo.min(*x), hi.max(*x)));
            format!("{lo:.0}–{hi:.0}")
        };
        let rates = |side: &[Rate]| side.iter().map(|r| r.per_sec).collect::<Vec<_>>();
        let cpus = |side: &[Rate]| side.iter().map(|r| r.cpu_us).collect::<Vec<_>>();
        let (mut reliq, mut raw) = (rates(&self.reliq), rates(&self.raw));
        let (mut reliq_cpu, mut raw_cpu) = (cpus(&self.reliq), cpus(&self.raw));
        let (reliq_median, raw_median) = (median(&mut reliq), median(&mut raw));
        let reliq_cpu = median(&mut reliq_cpu);
        let mut line = format!(
            "  {what:<20} reliq {:>9.0} msg/s ({}) | raw {:>9.0} msg/s ({}) | ratio of medians {:.2}\n  {:<20} CPU per message: reliq {:.1} µs | raw {:.1} µs (medians)",
            reliq_median,
            range(&reliq),
            raw_median,
            range(&raw),
            reliq_median / raw_median,
            "",
            reliq_cpu,
            median(&mut raw_cpu),
        );
        // The second raw consumers, each beside the same reliq median.
        for (what, side) in [
            ("raw, fastest safe loop", &self.raw_limit),
            ("raw reading the id", &self.raw_reading_id),
        ] {
            if side.is_empty() {
                continue;
            }
            let mut other = rates(side);
            let other_median = median(&mut other);
            line += &format!(
                "\n  {:<20} {what} {:>9.0} msg/s ({}) | ratio of medians {:.2} | CPU {:.1} µs",
                "",
                other_median,
                range(&other),
                reliq_median / other_median,
                median(&mut cpus(side)),
            );
        }
        line
    }
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

/// The plain aws-sdk-sqs idiom, on the same client stack reliq uses.
mod raw_sqs {
    use super::*;
    use aws_sdk_sqs::types::{
        DeleteMessageBatchRequestEntry, Message, SendMessageBatchRequestEntry,
    };

    async fn queue() -> anyhow::Result<(aws_sdk_sqs::Client, String)> {
        let broker = reliq_sqs::SqsBroker::connect(&settings::get("RELIQ_SQS_URL")).await?;
        let client = broker.client().clone();
        let out = client
            .create_queue()
            .queue_name(unique("raw-bench"))
            .send()
            .await?;
        let url = out.queue_url().context("no queue url")?.to_owned();
        Ok((client, url))
    }

    /// `SendMessage` per message, 64 in flight (reliq batches what arrives together).
    pub async fn publish(n: usize) -> anyhow::Result<Rate> {
        let (client, url) = queue().await?;
        publish_window(n, |i| {
            let send = client.send_message().queue_url(&url);
            async move {
                send.message_body(String::from_utf8(payload(i))?)
                    .send()
                    .await?;
                Ok(())
            }
        })
        .await
    }

    /// Fill a queue with `n` messages, `SendMessageBatch` by 10.
    async fn fill(client: &aws_sdk_sqs::Client, url: &str, n: usize) -> anyhow::Result<()> {
        for chunk in (0..n).collect::<Vec<_>>().chunks(10) {
            let mut batch = client.send_message_batch().queue_url(url);
            for i in chunk {
                batch = batch.entries(
                    SendMessageBatchRequestEntry::builder()
                        .id(i.to_string())
                        .message_body(String::from_utf8(payload(*i))?)
                        .build()?,
                );
            }
            batch.send().await?;
        }
        Ok(())
    }

    /// Fill with `SendMessageBatch`, then a receive (10, long poll) / `DeleteMessageBatch`
    /// loop, timed from the first receive that returns messages.
    pub async fn consume(n: usize) -> anyhow::Result<Rate> {
        let (client, url) = queue().await?;
        fill(&client, &url, n).await?;
        let mut done = 0;
        let cpu0 = cpu_time();
        let mut t0 = None;
        while done < n {
            let out = client
                .receive_message()
                .queue_url(&url)
                .max_number_of_messages(10)
                .wait_time_seconds(1)
                .send()
                .await?;
            let messages = out.messages();
            if messages.is_empty() {
                continue;
            }
            t0.get_or_insert_with(Instant::now);
            delete(&client, &url, messages).await?;
            done += messages.len();
        }
        let t0 = t0.context("no delivery")?;
        Ok(Rate::since(n, t0, cpu0))
    }

    /// The fastest safe consume: [`receive_and_settle`]'s loop, each batch deleted
    /// (`DeleteMessageBatch`) while the next is received, up to the prefetch.
    pub async fn consume_fast(n: usize) -> anyhow::Result<Rate> {
        let (client, _) = queue().await?;
        receive_and_settle(n, n, move |url, messages| {
            let client = client.clone();
            Box::pin(async move {
                delete(&client, &url, &messages).await?;
                Ok(messages.len())
            })
        })
        .await
    }

    /// `DeleteMessageBatch` of `messages` (at most 10), every entry confirmed.
    async fn delete(
        client: &aws_sdk_sqs::Client,
        url: &str,
        messages: &[Message],
    ) -> anyhow::Result<()> {
        let mut delete = client.delete_message_batch().queue_url(url);
        for (i, m) in messages.iter().enumerate() {
            delete = delete.entries(
                DeleteMessageBatchRequestEntry::builder()
                    .id(i.to_string())
                    .receipt_handle(m.receipt_handle().context("no receipt")?)
                    .build()?,
            );
        }
        let out = delete.send().await?;
        ensure!(
            out.failed().is_empty(),
            "deletes failed: {:?}",
            out.failed()
        );
        Ok(())
    }

    /// The dead-letter path's broker work: each received batch copied to a second queue
    /// (`SendMessageBatch`, every entry confirmed), then deleted.
    pub async fn forward(n: usize) -> anyhow::Result<Rate> {
        let (client, dlq) = queue().await?;
        receive_and_settle(n, n, move |url, messages| {
            let (client, dlq) = (client.clone(), dlq.clone());
            Box::pin(async move {
                let mut copy = client.send_message_batch().queue_url(&dlq);
                for (i, m) in messages.iter().enumerate() {
                    copy = copy.entries(
                        SendMessageBatchRequestEntry::builder()
                            .id(i.to_string())
                            .message_body(m.body().unwrap_or_default())
                            .build()?,
                    );
                }
                let out = copy.send().await?;
                ensure!(out.failed().is_empty(), "copies failed: {:?}", out.failed());
                delete(&client, &url, &messages).await?;
                Ok(messages.len())
            })
        })
        .await
    }

    /// The retry path's broker work as reliq's SQS backend does it: a message's first
    /// receipt made visible again after the tier (`ChangeMessageVisibilityBatch`, 1 s —
    /// SQS counts whole seconds, and reliq rounds its 200 ms tier up to one), its second
    /// receipt deleted.
    pub async fn retry(n: usize) -> anyhow::Result<Rate> {
        use aws_sdk_sqs::types::ChangeMessageVisibilityBatchRequestEntry;
        let seen = Arc::new(std::sync::Mutex::new(std::collections::HashSet::new()));
        let (client, _) = queue().await?;
        receive_and_settle(n, 2 * n, move |url, messages| {
            let (client, seen) = (client.clone(), seen.clone());
            Box::pin(async move {
                let (again, first): (Vec<Message>, Vec<Message>) = {
                    let mut seen = seen.lock().map_err(|_| anyhow::anyhow!("poisoned"))?;
                    messages
                        .into_iter()
                        .partition(|m| !seen.insert(m.message_id().unwrap_or_default().to_owned()))
                };
                if !first.is_empty() {
                    let mut hide = client.change_message_visibility_batch().queue_url(&url);
                    for (i, m) in first.iter().enumerate() {
                        hide = hide.entries(
                            ChangeMessageVisibilityBatchRequestEntry::builder()
                                .id(i.to_string())
                                .receipt_handle(m.receipt_handle().context("no receipt")?)
                                .visibility_timeout(1)
                                .build()?,
                        );
                    }
                    let out = hide.send().await?;
                    ensure!(
                        out.failed().is_empty(),
                        "visibility changes failed: {:?}",
                        out.failed()
                    );
                }
                if !again.is_empty() {
                    delete(&client, &url, &again).await?;
                }
                Ok(again.len())
            })
        })
        .await
    }

    /// A pipelined receive loop on a queue filled with `n`: receives (10 at a time, long
    /// poll) one after another until `receipts` messages are received, each batch settled
    /// by `settle` while the next is received — up to [`PREFETCH`] messages in flight, as reliq's
    /// receiver holds them. `settle` returns how many of its messages are finished. Timed
    /// from the first receive that returns messages to the n-th finished.
    async fn receive_and_settle(
        n: usize,
        receipts: usize,
        settle: impl Fn(
            String,
            Vec<Message>,
        ) -> futures::future::BoxFuture<'static, anyhow::Result<usize>>,
    ) -> anyhow::Result<Rate> {
        use futures::FutureExt;
        let (client, url) = queue().await?;
        fill(&client, &url, n).await?;
        let cpu0 = cpu_time();
        let (mut t0, mut finished, mut held, mut received) = (None, 0usize, 0usize, 0usize);
        let mut in_flight = futures::stream::FuturesUnordered::new();
        while finished < n {
            if held + 10 > PREFETCH as usize || received >= receipts {
                if let Some((count, done)) = in_flight.next().await {
                    (held, finished) = (held - count, finished + done?);
                }
                continue;
            }
            // Never a receive raced against a settlement: a receive dropped mid-poll
            // would leave its messages invisible for the queue's visibility timeout.
            while let Some(Some((count, done))) = in_flight.next().now_or_never() {
                (held, finished) = (held - count, finished + done?);
            }
            let out = client
                .receive_message()
                .queue_url(&url)
                .max_number_of_messages(10)
                .wait_time_seconds(1)
                .send()
                .await?;
            let messages = out.messages().to_vec();
            if messages.is_empty() {
                continue;
            }
            t0.get_or_insert_with(Instant::now);
            let count = messages.len();
            (held, received) = (held + count, received + count);
            in_flight.push(settle(url.clone(), messages).map(move |done| (count, done)));
        }
        let t0 = t0.context("no delivery")?;
        Ok(Rate::since(n, t0, cpu0))
    }
}

/// reliq's confirmed publish into a fresh topology (a bound consumer queue).
async fn reliq_publish_fresh(broker: &Arc<dyn Broker>, n: usize) -> anyhow::Result<Rate> {
    let topic = unique("bench-pub");
    let builder = Consumer::builder(broker.clone(), "sink").subscribe(topic.clone());
    drop(broker.subscribe(&builder.subscription()?).await?);
    reliq_publish(broker, &topic, n).await
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
