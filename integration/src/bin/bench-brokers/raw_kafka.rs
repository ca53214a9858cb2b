//! The raw Kafka baselines, on rdkafka.

use std::time::{Duration, Instant};

use anyhow::Context;
use futures::StreamExt;
use rdkafka::ClientConfig;
use rdkafka::Message as _;
use rdkafka::consumer::{CommitMode, Consumer as _, StreamConsumer};
use rdkafka::message::{Header, Headers as _, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use reliq_conformance::support::unique;
use reliq_core::MessageId;
use reliq_integration::settings;

use crate::measure::{Rate, cpu_time};
use crate::workload::{forward_loop, payload, publish_window_of, settle_after_fill};
use crate::{FILL_IN_FLIGHT, IN_FLIGHT, RETRY_TIER};

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

fn admin() -> anyhow::Result<rdkafka::admin::AdminClient<rdkafka::client::DefaultClientContext>> {
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
                key: reliq_core::seam::headers::MESSAGE_ID,
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
                    .find(|h| h.key == reliq_core::seam::headers::MESSAGE_ID)
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
                let mut record =
                    FutureRecord::<[u8], [u8]>::to(&dlq).payload(m.payload().unwrap_or_default());
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
