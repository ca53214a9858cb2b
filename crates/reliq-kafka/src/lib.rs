//! # reliq-kafka
//!
//! The Apache Kafka backend of reliq, on [rdkafka](https://docs.rs/rdkafka) with a
//! bundled, statically linked librdkafka. It is a thin mapping of reliq's broker seam
//! ([`reliq_core::Broker`] / [`reliq_core::Receiver`]) onto Kafka's own mechanisms; the
//! consumer runtime (classification, retry decisions, dead-letter records, metrics) stays
//! in `reliq-core`.
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
//!     .subscribe("orders", None::<String>)
//!     .retry(RetryPolicy::tiers([Duration::from_secs(5), Duration::from_secs(30)]))
//!     .start(|d: Delivery| async move { d.text()?; Ok::<(), BoxError>(()) })
//!     .await?;
//! # consumer.shutdown().await; Ok(()) }
//! ```
//!
//! ## The mapping
//!
//! | reliq | Kafka |
//! |---|---|
//! | `publish` | produce with `acks=all`, `enable.idempotence=true`; returns after the delivery report. The message id travels in the `reliq-id` record header, the key is the record key, every reliq header is a record header. The producer buffer is bounded (`queue.buffering.max.messages`) with a [`BufferPolicy`]: block up to a timeout, or fail fast. |
//! | `subscribe` | creates (admin API, idempotently) the source, one retry topic per tier `<topic>.<group>.retry.<ms>ms`, the DLQ `<topic>.<group>.dlq` and its removal ledger `<topic>.<group>.dlq.removed`; joins consumer group `<group>` on the source and one **relay** group `<group>.retry.<ms>ms` per tier. It also finds, by metadata, this consumer's retry topics the current policy has no tier for (`<topic>.<group>.retry.<ms>ms`, left by an earlier policy) whose relay group has not consumed all their records, logs each (info: topic and lag) and runs a relay for it too, with that tier's delay, so a redeploy with another policy strands no waiting retry (not in blocking mode). |
//! | `receive` / `receive_batch` | one poll thread per Kafka consumer hands records to one bounded stream, in chunks: a poll pass serves the consumer's events (rebalances, errors, commit results) through rdkafka's `poll`, then takes up to 256 records in one `rd_kafka_consume_batch_queue` call from a queue of the consumer's own, to which its partitions' fetched records are routed (before each assignment starts their fetch, and again every 100 ms), tracks their offsets under one lock and sends them as one chunk (one wake-up), **undecoded**: each becomes a delivery whose payload and key are read in place and whose message (id, headers — librdkafka parses a record's headers only when asked, and that parse was most of a record's cost) is decoded when something first reads it, on that thread ([`reliq_core::RawMessage`]); the single poll thread does no more per record than polling and tracking. A delivery holds librdkafka's record, and with it the record's consumer, until it is dropped: a stopping poll thread *closes* its consumer (final commit, group leave — nothing waits for deliveries), and the last record *destroys* it. A handler that keeps deliveries after handling them keeps their fetch buffers too. The runtime takes up to its free in-flight room per receive. librdkafka fetches ahead while its queue holds under `queued.min.messages` (100,000) records, bounded by `queued.max.messages.kbytes` (4 MiB). While that buffer is full (4 × [`Subscription::prefetch`](reliq_core::Subscription)) the thread stops taking records, which wait in librdkafka's bounded fetch queue, until the runtime takes some; a buffer full for over a second **pauses** every partition, so the thread goes back to serving rebalances, and resumes them when a quarter is left. |
//! | `ack` / `ack_batch` | marks the offset(s) done in a per-partition [`OffsetTracker`] (one lock for a batch); the poll thread commits the **highest contiguous done position** (never past an unfinished record), asynchronously, at most every 2 ms. |
//! | `retry` (blocking, `reliq.retry=blocking`) | see [`RetryMode::Blocking`]: one record per partition at a time; the failed record is held, its partition paused and sought back to the record after it, and the record handed out again after the policy's delay; no retry topics. |
//! | `retry` (default) | produces the copy (headers carry `reliq-attempt`) to the tier's topic, waits for the delivery report, **then** marks the source offset done. The tier's relay holds each partition paused until its head record is due (record timestamp + tier delay), on a timer in its poll loop, then hands it to the same stream; settling it commits on the retry topic. |
//! | `dead_letter` | produces to `<topic>.<group>.dlq`, waits for the report, then marks the source done. The record carries the dead-letter record plus original topic, partition and offset. |
//! | `release` | the offset stays uncommitted; the same record is handed out again after the delay (in this process), or by the next owner of the partition. |
//! | delivery limit | the framework's own counter, kept durably in the **commit metadata** of the partition's committed position (see below). |
//! | `dead_letters` | a reader of the DLQ topic by offset. **browse**: a consumer of the reader's own is *assigned* the DLQ's partitions at the cursor's offsets (its group `<group>.dlq-browse` is never joined, nothing is committed) and reads up to the high watermarks taken when the page starts — up to `max` entries of each partition, merged oldest first (record timestamp, partition, offset), so a cursor always gives the same page; the cursor is each partition's next offset (`0:17,1:4,2:0`). **remove** (Kafka cannot delete one record): one record per entry, key `<partition>:<offset>`, value the message id, to the compacted **removal ledger** `<dlq>.removed` (one partition), confirmed (`acks=all`) before it returns; browse, get and count skip what the ledger names. Then each partition's prefix of removed entries is cut off with the admin **DeleteRecords** API, and only after the broker confirmed the new low watermark are the ledger's keys below it tombstoned, so neither topic grows with removals. **count**: the watermark spans minus the ledger's entries inside them (no read of the DLQ), the oldest `reliq-dead-lettered-at` from each partition's first live entry. **get** / **remove** find ids in an index the reader builds as it reads (each record read once per reader). The DLQ topic is created without a retention limit (`retention.ms=-1`): a dead letter leaves only through `remove`. |
//! | `send_to_consumer` | produces to this consumer's first retry topic, marked due at once (replay reaches this group only). |
//!
//! Retry and DLQ copies go through a second producer with `allow.auto.create.topics=false`
//! after a metadata check that the topic exists, so a deleted retry or DLQ topic makes
//! `retry` / `dead_letter` fail (the source stays uncommitted) instead of silently
//! auto-creating a topic nobody reads.
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

mod config;
mod dead_letters;
mod fetch;
mod receiver;
pub mod tracker;

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::error::{KafkaError as RdError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer as _};
use rdkafka::util::Timeout;
use reliq_core::{
    Broker, BrokerError, Capabilities, Destination, Message, Receiver, Subscription, headers,
};

pub use config::{BufferPolicy, KafkaConfig, RetryMode};
pub use tracker::OffsetTracker;

/// Backend-private header: when a record on a retry topic is due (ms since the epoch),
/// overriding "record timestamp + tier delay" (used by `send_to_consumer`). Stripped
/// before the message reaches a handler.
pub const DUE_AT_HEADER: &str = "reliq-kafka-due-ms";
/// Backend-private header: partition of the record first consumed from the source,
/// carried through retry topics so a later dead letter names the original position.
pub const SOURCE_PARTITION_HEADER: &str = "reliq-kafka-source-partition";
/// Backend-private header: offset of the record first consumed from the source.
pub const SOURCE_OFFSET_HEADER: &str = "reliq-kafka-source-offset";

/// Errors of the Kafka backend (converted to [`BrokerError`] at the seam).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KafkaError {
    /// A setting or the URL is invalid; names it.
    #[error("invalid Kafka setting `{field}`: {reason}")]
    Config {
        /// The setting or URL part.
        field: String,
        /// What is wrong.
        reason: String,
    },
    /// The Kafka client failed.
    #[error("kafka client: {0}")]
    Client(#[from] RdError),
    /// Creating, deleting or looking up a topic failed.
    #[error("kafka admin on `{topic}`: {reason}")]
    Admin {
        /// The topic.
        topic: String,
        /// What was being done, and what the broker said.
        reason: String,
        /// The broker's error code or the client's error, if there was one.
        #[source]
        source: Option<Box<dyn std::error::Error + Send + Sync>>,
    },
}

impl From<KafkaError> for BrokerError {
    fn from(e: KafkaError) -> Self {
        match e {
            KafkaError::Config { field, reason } => BrokerError::Config { field, reason },
            KafkaError::Client(e) => client_error(e, "using the Kafka client for", "kafka"),
            other => BrokerError::Other(Box::new(other)),
        }
    }
}

/// Map a client error to the seam's error, keeping it as the source; `doing` and `topic`
/// say what failed (`producing to`, `orders.billing.dlq`).
pub(crate) fn client_error(e: RdError, doing: &str, topic: &str) -> BrokerError {
    match e.rdkafka_error_code() {
        Some(
            RDKafkaErrorCode::UnknownTopicOrPartition
            | RDKafkaErrorCode::UnknownTopic
            | RDKafkaErrorCode::UnknownPartition,
        ) => BrokerError::Unroutable(topic.to_owned()),
        Some(RDKafkaErrorCode::MessageTimedOut | RDKafkaErrorCode::RequestTimedOut) => {
            BrokerError::Timeout(Duration::ZERO)
        }
        Some(RDKafkaErrorCode::QueueFull) => BrokerError::rejected(format!(
            "{doing} {topic}: producer buffer full (queue.buffering.max.messages)"
        ))
        .caused_by(e),
        Some(
            RDKafkaErrorCode::AllBrokersDown
            | RDKafkaErrorCode::BrokerTransportFailure
            | RDKafkaErrorCode::Resolve,
        ) => BrokerError::connection(format!("{doing} {topic}: {e}")).caused_by(e),
        _ => BrokerError::Other(Box::new(KafkaError::Client(e))),
    }
}

pub(crate) struct Inner {
    pub(crate) config: KafkaConfig,
    /// Publishes (auto-create allowed where the broker allows it).
    pub(crate) producer: FutureProducer,
    /// Retry / DLQ copies (auto-create off; topics are declared at subscribe).
    pub(crate) route_producer: FutureProducer,
    pub(crate) admin: AdminClient<DefaultClientContext>,
}

/// A Kafka connection: two idempotent producers (publish; retry/DLQ copies) and an admin
/// client. Cheap to clone. Each `subscribe` / `dead_letters` creates its own consumers.
#[derive(Clone)]
pub struct KafkaBroker {
    pub(crate) inner: Arc<Inner>,
}

impl KafkaBroker {
    /// Connect with a `kafka://` URL (see [`KafkaConfig`]). Clients connect lazily; a
    /// broker that is down shows up on the first operation.
    pub fn connect(url: &str) -> Result<Self, KafkaError> {
        Self::with_config(KafkaConfig::from_url(url)?)
    }

    /// Connect with explicit settings.
    pub fn with_config(config: KafkaConfig) -> Result<Self, KafkaError> {
        let producer = config.producer(true).create()?;
        let route_producer = config.producer(false).create()?;
        let admin = config.admin().create()?;
        Ok(Self {
            inner: Arc::new(Inner {
                config,
                producer,
                route_producer,
                admin,
            }),
        })
    }

    /// The settings in use.
    pub fn config(&self) -> &KafkaConfig {
        &self.inner.config
    }

    /// Create `topics` (with the configured partitions and replication) where missing.
    pub async fn ensure_topics(&self, topics: &[String]) -> Result<(), KafkaError> {
        self.inner.ensure_topics(topics).await
    }

    /// Delete `topics` (for operators and tests; missing topics are not an error).
    pub async fn delete_topics(&self, topics: &[String]) -> Result<(), KafkaError> {
        let names: Vec<&str> = topics.iter().map(String::as_str).collect();
        let results = self
            .inner
            .admin
            .delete_topics(
                &names,
                &AdminOptions::new().operation_timeout(Some(ADMIN_TIMEOUT)),
            )
            .await?;
        for r in results {
            if let Err((topic, code)) = r
                && code != RDKafkaErrorCode::UnknownTopicOrPartition
            {
                return Err(KafkaError::Admin {
                    topic,
                    reason: format!("deleting the topic: {code}"),
                    source: Some(Box::new(code)),
                });
            }
        }
        Ok(())
    }

    /// Whether `topic` exists right now (a fresh metadata request that never creates it).
    pub async fn topic_exists(&self, topic: &str) -> Result<bool, KafkaError> {
        self.inner.topic_exists(topic).await
    }
}

const ADMIN_TIMEOUT: Duration = Duration::from_secs(30);

impl Inner {
    pub(crate) async fn ensure_topics(&self, topics: &[String]) -> Result<(), KafkaError> {
        let new: Vec<NewTopic<'_>> = topics
            .iter()
            .map(|t| self.new_topic(t, self.config.partitions))
            .collect();
        self.create_topics(&new).await
    }

    fn new_topic<'a>(&self, name: &'a str, partitions: i32) -> NewTopic<'a> {
        NewTopic::new(
            name,
            partitions,
            TopicReplication::Fixed(self.config.replication),
        )
    }

    /// Create `sub`'s DLQ topic `dlq` where missing — kept until removed (no retention
    /// limit: a dead letter leaves only through the reader's `remove`) — and its removal
    /// ledger `<dlq>.removed` (one partition, compacted; see `dead_letters`).
    pub(crate) async fn ensure_dead_letter_topics(&self, dlq: &str) -> Result<(), KafkaError> {
        let ledger = format!("{dlq}{}", dead_letters::LEDGER_SUFFIX);
        let new = [
            self.new_topic(dlq, self.config.partitions)
                .set("retention.ms", "-1")
                .set("retention.bytes", "-1"),
            self.new_topic(&ledger, 1)
                .set("cleanup.policy", "compact")
                // Compaction skips the active segment: roll it hourly so tombstoned
                // keys really go.
                .set("segment.ms", "3600000"),
        ];
        self.create_topics(&new).await
    }

    async fn create_topics(&self, new: &[NewTopic<'_>]) -> Result<(), KafkaError> {
        let results = self
            .admin
            .create_topics(
                new,
                &AdminOptions::new().operation_timeout(Some(ADMIN_TIMEOUT)),
            )
            .await?;
        for r in results {
            if let Err((topic, code)) = r
                && code != RDKafkaErrorCode::TopicAlreadyExists
            {
                return Err(KafkaError::Admin {
                    topic,
                    reason: format!("creating the topic: {code}"),
                    source: Some(Box::new(code)),
                });
            }
        }
        Ok(())
    }

    /// Wait until freshly created `topics` show up with partitions in the metadata.
    pub(crate) async fn wait_visible(&self, topics: &[String]) -> Result<(), BrokerError> {
        let deadline = tokio::time::Instant::now() + ADMIN_TIMEOUT;
        for t in topics {
            while !self.topic_exists(t).await.map_err(BrokerError::from)? {
                if tokio::time::Instant::now() >= deadline {
                    return Err(BrokerError::Timeout(ADMIN_TIMEOUT));
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        Ok(())
    }

    pub(crate) async fn topic_exists(&self, topic: &str) -> Result<bool, KafkaError> {
        let producer = self.route_producer.clone();
        let name = topic.to_owned();
        let metadata = tokio::task::spawn_blocking(move || {
            producer
                .client()
                .fetch_metadata(Some(&name), Duration::from_secs(10))
        })
        .await
        .map_err(|e| KafkaError::Admin {
            topic: topic.to_owned(),
            reason: format!("looking the topic up: the metadata task failed: {e}"),
            source: Some(Box::new(e)),
        })??;
        Ok(metadata
            .topics()
            .iter()
            .any(|t| t.name() == topic && t.error().is_none() && !t.partitions().is_empty()))
    }

    /// Produce `message` and wait for its delivery report.
    pub(crate) async fn produce(
        &self,
        route: bool,
        topic: &str,
        message: &Message,
        extra: &[(&str, String)],
    ) -> Result<(i32, i64), BrokerError> {
        let producer = if route {
            &self.route_producer
        } else {
            &self.producer
        };
        let mut hs = OwnedHeaders::new_with_capacity(message.headers().len() + 1 + extra.len());
        hs = hs.insert(Header {
            key: headers::MESSAGE_ID,
            value: Some(message.id().as_str()),
        });
        for (k, v) in message.headers().iter() {
            if k == headers::MESSAGE_ID || extra.iter().any(|(e, _)| *e == k) {
                continue;
            }
            hs = hs.insert(Header {
                key: k,
                value: Some(v),
            });
        }
        for (k, v) in extra {
            hs = hs.insert(Header {
                key: k,
                value: Some(v.as_str()),
            });
        }
        let mut record = FutureRecord::to(topic)
            .payload(message.payload().as_ref())
            .headers(hs)
            .timestamp(now_millis_ceil());
        if let Some(key) = message.key() {
            record = record.key(key);
        }
        let queue_timeout = match self.config.buffer {
            BufferPolicy::Block(d) => Timeout::After(d),
            BufferPolicy::FailFast => Timeout::After(Duration::ZERO),
        };
        match producer.send(record, queue_timeout).await {
            Ok(delivery) => Ok((delivery.partition, delivery.offset)),
            Err((e, _)) => Err(match client_error(e, "producing to", topic) {
                BrokerError::Timeout(_) => BrokerError::Timeout(self.config.send_timeout),
                other => other,
            }),
        }
    }
}

/// Now in ms since the epoch, rounded up, so "timestamp + delay" is never earlier than
/// "produce time + delay".
pub(crate) fn now_millis_ceil() -> i64 {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let ms = now.as_millis() + u128::from(!now.subsec_nanos().is_multiple_of(1_000_000));
    i64::try_from(ms).unwrap_or(i64::MAX)
}

#[async_trait]
impl Broker for KafkaBroker {
    fn kind(&self) -> &'static str {
        "kafka"
    }

    fn capabilities(&self) -> Capabilities {
        let blocking = self.inner.config.retry_mode == RetryMode::Blocking;
        Capabilities {
            rejects_unroutable: false,
            // Blocking mode waits exactly the policy's delay (jitter included).
            exact_retry_delay: blocking,
            delivery_limit: true,
            // Replay to one consumer goes through its first retry topic.
            consumer_redelivery: !blocking,
            // The attempt travels in the `reliq-attempt` header of the retry copy.
            attempts_count_every_delivery: false,
            deduplicates_publishes: false,
        }
    }

    async fn publish(
        &self,
        destination: &Destination,
        message: Message,
    ) -> Result<(), BrokerError> {
        if let Some(route) = &destination.route {
            tracing::debug!(%route, "Kafka has no routing keys; the route is ignored (use the key)");
        }
        self.inner
            .produce(false, &destination.topic, &message, &[])
            .await
            .map(drop)
    }

    async fn subscribe(
        &self,
        subscription: &Subscription,
    ) -> Result<Box<dyn Receiver>, BrokerError> {
        let receiver = receiver::KafkaReceiver::subscribe(self.inner.clone(), subscription).await?;
        Ok(Box::new(receiver))
    }

    async fn dead_letters(
        &self,
        subscription: &Subscription,
    ) -> Result<Box<dyn reliq_core::DeadLetters>, BrokerError> {
        let reader = dead_letters::KafkaDeadLetters::open(self.inner.clone(), subscription).await?;
        Ok(Box::new(reader))
    }

    async fn send_to_consumer(
        &self,
        subscription: &Subscription,
        message: Message,
    ) -> Result<(), BrokerError> {
        let Some(first) = subscription.retry_tiers.first() else {
            return Err(BrokerError::Unsupported {
                backend: "kafka",
                what: "send_to_consumer without a retry tier (no per-consumer topic)",
            });
        };
        let topic = subscription.retry_name(*first);
        if !self
            .inner
            .topic_exists(&topic)
            .await
            .map_err(BrokerError::from)?
        {
            return Err(BrokerError::Unroutable(topic));
        }
        let due = [(DUE_AT_HEADER, now_millis_ceil().to_string())];
        self.inner
            .produce(true, &topic, &message, &due)
            .await
            .map(drop)
    }
}

#[cfg(test)]
mod tests {
    use std::error::Error as _;

    use super::*;

    #[test]
    fn client_errors_keep_their_cause_and_say_what_was_done() {
        let down = RdError::MessageProduction(RDKafkaErrorCode::AllBrokersDown);
        let e = client_error(down, "producing to", "orders");
        assert!(
            matches!(&e, BrokerError::Connection { context, .. }
            if context.starts_with("producing to orders: ")),
            "{e:?}"
        );
        assert!(
            e.source()
                .and_then(|s| s.downcast_ref::<RdError>())
                .is_some_and(|s| s.rdkafka_error_code() == Some(RDKafkaErrorCode::AllBrokersDown)),
            "{e:?}"
        );
        let full = RdError::MessageProduction(RDKafkaErrorCode::QueueFull);
        let e = client_error(full, "producing to", "orders");
        assert!(
            matches!(
                &e,
                BrokerError::Rejected {
                    source: Some(_),
                    ..
                }
            ),
            "{e:?}"
        );
        let gone = RdError::MessageProduction(RDKafkaErrorCode::UnknownTopicOrPartition);
        assert!(
            matches!(client_error(gone, "producing to", "orders"), BrokerError::Unroutable(t) if t == "orders")
        );
    }
}
