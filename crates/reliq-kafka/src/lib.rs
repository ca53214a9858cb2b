//! # reliq-kafka
//!
//! The Apache Kafka backend of reliq, on [rdkafka](https://docs.rs/rdkafka) with a
//! bundled, statically linked librdkafka. It is a thin mapping of reliq's broker seam
//! ([`reliq_core::Broker`] / [`reliq_core::seam::Receiver`]) onto Kafka's own mechanisms; the
//! consumer runtime (classification, retry decisions, dead-letter records, metrics) stays
//! in `reliq-core`.
//!
//! ## The mapping
//!
//! | reliq | Kafka |
//! |---|---|
//! | `publish` | produce with `acks=all`, `enable.idempotence=true`; returns after the delivery report. The message id travels in the `reliq-id` record header, the key is the record key, every reliq header is a record header. The producer buffer is bounded (`queue.buffering.max.messages`) with a [`BufferPolicy`]: block up to a timeout, or fail fast. |
//! | `subscribe` | creates (admin API, idempotently) the source, one retry topic per tier `<topic>.<group>.retry.<ms>ms`, the DLQ `<topic>.<group>.dlq` and its removal ledger `<topic>.<group>.dlq.removed`; joins consumer group `<group>` on the source and one **relay** group `<group>.retry.<ms>ms` per tier. It also finds, by metadata, this consumer's retry topics the current policy has no tier for (`<topic>.<group>.retry.<ms>ms`, left by an earlier policy) whose relay group has not consumed all their records, logs each (info: topic and lag) and runs a relay for it too, with that tier's delay, so a redeploy with another policy strands no waiting retry (not in blocking mode). |
//! | `receive` / `receive_batch` | one poll thread per Kafka consumer hands records to one bounded stream, in chunks: a poll pass serves the consumer's events (rebalances, errors, commit results) through rdkafka's `poll`, then takes up to 256 records in one `rd_kafka_consume_batch_queue` call from a queue of the consumer's own, to which its partitions' fetched records are routed (before each assignment starts their fetch, and again every 100 ms), tracks their offsets under one lock and sends them as one chunk (one wake-up), **undecoded**: each becomes a delivery whose payload and key are read in place and whose message (id, headers — librdkafka parses a record's headers only when asked, and that parse was most of a record's cost) is decoded when something first reads it, on that thread ([`reliq_core::seam::RawMessage`]); the single poll thread does no more per record than polling and tracking. A delivery holds librdkafka's record, and with it the record's consumer, until it is dropped: a stopping poll thread *closes* its consumer (final commit, group leave — nothing waits for deliveries), and the last record *destroys* it. A handler that keeps deliveries after handling them keeps their fetch buffers too. The runtime takes up to its free in-flight room per receive. librdkafka fetches ahead while its queue holds under `queued.min.messages` (100,000) records, bounded by `queued.max.messages.kbytes` (4 MiB). While that buffer is full (4 × [`Subscription::prefetch`](reliq_core::Subscription)) the thread stops taking records, which wait in librdkafka's bounded fetch queue, until the runtime takes some; a buffer full for over a second **pauses** every partition, so the thread goes back to serving rebalances, and resumes them when a quarter is left. |
//! | `ack` / `ack_batch` | marks the offset(s) done in a per-partition offset tracker (one lock for a batch); the poll thread commits the **highest contiguous done position** (never past an unfinished record), asynchronously, at most every 2 ms. |
//! | `retry` (blocking, `reliq.retry=blocking`) | see [`RetryMode::Blocking`]: one record per partition at a time; the failed record is held, its partition paused and sought back to the record after it, and the record handed out again after the policy's delay; no retry topics. |
//! | `retry` (default) | produces the copy (headers carry `reliq-attempt`) to the tier's topic, waits for the delivery report, **then** marks the source offset done. The tier's relay reads its partitions ahead and holds each record until it is due (record timestamp + tier delay), on a timer in its poll loop, then hands it to the same stream; settling it commits on the retry topic. At 1,024 records or 16 MiB not yet due in a partition the relay stops taking records (they wait in librdkafka's bounded fetch queue) until every partition is down to half; only when that lasts 1 s are the partitions at the bound paused (and resumed at half), so the poll loop keeps serving the group. A pause discards librdkafka's fetched records, and a resumed partition fetched nothing for ~0.7 s: a pause at every held record made each one behind it late by that refetch (p99 0.85 s on a 2 s tier, now 19 ms), and a pause at the bound cost 20,000 retries on a 200 ms tier 0.6–0.7 s per run. |
//! | `dead_letter` | produces to `<topic>.<group>.dlq`, waits for the report, then marks the source done. The record carries the dead-letter record plus original topic, partition and offset. |
//! | `release` | the offset stays uncommitted; the same record is handed out again after the delay (in this process), or by the next owner of the partition. |
//! | delivery limit | the framework's own counter, kept durably in the **commit metadata** of the partition's committed position (see below). |
//! | `dead_letters` | a reader of the DLQ topic by offset. **browse**: a consumer of the reader's own is *assigned* the DLQ's partitions at the cursor's offsets (its group `<group>.dlq-browse` is never joined, nothing is committed) and reads up to the high watermarks taken when the page starts — up to `max` entries of each partition, merged oldest first (record timestamp, partition, offset), so a cursor always gives the same page; the cursor is each partition's next offset (`0:17,1:4,2:0`). **remove** (Kafka cannot delete one record): one record per entry, key `<partition>:<offset>`, value the message id, to the compacted **removal ledger** `<dlq>.removed` (one partition), confirmed (`acks=all`) before it returns; browse, get and count skip what the ledger names. Then each partition's prefix of removed entries is cut off with the admin **DeleteRecords** API, and only after the broker confirmed the new low watermark are the ledger's keys below it tombstoned, so neither topic grows with removals. **count**: the watermark spans minus the ledger's entries inside them (no read of the DLQ), the oldest `reliq-dead-lettered-at` from each partition's first live entry. **get** / **remove** find ids in an index the reader builds as it reads (each record read once per reader). The DLQ topic is created without a retention limit (`retention.ms=-1`): a dead letter leaves only through `remove`. |
//! | `backlog` | `waiting`: the group's lag on the source (end offset − committed, summed over partitions; a partition never committed counts from its low watermark — records received and not yet committed are in it); each tier's retries: its relay group's lag on its retry topic; no in-flight count. Read without joining a group (a short-lived consumer reads the committed offsets and watermarks). Blocking mode: no retry count (a retry waits in the process). |
//! | `plan` / `inspect` | the source, retry, DLQ and ledger topics (replication factor, the tiers' `retention.ms` ≥ their delay and `cleanup.policy=delete`, the DLQ's unlimited retention, the ledger's compaction; partitions cosmetic), read with the metadata and `DescribeConfigs` (each value with its config source); the consumer and relay groups (`DescribeGroups`); retry topics of earlier policies with their relay group's lag as extra objects |
//! | `send_to_consumer` | produces to this consumer's first retry topic, marked due at once (replay reaches this group only). |
//! | cluster, node loss | `kafka://h1:9092,h2:9092,h3:9092?reliq.replication=3` (bootstrap servers; `reliq.replication` for the topics reliq creates — with `min.insync.replicas` 2 on the brokers, the confirmed publishes of `acks=all` survive a node). librdkafka follows partition leadership to the surviving replicas; the idempotent producer retries in flight without duplicates; a consumer whose group coordinator died rejoins through the new one (uncommitted records are read again; the inbox absorbs a repeated effect). The DLQ reader (browse, count) reads through a lost node and a leader election (within its 10 s / 30 s bounds). Tested by `just chaos` (the source partition's leader SIGKILLed mid-run, the DLQ refusing records for 30 s, the consumer's connections stalled for 10 s). |
//!
//! Retry and DLQ copies go through a second producer with `allow.auto.create.topics=false`
//! after a metadata check that the topic exists, so a deleted retry or DLQ topic makes
//! `retry` / `dead_letter` fail (the source stays uncommitted) instead of silently
//! auto-creating a topic nobody reads.
//!
//! ## Example
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use std::{sync::Arc, time::Duration};
//! use reliq_core::{BoxError, Broker, Consumer, Delivery, Destination, Message, RetryPolicy};
//! use reliq_kafka::KafkaBroker;
//!
//! let broker = Arc::new(KafkaBroker::connect("kafka://127.0.0.1:9092")?);
//! broker.publish(&Destination::new("orders"), Message::new("hello").with_key("c-7")).await?;
//! let consumer = Consumer::builder(broker, "billing")          // the consumer group
//!     .subscribe("orders")
//!     .retry(RetryPolicy::tiers([Duration::from_secs(5), Duration::from_secs(30)]))
//!     .start(|d: Delivery| async move { d.text()?; Ok::<(), BoxError>(()) })
//!     .await?;
//! # consumer.shutdown().await; Ok(()) }
//! ```
//!
//! ## Rebalances
//!
//! On revoke, records of the revoked partitions still queued are not handed out any
//! more; the poll thread waits (up to `reliq.rebalance.drain.ms`) for the ones in the
//! runtime to settle, then commits synchronously what is done. A record still in flight
//! when the wait ends is processed again by the new owner (at-least-once); its late
//! settlement here is ignored (no double commit).
//!
//! ## The crash-loop counter (delivery limit)
//!
//! Kafka has no delivery count. When a partition is assigned, the first record handed
//! out is the one at the committed position — the record a crashed process was holding.
//! Before handing it out, the backend commits that same position with metadata
//! `reliq-deliveries:<offset>:<n>` (synchronously), so the count survives crashes. When
//! `n` exceeds [`Subscription::delivery_limit`](reliq_core::Subscription), the record is
//! produced to the DLQ with reason `max-deliveries` and committed past. Limits, stated
//! honestly: only the head record of each partition is counted (the one a crash loop
//! keeps hitting); a record that crashes the process while a record before it in the same
//! partition is unfinished is counted once it becomes the head; in-process redeliveries
//! (`release`) are not counted (the runtime's own retry budget covers them).
//!
//! ## Capabilities
//!
//! - `rejects_unroutable = false`: brokers with `auto.create.topics.enable=true` (the
//!   default) create a topic on first publish, so publishing to a new topic succeeds.
//! - `exact_retry_delay = false`: a retry waits for its tier's delay (the policy's
//!   schedule picks the tier), not for a per-message delay with jitter; `true` in
//!   blocking mode (the record waits in this process for exactly the policy's delay).
//! - `delivery_limit = true`: the framework counter above.
//! - `consumer_redelivery = true` when the consumer has at least one retry tier; `false`
//!   in blocking mode (no per-consumer topic: replay to the source topic instead).
//!
//! Settings come from the URL, see [`KafkaConfig`].

mod backlog;
mod broker;
mod client;
mod codec;
mod dead_letters;
mod error;
#[cfg(feature = "msk-iam")]
mod msk_iam;
#[cfg(not(feature = "msk-iam"))]
#[path = "msk_iam_off.rs"]
mod msk_iam;
mod names;
mod oauth;
mod options;
mod permissions;
mod receiver;
mod refusals;
mod routes;
mod stale_tiers;
mod topology;

pub use client::KafkaBroker;
pub use codec::{DUE_AT_HEADER, SOURCE_OFFSET_HEADER, SOURCE_PARTITION_HEADER};
pub use error::KafkaError;
pub use options::{BufferPolicy, DEFAULT_SESSION_TIMEOUT, KafkaConfig, MskIamSettings, RetryMode};

/// The URL schemes this backend serves (`reliq::connect` dispatches on them).
pub const SCHEMES: &[&str] = &["kafka"];

/// Connect to the cluster a `kafka://` URL names (lazily: librdkafka connects on first
/// use), as a [`reliq_core::Broker`].
pub async fn connect(
    url: &str,
) -> Result<std::sync::Arc<dyn reliq_core::Broker>, reliq_core::BrokerError> {
    Ok(std::sync::Arc::new(KafkaBroker::connect(url)?))
}
