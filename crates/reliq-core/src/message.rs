use std::fmt;
use std::sync::Arc;

use bytes::Bytes;
use serde::Serialize;

use crate::headers::{self, Headers};

/// A stable message identifier.
///
/// It is chosen once, by the producer, and never changes: not on retry, not in the
/// dead-letter queue, not on replay. Inboxes deduplicate on it. Cloning is cheap.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MessageId(Arc<str>);

impl MessageId {
    /// A new, time-ordered (UUID v7) identifier.
    pub fn generate() -> Self {
        Self(Arc::from(uuid::Uuid::now_v7().to_string()))
    }

    /// The identifier as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for MessageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl fmt::Display for MessageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<&str> for MessageId {
    fn from(value: &str) -> Self {
        Self(Arc::from(value))
    }
}

impl From<String> for MessageId {
    fn from(value: String) -> Self {
        Self(Arc::from(value))
    }
}

impl AsRef<str> for MessageId {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

/// A message: a stable id, an optional partitioning/ordering key, opaque payload bytes and
/// text headers.
///
/// ```
/// use reliq_core::Message;
/// let m = Message::new("hello").with_key("customer-7").with_header("tenant", "acme");
/// assert_eq!(m.payload().as_ref(), b"hello");
/// assert_eq!(m.key(), Some("customer-7"));
/// assert_eq!(m.headers().get("tenant"), Some("acme"));
/// ```
///
/// The unit that travels: [`Message`] (what a producer publishes) and [`Headers`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    id: MessageId,
    key: Option<String>,
    payload: Bytes,
    headers: Headers,
}

impl Message {
    /// A message with a freshly generated id.
    pub fn new(payload: impl Into<Bytes>) -> Self {
        Self::with_id_and_payload(MessageId::generate(), payload)
    }

    /// A message with a given id (use the business event's id, so retries of the producer
    /// itself keep it stable).
    pub fn with_id_and_payload(id: impl Into<MessageId>, payload: impl Into<Bytes>) -> Self {
        Self {
            id: id.into(),
            key: None,
            payload: payload.into(),
            headers: Headers::new(),
        }
    }

    /// A message whose payload is `value` encoded as JSON.
    pub fn json<T: Serialize + ?Sized>(value: &T) -> Result<Self, serde_json::Error> {
        Ok(Self::new(serde_json::to_vec(value)?))
    }

    /// Replace the id.
    pub fn with_id(mut self, id: impl Into<MessageId>) -> Self {
        self.id = id.into();
        self
    }

    /// Set the key (Kafka partition key, SQS FIFO group, per-key ordering in the runtime).
    pub fn with_key(mut self, key: impl Into<String>) -> Self {
        self.key = Some(key.into());
        self
    }

    /// Add a header.
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.insert(name, value);
        self
    }

    /// Set the correlation id header.
    pub fn with_correlation_id(self, id: impl Into<String>) -> Self {
        self.with_header(headers::CORRELATION_ID, id)
    }

    /// Set the causation id header (the id of the message that caused this one).
    pub fn with_causation_id(self, id: impl Into<String>) -> Self {
        self.with_header(headers::CAUSATION_ID, id)
    }

    /// The stable id.
    pub fn id(&self) -> &MessageId {
        &self.id
    }

    /// The key, if any.
    pub fn key(&self) -> Option<&str> {
        self.key.as_deref()
    }

    /// The payload bytes.
    pub fn payload(&self) -> &Bytes {
        &self.payload
    }

    /// The headers.
    pub fn headers(&self) -> &Headers {
        &self.headers
    }

    /// The headers, mutable.
    pub fn headers_mut(&mut self) -> &mut Headers {
        &mut self.headers
    }

    /// Split into parts: id, key, payload, headers.
    pub fn into_parts(self) -> (MessageId, Option<String>, Bytes, Headers) {
        (self.id, self.key, self.payload, self.headers)
    }

    /// Build from parts.
    pub fn from_parts(
        id: MessageId,
        key: Option<String>,
        payload: Bytes,
        headers: Headers,
    ) -> Self {
        Self {
            id,
            key,
            payload,
            headers,
        }
    }
}
