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

    /// Refuse a consumer or source name a broker object cannot safely be named after —
    /// before it reaches a broker. Allowed: 1 to [`MAX_NAME_LEN`] ASCII letters, digits,
    /// `.`, `_` and `-`, not starting with `.` (the characters every backend can name a
    /// topic, queue or stream with; so `../../etc`, spaces, wildcards and control
    /// characters are refused). The consumer builder, the admin API and the `reliq`
    /// command check every name they are given.
    pub fn check_names(&self) -> Result<(), NameError> {
        check_name("consumer", &self.consumer)?;
        check_name("source", &self.source)
    }

    /// [`BrokerError::NotFound`] for this consumer's dead-letter queue: `object` is what
    /// the broker lacks (`` stream `DLQ_orders_billing` ``). What a backend's
    /// [`Broker::dead_letters`](crate::Broker::dead_letters) answers instead of creating it.
    pub fn missing_dead_letters(&self, object: impl fmt::Display) -> BrokerError {
        BrokerError::NotFound(format!(
            "consumer `{}` of `{}` has no dead-letter queue ({object} does not exist; the \
             consumer declares it when it first subscribes)",
            self.consumer, self.source
        ))
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

/// `name` with every character other than an ASCII letter, digit, `-` or `_` replaced by
/// `_`: what NATS stream names, SQS queue names and AsyncAPI identifiers allow.
pub fn word_characters(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// The longest consumer or source name [`Subscription::check_names`] accepts: the longest
/// name a backend derives from two (`<source>.<consumer>.retry.<ms>ms`) stays within
/// Kafka's 249 characters.
pub const MAX_NAME_LEN: usize = 100;

/// A consumer or source name no broker object may be named after
/// ([`Subscription::check_names`]).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid `{field}` name `{value}`: {reason}")]
pub struct NameError {
    /// Which name: `consumer` or `source`.
    pub field: &'static str,
    /// The name given, escaped and cut to 80 characters.
    pub value: String,
    /// What is wrong with it.
    pub reason: &'static str,
}

fn check_name(field: &'static str, name: &str) -> Result<(), NameError> {
    let reason = if name.is_empty() {
        "must not be empty"
    } else if name.chars().count() > MAX_NAME_LEN {
        "longer than 100 characters"
    } else if !name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
    {
        "may hold only ASCII letters, digits, `.`, `_` and `-`"
    } else if name.starts_with('.') {
        "must not start with `.`"
    } else {
        return Ok(());
    };
    Err(NameError {
        field,
        value: name
            .chars()
            .take(80)
            .collect::<String>()
            .escape_debug()
            .to_string(),
        reason,
    })
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

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(consumer: &str, source: &str) -> Option<NameError> {
        Subscription::new(consumer, source).check_names().err()
    }

    #[test]
    fn names_every_backend_can_use_are_accepted() {
        for name in [
            "billing",
            "orders.v2",
            "Billing_EU-1",
            "a",
            &"x".repeat(MAX_NAME_LEN),
        ] {
            assert_eq!(refused(name, name), None, "{name}");
        }
    }

    #[test]
    fn traversal_wildcards_spaces_and_overlong_names_are_refused_naming_the_field() {
        let cases = [
            ("../../etc", "orders", "consumer", "may hold only"),
            ("billing", "orders/../x", "source", "may hold only"),
            ("billing", "orders.>", "source", "may hold only"),
            ("bill ing", "orders", "consumer", "may hold only"),
            ("bill\ning", "orders", "consumer", "may hold only"),
            ("..", "orders", "consumer", "must not start with `.`"),
            ("", "orders", "consumer", "must not be empty"),
            ("billing", "", "source", "must not be empty"),
            (
                "billing",
                &"o".repeat(MAX_NAME_LEN + 1),
                "source",
                "longer than 100",
            ),
        ];
        for (consumer, source, field, reason) in cases {
            let e = refused(consumer, source).unwrap_or_else(|| panic!("{consumer:?} {source:?}"));
            assert_eq!(e.field, field, "{consumer:?} {source:?}");
            assert!(e.reason.starts_with(reason), "{e}");
            assert!(
                e.value.chars().count() <= 80 + 2 && !e.value.contains('\n'),
                "{e}"
            );
        }
    }
}
