//! The seam between the runtime and a backend: [`Broker`] and [`Receiver`].
//!
//! A backend implements a few small primitives, each mapped to its broker's native
//! mechanism (see the backend crate's docs for the mapping). Everything else — handling,
//! classification, the retry decision, the dead-letter record, metrics, tracing,
//! shutdown — lives once, in [`crate::consumer`].
//!
//! Rules every backend keeps (the conformance suite checks them):
//! - `publish` returns only after the broker confirmed the message (a confirm, a PubAck,
//!   a delivery report, a 200); an unroutable destination is an error.
//! - `retry` and `dead_letter` make the copy durable (confirmed) *before* they settle the
//!   source delivery; when they fail, the source is left unsettled — the runtime then
//!   calls `release`.
//! - `receive` never hands out more than [`Subscription::prefetch`] unsettled deliveries.

use std::any::Any;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use crate::backlog::Backlog;
use crate::classify::{BoxError, DecodeError};
use crate::dead_letters::DeadLetters;
use crate::envelope::Envelope;
use crate::headers::{self, Origin};
use crate::message::{Headers, Message, MessageId};
use crate::topology::{LiveTopology, Plan, TopologyReport};

/// Errors a backend reports. Each keeps the client error that caused it, where there was
/// one, as its [`source`](std::error::Error::source); the built-in [`Classifier`] reads
/// the variant (a timeout or a lost connection is transient, an unroutable destination or
/// a bad configuration permanent), so a handler that returns one — its own publish failed
/// — gets the retry budget the failure deserves.
///
/// [`Classifier`]: crate::Classifier
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BrokerError {
    /// The destination does not exist / nothing is bound to receive the message.
    #[error("destination `{0}` is unroutable (does not exist or nothing is bound to it)")]
    Unroutable(String),
    /// The broker refused the message (negative confirm, rejected publish, quota).
    #[error("broker rejected the message: {reason}")]
    Rejected {
        /// What the broker said.
        reason: String,
        /// The client's error, if there was one.
        #[source]
        source: Option<BoxError>,
    },
    /// No confirmation arrived in time.
    #[error("timed out after {0:?} waiting for the broker")]
    Timeout(Duration),
    /// The connection or channel is gone.
    #[error("connection lost: {context}")]
    Connection {
        /// What was being done, and what went wrong.
        context: String,
        /// The client's error, if there was one.
        #[source]
        source: Option<BoxError>,
    },
    /// The receiver was closed.
    #[error("receiver closed")]
    Closed,
    /// A delivery was settled on a receiver that did not hand it out (another consumer's,
    /// or one from before a reconnect). Nothing was settled; the delivery stays with the
    /// receiver that owns it.
    #[error("the delivery was handed out by another receiver; settle it on its own")]
    ForeignDelivery,
    /// This receiver no longer holds the delivery (the channel it came on closed, its
    /// lease ended, its partition was revoked): nothing was settled, and the broker
    /// delivers it again. The runtime stops settling it and does not release it.
    #[error("the delivery is no longer held by this receiver: {0}")]
    NotHeld(String),
    /// The backend cannot do this.
    #[error("not supported by the {backend} backend: {what}")]
    Unsupported {
        /// The backend.
        backend: &'static str,
        /// The operation.
        what: &'static str,
    },
    /// The broker refused this principal an operation on a resource (a missing ACL or
    /// permission). Another try is refused the same way until an operator grants it:
    /// `reliq topology permissions` prints what the consumer needs.
    #[error("not authorized: {resource}: {reason}")]
    Unauthorized {
        /// The resource the broker named (`topic orders.billing.dlq`, `group billing`).
        resource: String,
        /// What was being done, and what the broker said.
        reason: String,
        /// The client's error, if there was one.
        #[source]
        source: Option<BoxError>,
    },
    /// Invalid configuration or URL; names the field.
    #[error("invalid configuration `{field}`: {reason}")]
    Config {
        /// The setting or URL part.
        field: String,
        /// What is wrong.
        reason: String,
    },
    /// Any other client error.
    #[error(transparent)]
    Other(BoxError),
}

impl BrokerError {
    /// [`BrokerError::Connection`] without a client error behind it.
    pub fn connection(context: impl Into<String>) -> Self {
        Self::Connection {
            context: context.into(),
            source: None,
        }
    }

    /// [`BrokerError::Rejected`] without a client error behind it.
    pub fn rejected(reason: impl Into<String>) -> Self {
        Self::Rejected {
            reason: reason.into(),
            source: None,
        }
    }

    /// Keep `cause` as the source of a [`BrokerError::Connection`] or
    /// [`BrokerError::Rejected`] (other variants are returned unchanged).
    pub fn caused_by(mut self, cause: impl Into<BoxError>) -> Self {
        if let Self::Connection { source, .. } | Self::Rejected { source, .. } = &mut self {
            *source = Some(cause.into());
        }
        self
    }

    /// A short, stable name of the variant — the `kind` label of
    /// `reliq_publish_failures_total` and the spans' `error.type`: `unroutable`,
    /// `rejected`, `timeout`, `connection`, `closed`, `foreign_delivery`, `not_held`,
    /// `unsupported`, `unauthorized`, `config`, `other`.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Unroutable(_) => "unroutable",
            Self::Rejected { .. } => "rejected",
            Self::Timeout(_) => "timeout",
            Self::Connection { .. } => "connection",
            Self::Closed => "closed",
            Self::ForeignDelivery => "foreign_delivery",
            Self::NotHeld(_) => "not_held",
            Self::Unsupported { .. } => "unsupported",
            Self::Unauthorized { .. } => "unauthorized",
            Self::Config { .. } => "config",
            Self::Other(_) => "other",
        }
    }

    /// The class the built-in classifier gives this error (`None`: ask its source).
    pub(crate) fn class(&self) -> Option<crate::ErrorClass> {
        use crate::ErrorClass::{Permanent, Transient};
        match self {
            // Nothing was delivered: another try may reach a broker that is back.
            Self::Timeout(_)
            | Self::Connection { .. }
            | Self::Closed
            | Self::Rejected { .. }
            | Self::NotHeld(_) => Some(Transient),
            // No retry changes a missing route, a setting or a backend's abilities.
            Self::Unroutable(_)
            | Self::Config { .. }
            | Self::Unauthorized { .. }
            | Self::Unsupported { .. }
            | Self::ForeignDelivery => Some(Permanent),
            Self::Other(_) => None,
        }
    }
}

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
    /// [`Broker::send_to_consumer`] is supported (replay goes to one consumer only).
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
    /// Retries wait apart from the source, where [`Broker::backlog`] counts them
    /// ([`Backlog::retries`]): retry topics, TTL queues, schedules. False where a retry
    /// waits invisible in the source queue (SQS) or in the consumer process (Kafka's
    /// blocking mode).
    pub retries_counted_apart: bool,
}

/// Which receiver handed a delivery out: unique in the process. A backend's receiver
/// takes one ([`ReceiverId::next`]), stamps it on every [`DeliveryToken`] it makes and
/// checks it ([`DeliveryToken::check`]) before settling.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ReceiverId(u64);

impl ReceiverId {
    /// A fresh id.
    pub fn next() -> Self {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        Self(NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
    }
}

/// Opaque, backend-specific settlement handle carried by a [`Delivery`]: which receiver
/// made it, a number (delivery tag, offset, slot), a second number (partition, channel
/// generation) and anything else the backend needs (ack subject, receipt handle).
pub struct DeliveryToken {
    receiver: ReceiverId,
    tag: u64,
    lane: i64,
    extra: Option<Box<dyn Any + Send + Sync>>,
}

impl DeliveryToken {
    /// A token of `receiver` with a tag.
    pub fn new(receiver: ReceiverId, tag: u64) -> Self {
        Self {
            receiver,
            tag,
            lane: 0,
            extra: None,
        }
    }

    /// With a second number (partition, channel generation).
    pub fn with_lane(mut self, lane: i64) -> Self {
        self.lane = lane;
        self
    }

    /// With backend data (ack subject, receipt handle), read back with
    /// [`DeliveryToken::extra`].
    pub fn with_extra<T: Any + Send + Sync>(mut self, extra: T) -> Self {
        self.extra = Some(Box::new(extra));
        self
    }

    /// The receiver that made it.
    pub fn receiver(&self) -> ReceiverId {
        self.receiver
    }

    /// The tag.
    pub fn tag(&self) -> u64 {
        self.tag
    }

    /// The second number.
    pub fn lane(&self) -> i64 {
        self.lane
    }

    /// The backend data, if it is a `T`.
    pub fn extra<T: Any>(&self) -> Option<&T> {
        self.extra.as_ref()?.downcast_ref::<T>()
    }

    /// The backend's part of this token, if `receiver` made it (and it holds a `T`);
    /// [`BrokerError::ForeignDelivery`] otherwise. The one check a backend's settle
    /// methods start with.
    pub fn extra_of<T: Any>(&self, receiver: ReceiverId) -> Result<&T, BrokerError> {
        self.check(receiver)?
            .extra::<T>()
            .ok_or(BrokerError::ForeignDelivery)
    }

    /// This token, if `receiver` made it; [`BrokerError::ForeignDelivery`] otherwise.
    pub fn check(&self, receiver: ReceiverId) -> Result<&Self, BrokerError> {
        if self.receiver == receiver {
            Ok(self)
        } else {
            Err(BrokerError::ForeignDelivery)
        }
    }
}

impl fmt::Debug for DeliveryToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeliveryToken")
            .field("receiver", &self.receiver)
            .field("tag", &self.tag)
            .field("lane", &self.lane)
            .finish_non_exhaustive()
    }
}

/// A message a backend hands over before decoding it, so that what nobody reads is never
/// decoded (Kafka: librdkafka parses a record's headers only when asked, and that parse
/// is most of a record's cost).
///
/// The payload and the key are read in place; everything else — the id, the headers —
/// comes from [`RawMessage::message`], which decodes the whole message the first time it
/// is called and returns the same message after that. The attempt of a delivery built
/// from a raw message is its `reliq-attempt` header ([`headers::attempt`]).
pub trait RawMessage: Send + Sync + 'static {
    /// The payload bytes, without decoding anything else.
    fn payload(&self) -> &[u8];
    /// The key bytes as the broker holds them, without decoding anything else.
    fn key(&self) -> Option<&[u8]>;
    /// The decoded message (decoded once, on the first call).
    fn message(&self) -> &Message;
}

enum Body {
    Decoded(Message),
    Raw(Box<dyn RawMessage>),
    /// A recycled delivery waiting in its [`DeliveryPool`]: never seen outside it.
    Vacant,
}

struct DeliveryInner {
    body: Body,
    /// Set when built; for a raw message, read from its headers on first use.
    attempt: std::sync::OnceLock<u32>,
    origin: Origin,
    token: DeliveryToken,
    published_at: Option<std::time::SystemTime>,
    /// Where the allocation goes when the last clone drops (pooled deliveries only).
    pool: Option<DeliveryPool>,
}

/// One delivery of a message to a consumer: the message, its attempt number, where it
/// came from, and the backend's settlement token. Cheap to clone (shared).
#[derive(Clone)]
pub struct Delivery(Arc<DeliveryInner>);

impl Drop for Delivery {
    fn drop(&mut self) {
        if self.0.pool.is_none() {
            return;
        }
        // Only the last clone recycles (`get_mut` is `None` while another exists).
        let Some(inner) = Arc::get_mut(&mut self.0) else {
            return;
        };
        let Some(pool) = inner.pool.take() else {
            return;
        };
        // The message's memory goes now, not when the slot is reused; the pool holds
        // empty slots only (and, without `pool`, no reference back to itself).
        inner.body = Body::Vacant;
        inner.token.extra = None;
        inner.origin.route = None;
        pool.put(Arc::clone(&self.0));
    }
}

/// Recycles the allocations of one receiver's deliveries, so that a steady stream of
/// them allocates nothing: a delivery made by [`DeliveryPool::delivery`] returns to the
/// pool, emptied of its message, when its last clone drops, and the next one reuses it.
/// Holds at most `capacity` free slots (about the receiver's prefetch; more are freed).
#[derive(Clone)]
pub struct DeliveryPool(Arc<PoolShared>);

struct PoolShared {
    free: std::sync::Mutex<Vec<Arc<DeliveryInner>>>,
    capacity: usize,
}

impl fmt::Debug for DeliveryPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeliveryPool")
            .field("capacity", &self.0.capacity)
            .finish_non_exhaustive()
    }
}

impl DeliveryPool {
    /// A pool keeping up to `capacity` free delivery slots.
    pub fn new(capacity: usize) -> Self {
        Self(Arc::new(PoolShared {
            free: std::sync::Mutex::new(Vec::with_capacity(capacity)),
            capacity,
        }))
    }

    /// [`Delivery::new`] in a recycled slot when one is free.
    pub fn delivery(
        &self,
        message: Message,
        attempt: u32,
        origin: Origin,
        token: DeliveryToken,
    ) -> Delivery {
        let fields = DeliveryInner {
            body: Body::Decoded(message),
            attempt: std::sync::OnceLock::from(attempt.max(1)),
            origin,
            token,
            published_at: None,
            pool: Some(self.clone()),
        };
        let recycled = self.lock().pop();
        match recycled {
            Some(mut slot) => match Arc::get_mut(&mut slot) {
                Some(vacant) => {
                    *vacant = fields;
                    Delivery(slot)
                }
                None => Delivery(Arc::new(fields)),
            },
            None => Delivery(Arc::new(fields)),
        }
    }

    /// Free slots held now.
    pub fn free(&self) -> usize {
        self.lock().len()
    }

    fn put(&self, slot: Arc<DeliveryInner>) {
        let mut free = self.lock();
        if free.len() < self.0.capacity {
            free.push(slot);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Arc<DeliveryInner>>> {
        // A panic while the lock was held cannot leave the list inconsistent.
        self.0
            .free
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// What a vacant slot's accessors return; never reached (a vacant slot is only in its
/// pool), but total rather than a panic.
fn vacant_message() -> &'static Message {
    static VACANT: std::sync::LazyLock<Message> =
        std::sync::LazyLock::new(|| Message::with_id_and_payload("", bytes::Bytes::new()));
    &VACANT
}

impl fmt::Debug for Delivery {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Delivery")
            .field("id", self.id())
            .field("attempt", &self.0.attempt)
            .field("origin", &self.0.origin)
            .finish_non_exhaustive()
    }
}

impl Delivery {
    /// Built by backends.
    pub fn new(message: Message, attempt: u32, origin: Origin, token: DeliveryToken) -> Self {
        Self(Arc::new(DeliveryInner {
            body: Body::Decoded(message),
            attempt: std::sync::OnceLock::from(attempt.max(1)),
            origin,
            token,
            published_at: None,
            pool: None,
        }))
    }

    /// Built by backends that decode on demand (see [`RawMessage`]); the attempt is the
    /// message's `reliq-attempt` header.
    pub fn raw(message: Box<dyn RawMessage>, origin: Origin, token: DeliveryToken) -> Self {
        Self(Arc::new(DeliveryInner {
            body: Body::Raw(message),
            attempt: std::sync::OnceLock::new(),
            origin,
            token,
            published_at: None,
            pool: None,
        }))
    }

    /// Built by backends whose broker records when the message was first published
    /// (stream timestamp, record timestamp, `SentTimestamp`). The runtime measures the
    /// policy's max age from it when the message has no `reliq-occurred-at` header and no
    /// earlier failure was recorded in its headers (brokers that retry in place).
    pub fn with_published_at(
        message: Message,
        attempt: u32,
        origin: Origin,
        token: DeliveryToken,
        published_at: std::time::SystemTime,
    ) -> Self {
        Self(Arc::new(DeliveryInner {
            body: Body::Decoded(message),
            attempt: std::sync::OnceLock::from(attempt.max(1)),
            origin,
            token,
            published_at: Some(published_at),
            pool: None,
        }))
    }

    /// When the broker says the message was first published, if it says.
    pub fn published_at(&self) -> Option<std::time::SystemTime> {
        self.0.published_at
    }

    /// The message (decoded now if the backend handed it over raw).
    pub fn message(&self) -> &Message {
        match &self.0.body {
            Body::Decoded(m) => m,
            Body::Raw(raw) => raw.message(),
            Body::Vacant => vacant_message(),
        }
    }

    /// The stable message id.
    pub fn id(&self) -> &MessageId {
        self.message().id()
    }

    /// The message key.
    pub fn key(&self) -> Option<&str> {
        match &self.0.body {
            Body::Decoded(m) => m.key(),
            // In place when it is text; otherwise as decoding makes it (lossy).
            Body::Raw(raw) => match raw.key().map(std::str::from_utf8) {
                None => None,
                Some(Ok(key)) => Some(key),
                Some(Err(_)) => raw.message().key(),
            },
            Body::Vacant => None,
        }
    }

    /// The payload bytes.
    pub fn payload(&self) -> &[u8] {
        match &self.0.body {
            Body::Decoded(m) => m.payload(),
            Body::Raw(raw) => raw.payload(),
            Body::Vacant => &[],
        }
    }

    /// The headers.
    pub fn headers(&self) -> &Headers {
        self.message().headers()
    }

    /// The 1-based delivery attempt (1 = first delivery).
    pub fn attempt(&self) -> u32 {
        *self
            .0
            .attempt
            .get_or_init(|| headers::attempt(self.headers()))
    }

    /// Where the message was consumed from.
    pub fn origin(&self) -> &Origin {
        &self.0.origin
    }

    /// The backend's settlement token.
    pub fn token(&self) -> &DeliveryToken {
        &self.0.token
    }

    /// The payload as UTF-8 text; invalid UTF-8 is poison.
    pub fn text(&self) -> Result<&str, DecodeError> {
        Ok(std::str::from_utf8(self.payload())?)
    }

    /// The payload decoded as JSON; a decode error is poison.
    pub fn json<T: serde::de::DeserializeOwned>(&self) -> Result<T, DecodeError> {
        Ok(serde_json::from_slice(self.payload())?)
    }

    /// The payload decoded as an [`Envelope`] with `data: T`, checking the schema's
    /// major version; any failure is poison.
    pub fn envelope<T: serde::de::DeserializeOwned>(
        &self,
        supported_major: u32,
    ) -> Result<Envelope<T>, DecodeError> {
        Envelope::decode(self.payload(), supported_major)
    }

    /// The W3C `traceparent` header, if any.
    pub fn traceparent(&self) -> Option<&str> {
        self.headers().get(headers::TRACEPARENT)
    }
}

/// A retry: the copy to deliver later (same id, next attempt, failure headers) and how
/// long the broker must hold it.
#[derive(Clone, Debug)]
pub struct RetryRequest {
    /// The copy to deliver later. Backends that retry in place (NATS `NakWithDelay`,
    /// SQS visibility) ignore it and derive the attempt from the broker's count.
    pub message: Message,
    /// How long to wait.
    pub delay: Duration,
    /// Index into [`Subscription::retry_tiers`] (for tiered brokers).
    pub tier: usize,
}

/// A message broker connection.
#[async_trait]
pub trait Broker: Send + Sync + 'static {
    /// The backend's name: `memory`, `kafka`, `rabbit`, `nats`, `sqs`.
    fn kind(&self) -> &'static str;

    /// What this backend can and cannot do.
    fn capabilities(&self) -> Capabilities;

    /// Publish and wait for the broker's confirmation.
    async fn publish(&self, destination: &Destination, message: Message)
    -> Result<(), BrokerError>;

    /// Declare the subscription's topology (idempotently) and start receiving.
    async fn subscribe(
        &self,
        subscription: &Subscription,
    ) -> Result<Box<dyn Receiver>, BrokerError>;

    /// This consumer's dead-letter queue, read without consuming it (see
    /// [`DeadLetters`]): for the replay engine and the operator tools.
    async fn dead_letters(
        &self,
        subscription: &Subscription,
    ) -> Result<Box<dyn DeadLetters>, BrokerError>;

    /// What waits in the broker for this consumer: unreceived messages, deliveries not
    /// settled, retries on each tier ([`Backlog`] says per broker what each number is).
    /// Read from the broker's own counters, cheaply enough for a poller to call every
    /// few seconds. The subscription's topology must exist: a missing queue or stream is
    /// an error, never a zero.
    async fn backlog(&self, subscription: &Subscription) -> Result<Backlog, BrokerError>;

    /// The objects and settings a consumer with this subscription needs at the broker —
    /// what [`Broker::subscribe`] declares, and the settings that change what the broker
    /// does to its messages (see [`topology`](crate::topology)). Reads nothing that
    /// changes; may ask the broker for its version.
    async fn plan(&self, subscription: &Subscription) -> Result<Plan, BrokerError>;

    /// The planned objects as the broker has them now, and this consumer's objects the
    /// plan does not have (an earlier policy's retry tiers, with what they hold).
    /// Changes nothing.
    async fn inspect(
        &self,
        subscription: &Subscription,
        plan: &Plan,
    ) -> Result<LiveTopology, BrokerError>;

    /// The plan and every difference the broker has from it.
    async fn check_topology(
        &self,
        subscription: &Subscription,
    ) -> Result<TopologyReport, BrokerError> {
        let plan = self.plan(subscription).await?;
        let live = self.inspect(subscription, &plan).await?;
        Ok(TopologyReport::new(plan, &live))
    }

    /// What the credentials of a service with this `access` must allow at the broker —
    /// derived from the same names as [`Broker::plan`], so least privilege is generated,
    /// not guessed. Reads nothing from the broker. Backends that cannot say return
    /// [`BrokerError::Unsupported`].
    async fn permissions(
        &self,
        access: &crate::permissions::Access,
    ) -> Result<crate::permissions::Permissions, BrokerError> {
        let _ = access;
        Err(BrokerError::Unsupported {
            backend: self.kind(),
            what: "permissions",
        })
    }

    /// Deliver `message` to this consumer only (not to every consumer of its source),
    /// confirmed. Used by replay. Backends without a per-consumer input return
    /// [`BrokerError::Unsupported`].
    async fn send_to_consumer(
        &self,
        subscription: &Subscription,
        message: Message,
    ) -> Result<(), BrokerError> {
        let _ = (subscription, message);
        Err(BrokerError::Unsupported {
            backend: self.kind(),
            what: "send_to_consumer",
        })
    }
}

/// A bounded stream of deliveries for one subscription, and how to settle them.
///
/// Each delivery is settled exactly once by the runtime: `ack`, `retry`, `dead_letter`,
/// or `release`. When `retry`/`dead_letter` fail, the delivery is still unsettled.
/// Dropping the receiver returns every unsettled delivery to the broker.
#[async_trait]
pub trait Receiver: Send + Sync {
    /// The next delivery; waits. [`BrokerError::Closed`] once closed.
    ///
    /// # Cancel safety
    ///
    /// Must be cancel safe: if the future is dropped before it completes, no delivery is
    /// lost — whatever it took from the broker stays with the receiver (buffered for the
    /// next receive) or goes back to the broker.
    async fn receive(&self) -> Result<Delivery, BrokerError>;

    /// Append up to `max` deliveries to `into`: waits for the first, then takes only what
    /// is ready without waiting. Each delivery counts against the prefetch bound as if
    /// received alone. The runtime receives through this, so a backend whose client
    /// already holds records in memory (Kafka's fetch queue) pays its per-receive cost —
    /// a lock, a wake-up — once per batch. The default takes one delivery.
    ///
    /// # Cancel safety
    ///
    /// Must be cancel safe, and the runtime relies on it at shutdown: a delivery taken
    /// from the broker is either pushed into `into` before the next `.await` point or
    /// kept by the receiver for the next receive. When the future is dropped, what is in
    /// `into` is the caller's (the runtime releases it); nothing else is lost or left
    /// leased.
    async fn receive_batch(&self, max: usize, into: &mut Vec<Delivery>) -> Result<(), BrokerError> {
        let _ = max;
        into.push(self.receive().await?);
        Ok(())
    }

    /// [`Receiver::receive_batch`] when deliveries are ready now: appends up to `max` of
    /// them to `into` without waiting and returns `true` if it took any. `false` (the
    /// default): nothing ready, or no such shortcut — the runtime then waits in
    /// `receive_batch`. For a backend that hands out what is ready without I/O (the
    /// embedded broker, under its lock), so that the busy path awaits no boxed future.
    fn try_receive_batch(&self, max: usize, into: &mut Vec<Delivery>) -> bool {
        let _ = (max, into);
        false
    }

    /// The work is done: remove/commit.
    async fn ack(&self, delivery: &Delivery) -> Result<(), BrokerError>;

    /// [`Receiver::ack`] for several deliveries (a batch handler's successes); returns
    /// the failures, by index into `deliveries` (empty: all acknowledged). The default
    /// acks each, concurrently (SQS's delete batcher turns concurrent acks into
    /// `DeleteMessageBatch` calls); a backend that settles many at once cheaper overrides
    /// it (Kafka: one lock for the batch's offsets).
    async fn ack_batch(&self, deliveries: &[Delivery]) -> Vec<(usize, BrokerError)> {
        let acks = futures::future::join_all(deliveries.iter().map(|d| self.ack(d))).await;
        acks.into_iter()
            .enumerate()
            .filter_map(|(i, r)| r.err().map(|e| (i, e)))
            .collect()
    }

    /// [`Receiver::ack_batch`] for a backend whose acknowledgement is a local step that
    /// never waits (the embedded broker; Kafka's offset store): `Some(failures)` when it
    /// acknowledged `deliveries`, `None` (the default) to go through `ack_batch`.
    fn try_ack_batch(&self, deliveries: &[Delivery]) -> Option<Vec<(usize, BrokerError)>> {
        let _ = deliveries;
        None
    }

    /// Hold a copy for `retry.delay`, confirmed, *then* settle the source.
    async fn retry(&self, delivery: &Delivery, retry: RetryRequest) -> Result<(), BrokerError>;

    /// Put `dead` (the message with the dead-letter record in its headers) on this
    /// consumer's DLQ, confirmed, *then* settle the source.
    async fn dead_letter(&self, delivery: &Delivery, dead: Message) -> Result<(), BrokerError>;

    /// Give the delivery back unsettled, to be delivered again after about `delay`
    /// (immediately where the broker cannot delay a release).
    async fn release(&self, delivery: &Delivery, delay: Duration) -> Result<(), BrokerError>;

    /// Stop receiving; unsettled deliveries go back to the broker.
    async fn close(&self) -> Result<(), BrokerError> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::OnceLock;
    use std::sync::atomic::{AtomicU32, Ordering};

    /// A raw message that counts its decodes.
    struct Counted {
        payload: &'static [u8],
        key: Option<&'static [u8]>,
        decodes: Arc<AtomicU32>,
        decoded: OnceLock<Message>,
    }

    impl RawMessage for Counted {
        fn payload(&self) -> &[u8] {
            self.payload
        }
        fn key(&self) -> Option<&[u8]> {
            self.key
        }
        fn message(&self) -> &Message {
            self.decoded.get_or_init(|| {
                self.decodes.fetch_add(1, Ordering::SeqCst);
                let key = self.key.map(|k| String::from_utf8_lossy(k).into_owned());
                let mut m = Message::with_id_and_payload("id-1", self.payload)
                    .with_header(headers::ATTEMPT, "3");
                if let Some(k) = key {
                    m = m.with_key(k);
                }
                m
            })
        }
    }

    fn raw(key: Option<&'static [u8]>) -> (Delivery, Arc<AtomicU32>) {
        let decodes = Arc::new(AtomicU32::new(0));
        let message = Counted {
            payload: b"body",
            key,
            decodes: decodes.clone(),
            decoded: OnceLock::new(),
        };
        let d = Delivery::raw(
            Box::new(message),
            Origin::default(),
            DeliveryToken::new(ReceiverId::next(), 7),
        );
        (d, decodes)
    }

    #[test]
    fn a_raw_delivery_decodes_once_and_only_when_more_than_payload_or_key_is_read() {
        let (d, decodes) = raw(Some(b"customer-7"));
        assert_eq!(d.payload(), b"body");
        assert_eq!(d.key(), Some("customer-7"));
        assert_eq!(d.token().tag(), 7);
        assert_eq!(
            decodes.load(Ordering::SeqCst),
            0,
            "payload and key read in place"
        );
        assert_eq!(d.id().as_str(), "id-1");
        assert_eq!(
            d.attempt(),
            3,
            "the attempt comes from the reliq-attempt header"
        );
        assert_eq!(d.message().payload().as_ref(), b"body");
        assert_eq!(d.clone().headers().get(headers::ATTEMPT), Some("3"));
        assert_eq!(decodes.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_raw_key_that_is_not_text_reads_as_decoding_makes_it() {
        let (d, decodes) = raw(Some(b"k\xff"));
        assert_eq!(d.key(), Some("k\u{fffd}"));
        assert_eq!(decodes.load(Ordering::SeqCst), 1);
        let (d, _) = raw(None);
        assert_eq!(d.key(), None);
    }
}
