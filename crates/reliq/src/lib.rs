//! # reliq
//!
//! Reliable messaging over Kafka, RabbitMQ, NATS JetStream, Amazon SQS and an embedded
//! in-process broker. Write one consumer — a handler and a policy — pick a backend with a
//! cargo feature and a URL, and run it unchanged on any broker. reliq owns the failure
//! path: error classification, bounded retries that wait in the broker, dead-letter
//! queues that never lose a message, operator replay, idempotent consumers.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use std::time::Duration;
//! use reliq::{BoxError, Consumer, Delivery, Destination, Message, RetryPolicy};
//!
//! let broker = reliq::connect("memory://docs").await?;
//! let consumer = Consumer::builder(broker.clone(), "inventory")
//!     .subscribe("orders")
//!     .retry(RetryPolicy::tiers([Duration::from_secs(5), Duration::from_secs(30)]))
//!     .start(|d: Delivery| async move {
//!         let text = d.text()?;          // invalid UTF-8 ⇒ poison ⇒ dead-lettered at once
//!         assert_eq!(text, "hello");
//!         Ok::<(), BoxError>(())
//!     })
//!     .await?;
//! broker.publish(&Destination::new("orders"), Message::new("hello")).await?;
//! # while consumer.stats().processed == 0 { tokio::time::sleep(Duration::from_millis(5)).await; }
//! let report = consumer.shutdown().await;
//! assert_eq!(report.stats.processed, 1);
//! # Ok(()) }
//! ```
//!
//! ## Backends and URLs
//!
//! | URL | cargo feature | crate |
//! |---|---|---|
//! | `memory://[name]` | `memory` (default) | `reliq-memory` |
//! | `amqp://…`, `amqps://…` (TLS via rustls) | `rabbit` | `reliq-rabbit` |
//! | `kafka://host:port[,host:port]?key=value` | `kafka` | `reliq-kafka` (query keys: librdkafka settings, or `reliq.*`, see `reliq_kafka::KafkaConfig`) |
//! | `nats://…`, `tls://…` | `nats` | `reliq-nats` |
//! | `sqs://host:port?region=…`, `sqs://?region=…` | `sqs` | `reliq-sqs` (`host:port` = an endpoint over http, e.g. an emulator; empty = real AWS with the default credential chain) |

//!
//! ## Durable inbox and outbox
//!
//! | cargo feature | module | crate |
//! |---|---|---|
//! | `postgres` | `reliq::postgres` | `reliq-postgres`: inbox and outbox on PostgreSQL, relay woken by `LISTEN/NOTIFY` |
//! | `sqlite` | `reliq::sqlite` | `reliq-sqlite`: inbox and outbox on SQLite, relay polling |
//!
//! ## Typed payloads
//!
//! [`ConsumerBuilder::start_typed`] decodes each delivery with a [`Codec`] before the
//! handler runs (what does not decode is poison); [`TypedPublisher`] encodes. JSON is
//! built in ([`JsonCodec`]); Avro, Protobuf and the schema registry are in
//! `reliq::contracts` (features `contracts`, `avro`, `protobuf`).

#![cfg_attr(docsrs, feature(doc_cfg))]

use std::sync::Arc;

// What an application uses, each item by one path. What a backend implements (the
// `Receiver` seam, delivery tokens, raw messages) stays in `reliq-core`.
pub use reliq_core::{
    Access, Aggregate, Backlog, BacklogGauges, Batch, BatchError, BoxError, Broker, BrokerError,
    Capabilities, CircuitBreaker, CircuitState, Claim, Classifier, Clock, Consumer,
    ConsumerBuilder, ConsumerError, ConsumerHandle, Corrected, Correction, Cursor, DeadLetter,
    DeadLetterCount, DeadLetterEntry, DeadLetterFilter, DeadLetterPage, DeadLetterReason,
    DeadLetters, DecodeError, Delivery, DeliveryOrder, Destination, Duplicate, Envelope,
    ErrorChain, ErrorClass, FinalRoute, Fingerprint, Grant, HeaderError, Headers, Inbox,
    InboxError, MemoryInbox, Message, MessageId, MeteredBroker, NamePattern, Origin, OutageWait,
    OutboxError, OutboxRecord, OutboxStore, PanicAction, Permanent, Permissions, Poison,
    PolicyError, Progress, PurgeReport, Relay, RelayHandle, RelayStats, Replay, ReplayEntry,
    ReplayGuard, ReplayReport, ReplayTarget, RetryPolicy, Schedule, ShutdownReport, StartupCheck,
    Stats, StatsSnapshot, Subscription, TierBacklog, Transient, through_outage,
};
// Typed payloads: a codec, a typed consumer (`ConsumerBuilder::start_typed`), a typed
// publisher; and the service's AsyncAPI document (`ConsumerBuilder::asyncapi`).
pub use reliq_core::{
    AVRO_SCHEMA_FORMAT, AsyncApi, Codec, CodecError, JSON_SCHEMA_FORMAT, JsonCodec, MessageSchema,
    PROTOBUF_SCHEMA_FORMAT, PublishError, TypedPublisher, encode_message,
};

/// A consumer's topology as data: the plan ([`Broker::plan`]), the broker's objects
/// ([`Broker::inspect`]) and their differences ([`Broker::check_topology`]).
pub mod topology {
    pub use reliq_core::seam::{compare, duration_text};
    pub use reliq_core::{
        Channel, Difference, Drift, ExtraObject, Found, LiveObject, LiveTopology, ObjectKind, Plan,
        PlannedObject, Setting, Severity, TopologyReport, Traffic, Wanted,
    };
}

/// Secrets in broker URLs: `<key>.file` / `<key>.env` indirection and redaction.
pub use reliq_core::seam::secrets;

/// The header names reliq reads and writes on every message.
pub mod headers {
    pub use reliq_core::seam::headers::{
        ATTEMPT, CAUSATION_ID, CONSUMER, CONTENT_TYPE, CORRELATION_ID, DEAD_LETTER_REASON,
        DEAD_LETTER_VERSION, DEAD_LETTERED_AT, ERROR_CLASS, FIRST_FAILURE_AT, LAST_ERROR,
        LAST_FAILURE_AT, MESSAGE_ID, OCCURRED_AT, ORIGINAL_DESTINATION, ORIGINAL_OFFSET,
        ORIGINAL_PARTITION, ORIGINAL_ROUTE, ORIGINAL_SEQUENCE, REPLAY_COUNT, REPLAYED_AT,
        TRACEPARENT, TRACESTATE,
    };
}

/// The metric names the runtime, the replay engine, the outbox relay, publishes and the
/// backlog poller record (the table is in [`reliq_core::metrics`]).
pub mod metrics {
    pub use reliq_core::metrics::{
        ALL_METRICS, BACKLOG, BACKLOG_LAST_POLL, BACKLOG_POLL_FAILURES, BATCH_SIZE,
        BATCH_SIZE_BUCKETS, CIRCUIT_STATE, CIRCUIT_TRANSITIONS, DEAD_LETTERED, DISCARDED,
        DLQ_MESSAGES, DLQ_OLDEST_AGE, DUPLICATES, DURATION_BUCKETS, HANDLER_DURATION, IN_FLIGHT,
        OUTBOX_PUBLISH_FAILURES, OUTBOX_PUBLISHED, OUTBOX_STORE_FAILURES, PROCESSED,
        PRODUCER_BUFFER_RATIO, PUBLISH_DURATION, PUBLISH_FAILURES, PUBLISHED, RECEIVED, REPLAYED,
        RETRIED, RETRY_WAITING, SETTLE_FAILURES, TOPOLOGY_DRIFT, UNSETTLED,
    };
    pub use reliq_core::metrics::{describe_metrics, tier_label};
}

/// Avro and Protobuf codecs, the schema-registry wire format and a registry client
/// (features `contracts`, `avro`, `protobuf`; see `docs/contracts.md`).
#[cfg(feature = "contracts")]
#[cfg_attr(docsrs, doc(cfg(feature = "contracts")))]
pub use reliq_contracts as contracts;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use reliq_postgres as postgres;
#[cfg(feature = "sqlite")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
pub use reliq_sqlite as sqlite;

#[cfg(feature = "kafka")]
#[cfg_attr(docsrs, doc(cfg(feature = "kafka")))]
pub use reliq_kafka as kafka;
#[cfg(feature = "memory")]
#[cfg_attr(docsrs, doc(cfg(feature = "memory")))]
pub use reliq_memory as memory;
#[cfg(feature = "nats")]
#[cfg_attr(docsrs, doc(cfg(feature = "nats")))]
pub use reliq_nats as nats;
#[cfg(feature = "rabbit")]
#[cfg_attr(docsrs, doc(cfg(feature = "rabbit")))]
pub use reliq_rabbit as rabbit;
#[cfg(feature = "sqs")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqs")))]
pub use reliq_sqs as sqs;

/// A backend's `connect` as a plain function pointer.
type ConnectFn = fn(&str) -> ConnectFuture<'_>;
type ConnectFuture<'a> = std::pin::Pin<
    Box<dyn std::future::Future<Output = Result<Arc<dyn Broker>, BrokerError>> + Send + 'a>,
>;

/// The backends built in: each one's cargo feature, its own URL schemes and `connect`.
fn built_in() -> Vec<(&'static str, &'static [&'static str], ConnectFn)> {
    #[allow(unused_mut)]
    let mut backends: Vec<(&'static str, &'static [&'static str], ConnectFn)> = Vec::new();
    #[cfg(feature = "memory")]
    backends.push(("memory", reliq_memory::SCHEMES, |u| {
        Box::pin(reliq_memory::connect(u))
    }));
    #[cfg(feature = "rabbit")]
    backends.push(("rabbit", reliq_rabbit::SCHEMES, |u| {
        Box::pin(reliq_rabbit::connect(u))
    }));
    #[cfg(feature = "kafka")]
    backends.push(("kafka", reliq_kafka::SCHEMES, |u| {
        Box::pin(reliq_kafka::connect(u))
    }));
    #[cfg(feature = "nats")]
    backends.push(("nats", reliq_nats::SCHEMES, |u| {
        Box::pin(reliq_nats::connect(u))
    }));
    #[cfg(feature = "sqs")]
    backends.push(("sqs", reliq_sqs::SCHEMES, |u| {
        Box::pin(reliq_sqs::connect(u))
    }));
    backends
}

/// Every backend's feature and schemes, for the error that names the feature to turn on
/// when a URL's backend is not built in (a test checks it against each backend's own
/// `SCHEMES`).
const EVERY_BACKEND: &[(&str, &[&str])] = &[
    ("memory", &["memory"]),
    ("rabbit", &["amqp", "amqps"]),
    ("kafka", &["kafka"]),
    ("nats", &["nats", "tls"]),
    ("sqs", &["sqs"]),
];

fn every_scheme() -> String {
    let schemes: Vec<&str> = EVERY_BACKEND
        .iter()
        .flat_map(|(_, s)| s.iter().copied())
        .collect();
    schemes.join(", ")
}

/// `connect` could not hand back a broker.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectError {
    /// The URL has no `scheme://`.
    #[error("broker URL `{url}` has no scheme (expected one of {expected})")]
    NoScheme {
        /// The URL, its secrets redacted.
        url: String,
        /// Every scheme reliq knows.
        expected: String,
    },
    /// No backend handles this scheme.
    #[error("unknown broker URL scheme `{scheme}://` (expected one of {expected})")]
    UnknownScheme {
        /// The scheme.
        scheme: String,
        /// Every scheme reliq knows.
        expected: String,
    },
    /// The backend exists but its cargo feature is off.
    #[error(
        "`{scheme}://` needs the `{feature}` cargo feature of reliq (reliq = {{ features = [\"{feature}\"] }})"
    )]
    FeatureDisabled {
        /// The scheme.
        scheme: String,
        /// The feature to enable.
        feature: &'static str,
    },
    /// The backend failed to connect.
    #[error(transparent)]
    Broker(#[from] BrokerError),
}

/// Connect to the broker a URL names. Which backends are available depends on the cargo
/// features enabled; a URL whose backend is disabled fails with an error naming the
/// feature.
///
/// `memory://name` returns the process-wide embedded broker called `name` (empty name =
/// `default`), so every `connect` with the same URL shares one broker.
pub async fn connect(url: &str) -> Result<Arc<dyn Broker>, ConnectError> {
    let (scheme, _) = url
        .split_once("://")
        .ok_or_else(|| ConnectError::NoScheme {
            url: secrets::redact_url(url),
            expected: every_scheme(),
        })?;
    let scheme = scheme.to_ascii_lowercase();
    if let Some((_, _, connect)) = built_in()
        .into_iter()
        .find(|(_, schemes, _)| schemes.contains(&scheme.as_str()))
    {
        // Every publish counted and timed (`reliq_messages_published_total`, …).
        return Ok(Arc::new(reliq_core::MeteredBroker::new(
            connect(url).await?,
        )));
    }
    match EVERY_BACKEND
        .iter()
        .find(|(_, schemes)| schemes.contains(&scheme.as_str()))
    {
        Some((feature, _)) => Err(ConnectError::FeatureDisabled { scheme, feature }),
        None => Err(ConnectError::UnknownScheme {
            scheme,
            expected: every_scheme(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The table behind the disabled-feature error says what each built-in backend says.
    #[test]
    fn every_backend_table_matches_the_backends_own_schemes() {
        let built = built_in();
        assert!(!built.is_empty());
        for (feature, schemes, _) in built {
            let listed = EVERY_BACKEND.iter().find(|(f, _)| *f == feature);
            assert_eq!(listed.map(|(_, s)| *s), Some(schemes), "{feature}");
        }
    }

    #[tokio::test]
    async fn scheme_errors_name_the_feature() {
        for (url, feature, enabled) in [
            ("kafka://127.0.0.1:9092", "kafka", cfg!(feature = "kafka")),
            (
                "amqp://guest:guest@127.0.0.1:5672/%2f",
                "rabbit",
                cfg!(feature = "rabbit"),
            ),
            ("nats://127.0.0.1:4222", "nats", cfg!(feature = "nats")),
            (
                "sqs://127.0.0.1:4566?region=us-east-1",
                "sqs",
                cfg!(feature = "sqs"),
            ),
        ] {
            if enabled {
                // Built with this backend: the disabled-feature error does not apply.
                continue;
            }
            match connect(url).await {
                Err(ConnectError::FeatureDisabled { feature: f, .. }) => assert_eq!(f, feature),
                Err(e) => panic!("{url}: unexpected error {e}"),
                Ok(_) => panic!("{url}: backend not built yet must not connect"),
            }
        }
        let err = connect("redis://x").await.err().map(|e| e.to_string());
        assert!(err.is_some_and(|e| e.contains("unknown broker URL scheme `redis://`")));
        assert!(matches!(
            connect("localhost:5672").await,
            Err(ConnectError::NoScheme { .. })
        ));
    }

    #[cfg(feature = "kafka")]
    #[tokio::test]
    async fn kafka_urls_connect_lazily_and_bad_ones_name_the_field() {
        let broker = connect("kafka://127.0.0.1:9092?client.id=facade-test")
            .await
            .expect("a valid kafka URL connects lazily");
        assert_eq!(broker.kind(), "kafka");
        assert!(!broker.capabilities().rejects_unroutable);
        match connect("kafka://127.0.0.1:9092?reliq.partitions=zero").await {
            Err(ConnectError::Broker(BrokerError::Config { field, .. })) => {
                assert_eq!(field, "reliq.partitions")
            }
            other => panic!("unexpected {:?}", other.map(|b| b.kind())),
        }
    }

    /// Kafka cannot filter what a consumer reads: a filter fails at start, naming the
    /// field, before anything is declared on the broker.
    #[cfg(feature = "kafka")]
    #[tokio::test]
    async fn a_broker_that_cannot_filter_refuses_a_filter_naming_it() {
        for url in ["kafka://127.0.0.1:9092?client.id=facade-filter"] {
            let broker = connect(url).await.expect("connects");
            let started = Consumer::builder(broker, "g")
                .subscribe("never-declared-filter-test")
                .filter("order.*")
                .start(|_d: Delivery| async { Ok::<(), BoxError>(()) })
                .await;
            match started {
                Err(ConsumerError::Subscribe(BrokerError::Config { field, .. })) => {
                    assert_eq!(field, "filter", "{url}")
                }
                Err(e) => panic!("{url}: unexpected error {e}"),
                Ok(_) => panic!("{url}: a filter the broker cannot apply was accepted"),
            }
        }
    }

    #[tokio::test]
    async fn memory_urls_share_a_named_broker() {
        let a = connect("memory://shared-test").await.unwrap();
        let b = connect("memory://shared-test").await.unwrap();
        let rx = a
            .subscribe(&Subscription::new("g", "t-shared"))
            .await
            .unwrap();
        b.publish(&Destination::new("t-shared"), Message::new("x"))
            .await
            .unwrap();
        assert_eq!(rx.receive().await.unwrap().payload(), b"x");
        let other = connect("memory://other").await.unwrap();
        assert!(
            other
                .publish(&Destination::new("t-shared"), Message::new("x"))
                .await
                .is_err()
        );
    }
}
