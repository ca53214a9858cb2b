//! What a consumer asks a backend for ([`Subscription`]), where a producer sends
//! ([`Destination`]) and what a backend can do ([`Capabilities`]).

use std::fmt;
use std::time::Duration;

use crate::error::BrokerError;

/// Where a producer sends a message: a topic / exchange / stream / queue, plus an
/// optional route (AMQP routing key, NATS subject suffix).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Destination {
    /// Topic, exchange, stream or queue.
    pub topic: String,
    /// Routing key / subject, where the broker routes by one.
    pub route: Option<String>,
}

impl Destination {
    /// A destination without a route.
    pub fn new(topic: impl Into<String>) -> Self {
        Self {
            topic: topic.into(),
            route: None,
        }
    }

    /// Add a route (routing key / subject).
    pub fn with_route(mut self, route: impl Into<String>) -> Self {
        self.route = Some(route.into());
        self
    }
}

impl From<&str> for Destination {
    fn from(topic: &str) -> Self {
        Self::new(topic)
    }
}

impl fmt::Display for Destination {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.route {
            Some(r) => write!(f, "{}/{}", self.topic, r),
            None => f.write_str(&self.topic),
        }
    }
}

/// What a consumer asks a backend for: one consumer (group) reading one source.
///
/// Backends derive every name they declare from it (retry queues/topics, the DLQ), so
/// two consumers of one source never share a retry route or a DLQ.
#[derive(Clone, Debug, PartialEq)]
pub struct Subscription {
    /// Consumer / group name.
    pub consumer: String,
    /// Topic / exchange / stream / queue to read.
    pub source: String,
    /// Routing-key pattern / subject filter (`*` one word, `#` any number), if any.
    pub filter: Option<String>,
    /// Most unsettled deliveries this receiver may hold (basic.qos, max_ack_pending …).
    pub prefetch: u32,
    /// Delay tiers the retry policy can ask for (brokers with fixed delay queues declare
    /// one per tier).
    pub retry_tiers: Vec<Duration>,
    /// The broker-side delivery limit (crash-loop safety net), above the policy's attempts.
    pub delivery_limit: u32,
    /// How long a delivery stays leased to this receiver before the broker may hand it
    /// out again (ack wait / visibility timeout); handlers longer than this are kept
    /// leased by the backend where it can extend leases.
    pub lease: Duration,
}

impl Subscription {
    /// A subscription with defaults: prefetch 64, no retry tiers, delivery limit 20,
    /// lease 30 s.
    pub fn new(consumer: impl Into<String>, source: impl Into<String>) -> Self {
        Self {
            consumer: consumer.into(),
            source: source.into(),
            filter: None,
            prefetch: 64,
            retry_tiers: Vec::new(),
            delivery_limit: 20,
            lease: Duration::from_secs(30),
        }
    }

    /// Set the filter.
    pub fn with_filter(mut self, filter: impl Into<String>) -> Self {
        self.filter = Some(filter.into());
        self
    }

    /// For a backend whose broker cannot filter by route: a config error naming the
    /// `filter` field when one is set, so a consumer never silently reads more than it
    /// asked for.
    pub fn refuse_filter(&self, broker: &str) -> Result<(), BrokerError> {
        match &self.filter {
            None => Ok(()),
            Some(pattern) => Err(BrokerError::Config {
                field: "filter".into(),
                reason: format!(
                    "{broker} cannot filter what a consumer reads (filter `{pattern}`): publish what this consumer needs to a source of its own"
                ),
            }),
        }
    }

    /// Conventional name of this consumer's dead-letter queue: `<source>.<consumer>.dlq`.
    pub fn dead_letter_name(&self) -> String {
        format!("{}.{}.dlq", self.source, self.consumer)
    }

    /// Conventional name of this consumer's retry route for `tier`:
    /// `<source>.<consumer>.retry.<delay in ms>`.
    pub fn retry_name(&self, delay: Duration) -> String {
        format!(
            "{}.{}.retry.{}ms",
            self.source,
            self.consumer,
            delay.as_millis()
        )
    }
}

/// What a backend can and cannot do. A flag documents a broker limitation; it is never a
/// way to hide a failure.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Capabilities {
    /// Publishing to a destination nobody declared fails (false where the broker
    /// auto-creates destinations, e.g. Kafka with `auto.create.topics.enable`).
    pub rejects_unroutable: bool,
    /// Retries wait for the exact requested delay (true), or for the nearest fixed tier
    /// (false: Kafka topics, RabbitMQ TTL queues).
    pub exact_retry_delay: bool,
    /// The broker enforces a delivery limit that catches crash loops.
    pub delivery_limit: bool,
    /// [`Broker::send_to_consumer`](crate::broker::Broker::send_to_consumer) is supported (replay goes to one consumer only).
    pub consumer_redelivery: bool,
    /// The attempt number is the broker's delivery count (NATS `delivered`, SQS
    /// `ApproximateReceiveCount`), so every delivery — including one after a release or a
    /// crash — counts as an attempt. False where reliq carries the attempt in a header.
    pub attempts_count_every_delivery: bool,
    /// The broker drops a second publish of the same message id within a window (NATS
    /// `Nats-Msg-Id`, SQS FIFO deduplication): a producer retry never reaches consumers.
    pub deduplicates_publishes: bool,
    /// A [`Subscription::filter`] narrows what the consumer reads (routing-key bindings,
    /// subject filters, filter tags). False where the broker cannot filter (Kafka):
    /// subscribing with a filter then fails naming it ([`Subscription::refuse_filter`]).
    pub filters: bool,
    /// Retries wait apart from the source, where [`Broker::backlog`](crate::broker::Broker::backlog) counts them
    /// ([`Backlog::retries`](crate::backlog::Backlog::retries)): retry topics, TTL queues, schedules. False where a retry
    /// waits invisible in the source queue (SQS) or in the consumer process (Kafka's
    /// blocking mode).
    pub retries_counted_apart: bool,
}
