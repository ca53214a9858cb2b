//! Mapping between a reliq [`Message`] and an AMQP message.
//!
//! - the message id → AMQP `message_id` (an id longer than 255 bytes → the `reliq-id`
//!   header instead);
//! - the key → the `reliq-key` header;
//! - every reliq/user header → an AMQP long-string header;
//! - delivery mode 2 (persistent).
//!
//! Reading back, headers the broker owns (`x-death`, `x-first-death-*`,
//! `x-last-death-*`, `x-delivery-count`, `x-stream-offset`) are not user headers and are dropped; numbers and
//! booleans set by foreign publishers are kept as text; tables, arrays and byte arrays
//! are dropped.

use std::time::{Duration, SystemTime};

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use reliq_core::{
    BrokerError, DeadLetter, DeadLetterReason, Headers, Message, MessageId, Origin, seam::headers,
};

/// The header carrying the message key (AMQP has no native key field).
pub const KEY_HEADER: &str = "reliq-key";

/// AMQP delivery mode for persistent messages.
const PERSISTENT: u8 = 2;

/// Build the AMQP properties for `message`.
pub(crate) fn properties(message: &Message) -> Result<BasicProperties, BrokerError> {
    let mut table = FieldTable::default();
    let mut put = |name: &str, value: &str| -> Result<(), BrokerError> {
        let key = ShortString::try_new(name).map_err(|_| {
            BrokerError::rejected(format!(
                "header name `{}…` is longer than 255 bytes",
                name.chars().take(40).collect::<String>()
            ))
        })?;
        table.insert(
            key,
            AMQPValue::LongString(LongString::from(value.to_owned())),
        );
        Ok(())
    };
    for (name, value) in message.headers().iter() {
        put(name, value)?;
    }
    // The id travels as the AMQP `message_id`; only an id longer than a short string
    // (255 bytes) needs the `reliq-id` header instead.
    let id = ShortString::try_new(message.id().as_str()).ok();
    if id.is_none() {
        put(headers::MESSAGE_ID, message.id().as_str())?;
    }
    if let Some(key) = message.key() {
        put(KEY_HEADER, key)?;
    }
    let mut props = BasicProperties::default()
        .with_delivery_mode(PERSISTENT)
        .with_headers(table);
    if let Some(id) = id {
        props = props.with_message_id(id);
    }
    Ok(props)
}

fn is_broker_header(name: &str) -> bool {
    name == "x-death"
        || name == "x-delivery-count"
        || name == "x-stream-offset"
        || name.starts_with("x-first-death-")
        || name.starts_with("x-last-death-")
}

fn text(value: &AMQPValue) -> Option<String> {
    Some(match value {
        AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
        AMQPValue::ShortString(s) => s.as_str().to_owned(),
        AMQPValue::Boolean(b) => b.to_string(),
        AMQPValue::ShortShortInt(n) => n.to_string(),
        AMQPValue::ShortShortUInt(n) => n.to_string(),
        AMQPValue::ShortInt(n) => n.to_string(),
        AMQPValue::ShortUInt(n) => n.to_string(),
        AMQPValue::LongInt(n) => n.to_string(),
        AMQPValue::LongUInt(n) => n.to_string(),
        AMQPValue::LongLongInt(n) => n.to_string(),
        AMQPValue::Float(n) => n.to_string(),
        AMQPValue::Double(n) => n.to_string(),
        AMQPValue::Timestamp(n) => n.to_string(),
        _ => return None,
    })
}

/// Rebuild the reliq message from an AMQP delivery.
pub(crate) fn message(props: &BasicProperties, data: &[u8]) -> Message {
    let mut hs = Headers::new();
    let mut key = None;
    let mut header_id = None;
    if let Some(table) = props.headers() {
        for (name, value) in table.inner() {
            let name = name.as_str();
            if is_broker_header(name) {
                continue;
            }
            let Some(v) = text(value) else {
                tracing::debug!(header = name, "non-text AMQP header dropped");
                continue;
            };
            match name {
                KEY_HEADER => key = Some(v),
                headers::MESSAGE_ID => header_id = Some(v),
                _ => hs.insert(name, v),
            }
        }
    }
    let id = props
        .message_id()
        .as_ref()
        .map(|s| s.as_str().to_owned())
        .or(header_id)
        .map(MessageId::from)
        .unwrap_or_else(|| {
            let id = MessageId::generate();
            tracing::warn!(%id, "AMQP message without message_id or reliq-id; generated one");
            id
        });
    let mut m = Message::with_id_and_payload(id, data.to_vec());
    if let Some(k) = key {
        m = m.with_key(k);
    }
    *m.headers_mut() = hs;
    m
}

/// One `x-death` entry, as RabbitMQ writes it when it dead-letters a message.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Death {
    /// `rejected`, `expired`, `maxlen` or `delivery_limit`.
    pub reason: String,
    /// The queue the message was dead-lettered from.
    pub queue: String,
    /// How many times it was dead-lettered from that queue for that reason.
    pub count: u64,
    /// The exchange it had been published to.
    pub exchange: String,
    /// Its routing keys.
    pub routing_keys: Vec<String>,
    /// When (second precision).
    pub time: Option<SystemTime>,
}

/// The `x-death` entries of `props`, newest first (RabbitMQ's order).
pub fn deaths(props: &BasicProperties) -> Vec<Death> {
    let Some(AMQPValue::FieldArray(array)) = props
        .headers()
        .as_ref()
        .and_then(|t| t.inner().get("x-death"))
    else {
        return Vec::new();
    };
    array
        .as_slice()
        .iter()
        .filter_map(|entry| match entry {
            AMQPValue::FieldTable(t) => Some(t.inner()),
            _ => None,
        })
        .map(|t| {
            let s = |k: &str| t.get(k).and_then(text).unwrap_or_default();
            Death {
                reason: s("reason"),
                queue: s("queue"),
                count: t
                    .get("count")
                    .and_then(text)
                    .and_then(|c| c.parse().ok())
                    .unwrap_or(0),
                exchange: s("exchange"),
                routing_keys: match t.get("routing-keys") {
                    Some(AMQPValue::FieldArray(a)) => {
                        a.as_slice().iter().filter_map(text).collect()
                    }
                    _ => Vec::new(),
                },
                time: match t.get("time") {
                    Some(AMQPValue::Timestamp(secs)) => {
                        Some(SystemTime::UNIX_EPOCH + Duration::from_secs(*secs))
                    }
                    _ => None,
                },
            }
        })
        .collect()
}

/// Turn a message RabbitMQ dead-lettered by itself (the quorum delivery limit, or a
/// rejection) into one with a reliq [`DeadLetter`] record, so [`DeadLetter::read`] works
/// on every dead letter. Messages that already carry a record, or carry no `x-death`
/// from `consumer_queue`, are returned unchanged.
pub(crate) fn translate_broker_dead_letter(
    mut message: Message,
    props: &BasicProperties,
    consumer: &str,
    source: &str,
    consumer_queue: &str,
) -> Message {
    if DeadLetter::read(message.headers()).is_ok() {
        return message;
    }
    let deaths = deaths(props);
    let Some(death) = deaths
        .iter()
        .find(|d| d.queue == consumer_queue && d.reason != "expired")
        .or_else(|| deaths.iter().find(|d| d.reason != "expired"))
    else {
        return message;
    };
    let attempts = headers::attempt(message.headers());
    let record = DeadLetter {
        reason: DeadLetterReason::MaxDeliveries,
        error_class: None,
        error: Some(format!(
            "RabbitMQ dead-lettered it from `{}` (x-death reason={}, count={})",
            death.queue, death.reason, death.count
        )),
        attempts,
        first_failure_at: None,
        dead_lettered_at: death.time.unwrap_or_else(SystemTime::now),
        consumer: consumer.to_owned(),
        origin: Origin {
            destination: if death.exchange.is_empty() {
                source.into()
            } else {
                death.exchange.as_str().into()
            },
            route: death
                .routing_keys
                .first()
                .cloned()
                .filter(|r| !r.is_empty()),
            ..Origin::default()
        },
    };
    record.write(message.headers_mut());
    message
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::types::FieldArray;

    #[test]
    fn round_trip_keeps_id_key_headers() {
        let m = Message::new("p")
            .with_key("k")
            .with_header("tenant", "acme")
            .with_header(headers::ATTEMPT, "2");
        let props = properties(&m).unwrap();
        assert_eq!(props.delivery_mode(), &Some(2));
        let back = message(&props, b"p");
        // AMQP tables are unordered (lapin keeps them sorted): compare as sets.
        assert_eq!(
            (back.id(), back.key(), back.payload()),
            (m.id(), m.key(), m.payload())
        );
        let sorted = |h: &Headers| {
            let mut v: Vec<(String, String)> = h
                .iter()
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect();
            v.sort();
            v
        };
        assert_eq!(sorted(back.headers()), sorted(m.headers()));
    }

    #[test]
    fn the_id_is_sent_once_and_long_ids_travel_in_a_header() {
        let short = Message::new("p");
        let props = properties(&short).unwrap();
        assert_eq!(
            props.message_id().as_ref().map(|s| s.as_str()),
            Some(short.id().as_str())
        );
        assert!(
            props
                .headers()
                .as_ref()
                .is_none_or(|t| !t.inner().contains_key(headers::MESSAGE_ID))
        );

        let long = Message::with_id_and_payload("i".repeat(300), "p");
        let props = properties(&long).unwrap();
        assert!(props.message_id().is_none());
        assert_eq!(message(&props, b"p").id(), long.id());
    }

    #[test]
    fn broker_dead_letter_becomes_a_record() {
        let m = Message::new("p");
        let mut props = properties(&m).unwrap();
        let mut death = FieldTable::default();
        death.insert(
            "reason".into(),
            AMQPValue::LongString("delivery_limit".into()),
        );
        death.insert("queue".into(), AMQPValue::LongString("orders.c".into()));
        death.insert("count".into(), AMQPValue::LongLongInt(1));
        death.insert("exchange".into(), AMQPValue::LongString("orders".into()));
        death.insert(
            "routing-keys".into(),
            AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::LongString(
                "o.new".into(),
            )])),
        );
        death.insert("time".into(), AMQPValue::Timestamp(1_700_000_000));
        let mut table = props.headers().clone().unwrap_or_default();
        table.insert(
            "x-death".into(),
            AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::FieldTable(death)])),
        );
        props = props.with_headers(table);
        let plain = message(&props, b"p");
        assert!(plain.headers().get("x-death").is_none());
        let dead = translate_broker_dead_letter(plain, &props, "c", "orders", "orders.c");
        let record = DeadLetter::read(dead.headers()).unwrap();
        assert_eq!(record.reason, DeadLetterReason::MaxDeliveries);
        assert_eq!(&*record.origin.destination, "orders");
        assert_eq!(record.origin.route.as_deref(), Some("o.new"));
        assert_eq!(record.consumer, "c");
        assert!(record.error.unwrap().contains("delivery_limit"));
    }
}
