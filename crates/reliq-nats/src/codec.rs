//! reliq messages ↔ NATS headers and payloads.

use reliq_core::{Headers, Message, MessageId, seam::headers};

/// Header carrying the message key (NATS has no key field).
pub const KEY_HEADER: &str = "reliq-key";
/// The server-side deduplication header.
pub(crate) const MSG_ID: &str = "Nats-Msg-Id";
/// On a retry copy: the stream sequence and subject of the message first consumed
/// (`<seq> <subject>`), so its origin (route, sequence) survives the copy.
pub(crate) const ORIGIN_HEADER: &str = "reliq-nats-origin";
/// When the server publishes a scheduled retry (RFC 3339).
pub(crate) const SCHEDULE: &str = "Nats-Schedule";
/// Where the server publishes a scheduled retry.
pub(crate) const SCHEDULE_TARGET: &str = "Nats-Schedule-Target";
/// Headers the server puts on what a schedule produced: not the message's own.
const SCHEDULER_HEADERS: [&str; 2] = ["Nats-Scheduler", "Nats-Schedule-Next"];

/// The origin a retry copy carries: (stream sequence, subject) of the first delivery.
pub(crate) fn copy_origin(nats_headers: Option<&async_nats::HeaderMap>) -> Option<(u64, String)> {
    let value = nats_headers?.get(ORIGIN_HEADER)?.as_str();
    let (seq, subject) = value.split_once(' ')?;
    Some((seq.parse().ok()?, subject.to_owned()))
}

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
    h.insert(MSG_ID, publish_id(message));
    h
}

/// The `Nats-Msg-Id` a message is published with: its id — and, for a replayed copy, the
/// replay count and time, so that a replay is not dropped as a duplicate of the original
/// publish, nor of another replay of the same id.
fn publish_id(message: &Message) -> String {
    let h = message.headers();
    match (h.get(headers::REPLAY_COUNT), h.get(headers::REPLAYED_AT)) {
        (Some(n), Some(at)) => format!("{}:replay:{n}:{at}", message.id()),
        (Some(n), None) => format!("{}:replay:{n}", message.id()),
        _ => message.id().to_string(),
    }
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
                ORIGIN_HEADER => {}
                n if SCHEDULER_HEADERS.contains(&n) => {}
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

    #[test]
    fn a_retry_copy_keeps_its_origin_out_of_the_headers() {
        let mut h = to_nats_headers(&Message::new("x"));
        h.insert(ORIGIN_HEADER, "17 orders.created");
        h.insert("Nats-Scheduler", "retry.orders.c.at.17");
        assert_eq!(
            copy_origin(Some(&h)),
            Some((17, "orders.created".to_owned()))
        );
        let back = from_nats(Some(&h), "x".into(), "fallback".into());
        assert!(back.headers().get(ORIGIN_HEADER).is_none());
        assert!(back.headers().get("Nats-Scheduler").is_none());
        assert_eq!(copy_origin(None), None);
    }
}
