//! A received message and how it is settled: [`Delivery`], its [`DeliveryToken`], the
//! [`RawMessage`] a backend may hand out instead of a decoded one, [`DeliveryPool`] and
//! the [`RetryRequest`] a retry sends.

use crate::sync::lock;
use std::any::Any;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::classify::DecodeError;
use crate::envelope::Envelope;
use crate::error::BrokerError;
use crate::headers::{self, Headers, Origin};
use crate::message::{Message, MessageId};

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
        lock(&self.0.free)
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
    /// Index into [`Subscription::retry_tiers`](crate::subscription::Subscription::retry_tiers) (for tiered brokers).
    pub tier: usize,
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
