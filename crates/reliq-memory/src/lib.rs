//! # reliq-memory
//!
//! The embedded, in-process broker: the default backend for tests and local runs. It is
//! not a router — it keeps the semantics a production broker has, so code tested on it
//! behaves the same on Kafka, RabbitMQ, NATS or SQS.
//!
//! | reliq primitive | embedded broker |
//! |---|---|
//! | topology | a topic per source (declared by the first `subscribe` or by [`MemoryBroker::declare_topic`]); per consumer group one queue `<source>.<consumer>` with the subscription's filter and delivery limit, shared by the group's receivers, and its own dead-letter queue ([`Subscription::dead_letter_name`](reliq_core::Subscription::dead_letter_name)) |
//! | publish (confirmed) | a copy into the queue of every group of the topic whose filter matches the route (AMQP-style patterns: `*` one word, `#` zero or more; no filter takes everything); returns once every copy is queued. A topic nobody declared, or a route no group matches → [`BrokerError::Unroutable`](reliq_core::BrokerError::Unroutable) |
//! | subscribe | the group's queue (declared if missing) and a new receiver on it |
//! | receive (bounded) | the next ready messages, at most `prefetch` unsettled per receiver, each leased for `lease`; otherwise waits for a publish, a settle, or the next due retry or lease end |
//! | ack | the delivery is removed; an ack after its lease ended, or of a delivery another receiver handed out, is rejected |
//! | retry after d | the delivery is settled and the retry copy waits on the queue's timer: ready after exactly `d` |
//! | dead-letter | the copy is put on the group's DLQ (an error if the DLQ refuses), *then* the delivery is settled |
//! | release | back to the head of the queue, at once or after the delay; its delivery count is kept |
//! | lease end / receiver dropped | the unsettled deliveries go back to the head of the queue at once (a crashed consumer), delivery counts kept |
//! | attempt | the `reliq-attempt` header |
//! | delivery limit | a message handed out more than `delivery_limit` times without being settled (a crash loop) goes to the DLQ with a dead-letter record, reason `max-deliveries`; while the DLQ refuses, it stays at the head of the queue |
//! | dead_letters | the DLQ read in place, in arrival order: **browse** from a cursor (the queue position of the last entry read, as text); **get** the oldest entry with an id; **remove** the oldest copy per id given; **count** with the oldest `reliq-dead-lettered-at` |
//! | backlog | ready (and due) entries waiting, unsettled in flight, the rest of the timer's entries as retries |
//! | plan / inspect | the group's queue (its filter and delivery limit, fixed by the subscription that made it) and its DLQ |
//! | send_to_consumer (replay) | onto that group's queue only; a group that does not exist → `Unroutable` |
//!
//! Capabilities: rejects unroutable publishes, exact retry delays, a delivery limit and
//! per-consumer redelivery; a release or a crash does not use an attempt, and publishes
//! are not deduplicated. With the `test-util` feature, `MemoryBroker::faults` makes a
//! consumer's DLQ or retry route refuse, and `MemoryBroker::depth` shows queue depths.
//!
//! All timing uses tokio's clock, so it runs under `tokio::time::pause()`: a 5-minute
//! retry schedule is tested in milliseconds.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use reliq_core::{Broker, Destination, Message, Subscription};
//! let broker = Arc::new(reliq_memory::MemoryBroker::new());
//! let rx = broker.subscribe(&Subscription::new("billing", "orders")).await?;
//! broker.publish(&Destination::new("orders"), Message::new("hello")).await?;
//! let d = rx.receive().await?;
//! assert_eq!(d.payload(), b"hello");
//! rx.ack(&d).await?;
//! # Ok(()) }
//! ```

use reliq_core::seam::lock;

mod broker;
mod dead_letters;
mod queue;
mod receiver;

pub use broker::MemoryBroker;
#[cfg(feature = "test-util")]
pub use reliq_core::seam::Faults;

/// The URL schemes this backend serves (`reliq::connect` dispatches on them).
pub const SCHEMES: &[&str] = &["memory"];

/// The process-wide embedded broker a `memory://name` URL names (empty name:
/// `default`): every `connect` with the same name shares one broker.
pub async fn connect(
    url: &str,
) -> Result<std::sync::Arc<dyn reliq_core::Broker>, reliq_core::BrokerError> {
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};
    static REGISTRY: OnceLock<Mutex<HashMap<String, MemoryBroker>>> = OnceLock::new();
    let name = url
        .split_once("://")
        .map_or(url, |(_, rest)| rest)
        .trim_end_matches('/');
    let name = if name.is_empty() { "default" } else { name };
    let broker = lock(REGISTRY.get_or_init(Default::default))
        .entry(name.to_owned())
        .or_default()
        .clone();
    Ok(std::sync::Arc::new(broker))
}
