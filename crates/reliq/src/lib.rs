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
//!     .subscribe("orders", None::<String>)
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

use std::sync::Arc;

pub use reliq_core::*;

#[cfg(feature = "postgres")]
pub use reliq_postgres as postgres;
#[cfg(feature = "sqlite")]
pub use reliq_sqlite as sqlite;

#[cfg(feature = "memory")]
pub use reliq_memory as memory;
#[cfg(feature = "nats")]
pub use reliq_nats as nats;

#[cfg(feature = "kafka")]
pub use reliq_kafka as kafka;

#[cfg(feature = "rabbit")]
pub use reliq_rabbit as rabbit;

#[cfg(feature = "sqs")]
pub use reliq_sqs as sqs;

/// `connect` could not hand back a broker.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectError {
    /// The URL has no `scheme://`.
    #[error(
        "broker URL `{0}` has no scheme (expected memory://, amqp://, kafka://, nats:// or sqs://)"
    )]
    NoScheme(String),
    /// No backend handles this scheme.
    #[error(
        "unknown broker URL scheme `{0}://` (expected memory, amqp, amqps, kafka, nats, tls or sqs)"
    )]
    UnknownScheme(String),
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
    let (scheme, rest) = url
        .split_once("://")
        .ok_or_else(|| ConnectError::NoScheme(url.to_owned()))?;
    let scheme = scheme.to_ascii_lowercase();
    let feature = match scheme.as_str() {
        "memory" => "memory",
        "amqp" | "amqps" => "rabbit",
        "kafka" => "kafka",
        "nats" | "tls" => "nats",
        "sqs" => "sqs",
        _ => return Err(ConnectError::UnknownScheme(scheme)),
    };
    match feature {
        #[cfg(feature = "memory")]
        "memory" => Ok(Arc::new(named_memory_broker(rest))),
        #[cfg(feature = "nats")]
        "nats" => Ok(Arc::new(reliq_nats::NatsBroker::connect(url).await?)),
        #[cfg(feature = "kafka")]
        "kafka" => Ok(Arc::new(
            kafka::KafkaBroker::connect(url).map_err(BrokerError::from)?,
        )),
        #[cfg(feature = "rabbit")]
        "rabbit" => Ok(Arc::new(rabbit::RabbitBroker::connect(url).await?)),
        #[cfg(feature = "sqs")]
        "sqs" => Ok(Arc::new(sqs::SqsBroker::connect(url).await?)),
        _ => {
            let _ = rest;
            Err(ConnectError::FeatureDisabled { scheme, feature })
        }
    }
}

#[cfg(feature = "memory")]
fn named_memory_broker(name: &str) -> memory::MemoryBroker {
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};
    static REGISTRY: OnceLock<Mutex<HashMap<String, memory::MemoryBroker>>> = OnceLock::new();
    let name = name.trim_end_matches('/');
    let name = if name.is_empty() { "default" } else { name };
    REGISTRY
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .entry(name.to_owned())
        .or_default()
        .clone()
}

#[cfg(test)]
mod tests {
    use super::*;

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
            Err(ConnectError::NoScheme(_))
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
