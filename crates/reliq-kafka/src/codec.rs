//! reliq messages ↔ Kafka records: the headers reliq writes on a record, and a record
//! read back as a message.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use rdkafka::message::{Header, OwnedHeaders};
use reliq_core::{Delivery, Headers, Message, MessageId, seam::headers};

/// Backend-private header: when a record on a retry topic is due (ms since the epoch),
/// overriding "record timestamp + tier delay" (used by `send_to_consumer`). Stripped
/// before the message reaches a handler.
pub const DUE_AT_HEADER: &str = "reliq-kafka-due-ms";
/// Backend-private header: partition of the record first consumed from the source,
/// carried through retry topics so a later dead letter names the original position.
pub const SOURCE_PARTITION_HEADER: &str = "reliq-kafka-source-partition";
/// Backend-private header: offset of the record first consumed from the source.
pub const SOURCE_OFFSET_HEADER: &str = "reliq-kafka-source-offset";

/// The record headers of `message`: its id ([`headers::MESSAGE_ID`]), its headers, then
/// `extra` (which replaces a header of the same name).
pub(crate) fn record_headers(message: &Message, extra: &[(&str, String)]) -> OwnedHeaders {
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
    hs
}

/// Header values and keys as text: borrowed when valid UTF-8 (the validating fast path),
/// with replacement characters otherwise.
fn text(bytes: &[u8]) -> std::borrow::Cow<'_, str> {
    match std::str::from_utf8(bytes) {
        Ok(s) => std::borrow::Cow::Borrowed(s),
        Err(_) => String::from_utf8_lossy(bytes),
    }
}

pub(crate) struct Decoded {
    pub(crate) message: Message,
    pub(crate) due: Option<SystemTime>,
    pub(crate) source_partition: Option<i32>,
    pub(crate) source_offset: Option<i64>,
}

/// What decoding reads of a record, however it was fetched (librdkafka's message or a
/// record of the fetch queue).
pub(crate) trait RecordView {
    fn partition(&self) -> i32;
    fn offset(&self) -> i64;
    fn payload(&self) -> Option<&[u8]>;
    fn key(&self) -> Option<&[u8]>;
    /// The record's timestamp in milliseconds since the epoch, if it has one.
    fn timestamp_ms(&self) -> Option<i64>;
    /// Call `f` with each header (name, value), in order.
    fn headers(&self, f: impl FnMut(&str, Option<&[u8]>));
}

/// `m` of `topic`, as reliq sees it.
pub(crate) fn decode(m: &impl RecordView, topic: &str) -> Decoded {
    let mut id = None;
    let mut due = None;
    let mut source_partition = None;
    let mut source_offset = None;
    let mut hs = Headers::new();
    m.headers(|name, value| {
        // Borrowed: only what is kept is copied (the id once, into its `Arc<str>`).
        let value = value.map(text).unwrap_or_default();
        match name {
            headers::MESSAGE_ID => id = Some(MessageId::from(&*value)),
            DUE_AT_HEADER => {
                due = value
                    .parse::<u64>()
                    .ok()
                    .map(|ms| UNIX_EPOCH + Duration::from_millis(ms));
            }
            SOURCE_PARTITION_HEADER => source_partition = value.parse().ok(),
            SOURCE_OFFSET_HEADER => source_offset = value.parse().ok(),
            k => hs.insert(k, value),
        }
    });
    let id = id.filter(|i| !i.as_str().is_empty()).unwrap_or_else(|| {
        MessageId::from(format!("kafka-{topic}-{}-{}", m.partition(), m.offset()))
    });
    let key = m.key().map(|k| text(k).into_owned());
    let payload = Bytes::copy_from_slice(m.payload().unwrap_or_default());
    Decoded {
        message: Message::from_parts(id, key, payload, hs),
        due,
        source_partition,
        source_offset,
    }
}

/// What a retry copy carries of the record first consumed from the source: its
/// partition and offset ([`SOURCE_PARTITION_HEADER`], [`SOURCE_OFFSET_HEADER`]).
pub(crate) fn source_headers(d: &Delivery) -> Vec<(&'static str, String)> {
    let mut extra = Vec::new();
    if let Some(p) = d.origin().partition {
        extra.push((SOURCE_PARTITION_HEADER, p.to_string()));
    }
    if let Some(o) = d.origin().offset {
        extra.push((SOURCE_OFFSET_HEADER, o.to_string()));
    }
    extra
}
