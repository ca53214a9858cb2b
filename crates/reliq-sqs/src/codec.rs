//! reliq message ⇄ SQS message (body + at most 10 message attributes).
//!
//! SQS allows at most 10 message attributes per message, so reliq packs its metadata:
//!
//! - **`reliq`** (one `String` attribute, always present): a JSON object of strings holding
//!   every reliq header (names starting with `reliq-`), `traceparent` / `tracestate`, the
//!   message id (`reliq-id`), the key (`reliq-key`), the route it was published with
//!   (`reliq-route`), the body encoding (`reliq-body` = `base64` when the payload is not
//!   valid SQS text), and any user header that does not fit as its own attribute.
//! - **user headers** as individual `String` attributes, in header order, while the total
//!   stays ≤ 10 (so at most 9) and the header is a valid SQS attribute (name of
//!   `[A-Za-z0-9_.-]`, ≤ 256 chars, not starting with `AWS.`/`Amazon.`, no `..`, not
//!   starting or ending with `.`, not `reliq`; non-empty value). The rest overflow into
//!   the JSON above.
//!
//! Decoding is symmetric. A message from a non-reliq producer (no `reliq` attribute) gets
//! the SQS message id as its id and its `String`/`Number` attributes as headers.

use std::collections::HashMap;

use aws_sdk_sqs::types::MessageAttributeValue;
use bytes::Bytes;
use reliq_core::{BrokerError, Headers, Message, MessageId, seam::headers};

/// The attribute holding reliq's packed metadata.
pub const RELIQ_ATTRIBUTE: &str = "reliq";
/// JSON field: the message key.
pub const KEY_FIELD: &str = "reliq-key";
/// JSON field: the route (routing key) the message was published with.
pub const ROUTE_FIELD: &str = "reliq-route";
/// JSON field: the body encoding (`base64`) when the payload is not valid SQS text.
pub const BODY_FIELD: &str = "reliq-body";
/// SQS's limit of message attributes per message.
pub const MAX_ATTRIBUTES: usize = 10;

/// An SQS message ready to send.
#[derive(Clone, Debug)]
pub struct Encoded {
    /// The message body.
    pub body: String,
    /// The message attributes (≤ 10).
    pub attributes: HashMap<String, MessageAttributeValue>,
    /// FIFO queues only: `MessageGroupId` and `MessageDeduplicationId`
    /// (see [`Encoded::for_fifo`]).
    pub fifo: Option<(String, String)>,
}

/// The message group of keyless messages on FIFO queues: one group, so they keep their
/// publish order among themselves.
pub const DEFAULT_GROUP: &str = "reliq-keyless";

impl Encoded {
    /// The same message for a FIFO queue: group = the message key (or
    /// [`DEFAULT_GROUP`]), deduplication id = `dedup` (made valid by
    /// [`fifo_token`](crate::names::fifo_token)).
    pub fn for_fifo(&self, key: Option<&str>, dedup: &str) -> Self {
        let mut fifo = self.clone();
        fifo.fifo = Some((
            crate::names::fifo_token(key.unwrap_or(DEFAULT_GROUP)),
            crate::names::fifo_token(dedup),
        ));
        fifo
    }
}

/// A decoded SQS message.
#[derive(Debug)]
pub struct Decoded {
    /// The reliq message.
    pub message: Message,
    /// The route it was published with, if any.
    pub route: Option<String>,
}

fn is_reliq_header(name: &str) -> bool {
    name.starts_with(headers::PREFIX) || name == headers::TRACEPARENT || name == headers::TRACESTATE
}

/// Whether `name` may be an SQS message attribute name of its own.
fn valid_attribute_name(name: &str) -> bool {
    let lower = name.to_ascii_lowercase();
    !name.is_empty()
        && name.len() <= 256
        && name != RELIQ_ATTRIBUTE
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.')
        && !name.starts_with('.')
        && !name.ends_with('.')
        && !name.contains("..")
        && !lower.starts_with("aws.")
        && !lower.starts_with("amazon.")
}

/// Characters SQS accepts in a body or string attribute (XML 1.0 characters).
fn valid_sqs_char(c: char) -> bool {
    matches!(c, '\u{9}' | '\u{A}' | '\u{D}' | '\u{20}'..='\u{D7FF}' | '\u{E000}'..='\u{FFFD}' | '\u{10000}'..='\u{10FFFF}')
}

fn string_attribute(value: impl Into<String>) -> Result<MessageAttributeValue, BrokerError> {
    MessageAttributeValue::builder()
        .data_type("String")
        .string_value(value)
        .build()
        .map_err(|e| BrokerError::Other(Box::new(e)))
}

/// Encode a reliq message (published with `route`) as an SQS message.
pub fn encode(message: &Message, route: Option<&str>) -> Result<Encoded, BrokerError> {
    let mut packed = serde_json::Map::new();
    packed.insert(headers::MESSAGE_ID.into(), message.id().as_str().into());
    if let Some(key) = message.key() {
        packed.insert(KEY_FIELD.into(), key.into());
    }
    if let Some(route) = route.filter(|r| !r.is_empty()) {
        packed.insert(ROUTE_FIELD.into(), route.into());
    }
    let mut attributes = HashMap::new();
    for (name, value) in message.headers().iter() {
        let own_attribute = !is_reliq_header(name)
            && attributes.len() < MAX_ATTRIBUTES - 1
            && valid_attribute_name(name)
            && !value.is_empty()
            && value.chars().all(valid_sqs_char)
            && !attributes.contains_key(name);
        if own_attribute {
            attributes.insert(name.to_owned(), string_attribute(value)?);
        } else {
            packed.insert(name.to_owned(), value.into());
        }
    }
    let payload = message.payload();
    let body = match std::str::from_utf8(payload) {
        Ok(text) if !text.is_empty() && text.chars().all(valid_sqs_char) => text.to_owned(),
        _ => {
            packed.insert(BODY_FIELD.into(), "base64".into());
            // Never empty: SQS rejects an empty body.
            format!("={}", aws_smithy_types::base64::encode(payload))
        }
    };
    // serde_json escapes control characters, so the JSON is always valid SQS text.
    let json = serde_json::Value::Object(packed).to_string();
    attributes.insert(RELIQ_ATTRIBUTE.into(), string_attribute(json)?);
    Ok(Encoded {
        body,
        attributes,
        fifo: None,
    })
}

/// Decode an SQS message; `sqs_id` is the id when the message carries no reliq id.
pub fn decode(
    body: Option<&str>,
    attributes: Option<&HashMap<String, MessageAttributeValue>>,
    sqs_id: &str,
) -> Decoded {
    let mut hs = Headers::new();
    let mut id = None;
    let mut key = None;
    let mut route = None;
    let mut base64 = false;
    if let Some(attributes) = attributes {
        let packed = attributes
            .get(RELIQ_ATTRIBUTE)
            .and_then(|v| v.string_value())
            .and_then(|s| {
                serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(s).ok()
            });
        if let Some(packed) = packed {
            for (name, value) in packed {
                let serde_json::Value::String(value) = value else {
                    continue;
                };
                match name.as_str() {
                    headers::MESSAGE_ID => id = Some(value),
                    KEY_FIELD => key = Some(value),
                    ROUTE_FIELD => route = Some(value),
                    BODY_FIELD => base64 = value == "base64",
                    _ => hs.insert(name, value),
                }
            }
        }
        let mut own: Vec<(&String, &MessageAttributeValue)> = attributes
            .iter()
            .filter(|(name, _)| name.as_str() != RELIQ_ATTRIBUTE)
            .collect();
        own.sort_by(|a, b| a.0.cmp(b.0));
        for (name, value) in own {
            if let Some(v) = value.string_value() {
                hs.insert(name.clone(), v);
            }
        }
    }
    let body = body.unwrap_or_default();
    let payload = if base64 {
        match aws_smithy_types::base64::decode(body.strip_prefix('=').unwrap_or(body)) {
            Ok(bytes) => Bytes::from(bytes),
            Err(e) => {
                // Keep the raw text: the handler's decoding fails and classifies it as poison.
                tracing::warn!(error = %e, "a base64 body marked by reliq does not decode");
                Bytes::from(body.to_owned())
            }
        }
    } else {
        Bytes::from(body.to_owned())
    };
    let id = id
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| sqs_id.to_owned());
    Decoded {
        message: Message::from_parts(MessageId::from(id), key, payload, hs),
        route,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(m: &Message) -> Decoded {
        let e = encode(m, Some("created")).expect("encode");
        assert!(
            e.attributes.len() <= MAX_ATTRIBUTES,
            "{}",
            e.attributes.len()
        );
        decode(Some(&e.body), Some(&e.attributes), "sqs-id")
    }

    #[test]
    fn id_key_route_and_headers_round_trip() {
        let m = Message::new("hello")
            .with_key("k")
            .with_header("tenant", "acme")
            .with_header(headers::TRACEPARENT, "00-abc-def-01")
            .with_correlation_id("corr");
        let e = encode(&m, Some("created")).expect("encode");
        assert_eq!(e.body, "hello");
        assert!(e.attributes.contains_key("tenant"));
        assert!(!e.attributes.contains_key(headers::TRACEPARENT));
        let d = round_trip(&m);
        assert_eq!(d.message.id(), m.id());
        assert_eq!(d.message.key(), Some("k"));
        assert_eq!(d.route.as_deref(), Some("created"));
        assert_eq!(d.message.payload().as_ref(), b"hello");
        for (name, value) in m.headers().iter() {
            assert_eq!(d.message.headers().get(name), Some(value), "{name}");
        }
        assert_eq!(d.message.headers().len(), m.headers().len());
    }

    #[test]
    fn twelve_user_headers_overflow_into_the_json() {
        let mut m = Message::new("x");
        for i in 0..12 {
            m = m.with_header(format!("h{i}"), format!("v{i}"));
        }
        m = m.with_header("bad name!", "v").with_header("empty", "");
        let e = encode(&m, None).expect("encode");
        assert_eq!(e.attributes.len(), MAX_ATTRIBUTES);
        let d = round_trip(&m);
        assert_eq!(d.message.headers().len(), 14);
        for (name, value) in m.headers().iter() {
            assert_eq!(d.message.headers().get(name), Some(value), "{name}");
        }
    }

    #[test]
    fn binary_and_empty_payloads_survive() {
        for payload in [&[0xffu8, 0xfe, 0x00][..], &b""[..], &b"\x01ctl"[..]] {
            let m = Message::new(payload.to_vec());
            let e = encode(&m, None).expect("encode");
            assert!(!e.body.is_empty());
            assert_eq!(round_trip(&m).message.payload().as_ref(), payload);
        }
    }

    #[test]
    fn foreign_messages_use_the_sqs_id_and_attributes() {
        let mut attrs = HashMap::new();
        attrs.insert("origin".to_owned(), string_attribute("cli").expect("attr"));
        let d = decode(Some("raw"), Some(&attrs), "abc-123");
        assert_eq!(d.message.id().as_str(), "abc-123");
        assert_eq!(d.message.headers().get("origin"), Some("cli"));
        assert_eq!(d.message.payload().as_ref(), b"raw");
    }
}
