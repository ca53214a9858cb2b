//! reliq messages ↔ NATS headers and payloads.

use reliq_core::headers;
use reliq_core::{Headers, Message, MessageId};

/// Header carrying the message key (NATS has no key field).
pub const KEY_HEADER: &str = "reliq-key";
/// The server-side deduplication header.
pub(crate) const MSG_ID: &str = "Nats-Msg-Id";

/// reliq headers → NATS headers (+ `Nats-Msg-Id` and the key header).
pub(crate) fn to_nats_headers(message: &Message) -> async_nats::HeaderMap {
    let mut h = async_nats::HeaderMap::new();
    for (name, value) in message.headers().iter() {
        h.insert(name, value);
    }
    h.insert(headers::MESSAGE_ID, message.id().as_str());
    if let Some(key) = message.key() {
        h.insert(KEY_HEADER, key);
    }
    // A replayed copy must not be dropped as a duplicate of the original publish, nor of
    // another replay of the same id: the replay count and time make each replay distinct.
    let h_ = message.headers();
    let msg_id = match (h_.get(headers::REPLAY_COUNT), h_.get(headers::REPLAYED_AT)) {
        (Some(n), Some(at)) => format!("{}:replay:{n}:{at}", message.id()),
        (Some(n), None) => format!("{}:replay:{n}", message.id()),
        _ => message.id().to_string(),
    };
    h.insert(MSG_ID, msg_id);
    h
}

/// NATS headers + payload → a reliq message (`fallback_id` when no id header is present,
/// e.g. a message published by a non-reliq producer).
pub(crate) fn from_nats(
    nats_headers: Option<&async_nats::HeaderMap>,
    payload: bytes::Bytes,
    fallback_id: String,
) -> Message {
    let mut hs = Headers::new();
    let mut id = None;
    let mut key = None;
    if let Some(nh) = nats_headers {
        for (name, values) in nh.iter() {
            let name = name.to_string();
            let Some(value) = values.first() else {
                continue;
            };
            let value = value.as_str().to_owned();
            match name.as_str() {
                headers::MESSAGE_ID => id = Some(value),
                KEY_HEADER => key = Some(value),
                MSG_ID => {
                    if id.is_none() {
                        id = Some(
                            value
                                .split(":replay:")
                                .next()
                                .unwrap_or_default()
                                .to_owned(),
                        );
                    }
                }
                _ => hs.insert(name, value),
            }
        }
    }
    let id = id.filter(|s| !s.is_empty()).unwrap_or(fallback_id);
    Message::from_parts(MessageId::from(id), key, payload, hs)
}

pub(crate) fn route_of(subject: &str, source: &str) -> Option<String> {
    subject
        .strip_prefix(source)
        .and_then(|r| r.strip_prefix('.'))
        .map(str::to_owned)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_with_id_and_key() {
        let m = Message::new("x").with_key("k").with_header("tenant", "a");
        let h = to_nats_headers(&m);
        let back = from_nats(Some(&h), "x".into(), "fallback".into());
        assert_eq!(back.id(), m.id());
        assert_eq!(back.key(), Some("k"));
        assert_eq!(back.headers().get("tenant"), Some("a"));
        assert!(back.headers().get(MSG_ID).is_none());
    }
}
