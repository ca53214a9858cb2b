//! # reliq-core
//!
//! The broker-agnostic heart of reliq: what a message is, how failures are classified,
//! what a retry policy decides, and the consumer runtime that turns a handler into a
//! reliable consumer on any backend.
//!
//! A handler takes one [`Delivery`] ([`ConsumerBuilder::start`]) or a [`Batch`] of them
//! ([`ConsumerBuilder::start_batch`], see [`Batch`]); the failure path is per message
//! either way.
//!
//! Backends (reliq-memory, reliq-kafka, reliq-rabbit, reliq-nats, reliq-sqs) implement
//! the small [`Broker`] / [`Receiver`](seam::Receiver) / [`DeadLetters`] seam — its
//! contract and everything a backend uses is in [`seam`], one page; everything else is
//! here, written once. The durable stores (reliq-postgres, reliq-sqlite) implement
//! [`Inbox`] and [`OutboxStore`]; the outbox [`Relay`] and the [`Duplicate`] answer of a
//! handler's transactional inbox claim are here too.
//!
//! # One path per item
//!
//! Every public item has exactly one path (`scripts/public-paths --check` in `just lint`
//! lists them and fails on a second one):
//!
//! - what an application names — the consumer, its policy and errors, messages and
//!   headers, the dead-letter record and reader, replay, inbox and outbox, topology
//!   reports, permissions — is at the crate root: `reliq_core::Consumer`;
//! - what only a backend, a durable store or the operator plane needs beyond that — the
//!   [`Receiver`](seam::Receiver) side of the seam, delivery tokens, lease renewal,
//!   header names ([`seam::headers`]), secrets in URLs ([`seam::secrets`]), the topology
//!   comparison — is in [`seam`]: `reliq_core::seam::DeliveryToken`;
//! - metric names are in [`metrics`] (what dashboards and alert rules use).
//!
//! The modules that define the items are private; each item's own documentation carries
//! what its module used to say.
//!
//! ```
//! use std::time::Duration;
//! use reliq_core::{Consumer, Delivery, RetryPolicy, BoxError, Permanent};
//! # async fn demo(broker: std::sync::Arc<dyn reliq_core::Broker>) -> Result<(), Box<dyn std::error::Error>> {
//! #[derive(serde::Deserialize)]
//! struct OrderCreated { sku: String, qty: u32 }
//!
//! let handle = Consumer::builder(broker, "inventory")
//!     .subscribe("orders").filter("order.created")
//!     .retry(RetryPolicy::tiers([Duration::from_secs(5), Duration::from_secs(30)])
//!         .max_age(Duration::from_secs(900))
//!         .jitter(0.2))
//!     .max_in_flight(64)
//!     .start(|d: Delivery| async move {
//!         let order: OrderCreated = d.json()?;            // undecodable ⇒ poison ⇒ DLQ at once
//!         if order.qty == 0 {
//!             return Err(Permanent::msg("qty must be positive").into());
//!         }
//!         let _ = order.sku;                               // … reserve stock …
//!         Ok::<(), BoxError>(())
//!     })
//!     .await?;
//! let report = handle.shutdown().await;
//! # let _ = report; Ok(()) }
//! ```

mod asyncapi;
mod backlog;
mod batch;
mod breaker;
mod broker;
mod classify;
mod codec;
mod consumer;
mod dead_letters;
mod delivery;
mod envelope;
mod error;
#[cfg(feature = "test-util")]
mod faults;
mod filter;
mod fingerprint;
mod gauges;
mod headers;
mod inbox;
mod lease;
mod message;
mod metered;
pub mod metrics;
mod outage;
mod outbox;
mod permissions;
mod replay;
mod retry;
pub mod seam;
mod secrets;
mod subscription;
mod sync;
mod telemetry;
mod topology;

pub use asyncapi::{ASYNCAPI_VERSION, AsyncApi};
pub use backlog::{Backlog, TierBacklog};
pub use batch::{Batch, BatchError};
pub use breaker::{CircuitBreaker, CircuitState};
pub use broker::Broker;
pub use classify::{
    BoxError, Classifier, CodecError, DecodeError, ErrorChain, ErrorClass, Permanent, Poison,
    Transient, UnknownClass,
};
pub use codec::{
    AVRO_SCHEMA_FORMAT, Codec, JSON_SCHEMA_FORMAT, JsonCodec, MessageSchema,
    PROTOBUF_SCHEMA_FORMAT, PublishError, TypedPublisher, encode_message,
};
pub use consumer::{
    Consumer, ConsumerBuilder, ConsumerError, ConsumerHandle, DeliveryOrder, ShutdownReport, Stats,
    StatsSnapshot,
};
pub use dead_letters::{Cursor, DeadLetterCount, DeadLetterEntry, DeadLetterPage, DeadLetters};
pub use delivery::Delivery;
pub use envelope::{Aggregate, Envelope};
pub use error::BrokerError;
pub use filter::DeadLetterFilter;
pub use fingerprint::Fingerprint;
pub use gauges::BacklogGauges;
pub use headers::{DeadLetter, DeadLetterReason, HeaderError, Headers, Origin};
pub use inbox::{Claim, Duplicate, Inbox, InboxError, MemoryInbox};
pub use message::{Message, MessageId};
pub use metered::MeteredBroker;
pub use outage::{OutageWait, through_outage};
pub use outbox::{
    OutboxBacklog, OutboxError, OutboxRecord, OutboxStore, Relay, RelayBuilder, RelayConfigError,
    RelayError, RelayHandle, RelayStats,
};
pub use permissions::{Access, Grant, NamePattern, Permissions};
pub use replay::{
    Corrected, Correction, Progress, PurgeReport, Replay, ReplayEntry, ReplayGuard, ReplayReport,
    ReplayTarget,
};
pub use retry::{Decision, Failure, FinalRoute, PanicAction, PolicyError, RetryPolicy, Schedule};
pub use subscription::{Capabilities, Destination, MAX_NAME_LEN, NameError, Subscription};
pub use telemetry::Clock;
pub use topology::{
    Channel, Difference, Drift, ExtraObject, Found, LiveObject, LiveTopology, ObjectKind, Plan,
    PlannedObject, Setting, Severity, StartupCheck, TopologyReport, Traffic, Wanted,
};
