use std::time::SystemTime;

use serde::{Deserialize, Serialize};

use crate::classify::DecodeError;
use crate::headers;
use crate::message::Message;

/// The aggregate an event belongs to.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "json-schema", derive(schemars::JsonSchema))]
pub struct Aggregate {
    /// Aggregate type, e.g. `order`.
    #[serde(rename = "type")]
    pub kind: String,
    /// Aggregate id.
    pub id: String,
    /// Aggregate version after this event (for ordering / stale-event checks).
    pub version: u64,
}

/// A typed event envelope.
///
/// An optional typed layer over the payload: the event envelope.
///
/// ```json
/// {"id":"…","type":"order.created","schema_version":"1.2","occurred_at":"2026-11-29T09:00:00Z",
///  "producer":"checkout","correlation_id":"…","causation_id":"…",
///  "aggregate":{"type":"order","id":"o-1","version":3},"data":{…}}
/// ```
///
/// Unknown fields are ignored (forward compatible). An envelope that does not decode, has
/// an empty id, or whose *major* schema version differs from the consumer's is poison.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "json-schema", derive(schemars::JsonSchema))]
pub struct Envelope<T> {
    /// The stable event id (becomes the message id).
    pub id: String,
    /// Event type, e.g. `order.created`.
    #[serde(rename = "type")]
    pub kind: String,
    /// `MAJOR` or `MAJOR.MINOR`; consumers accept minors of their major.
    pub schema_version: String,
    /// When the event happened.
    #[serde(with = "rfc3339")]
    #[cfg_attr(feature = "json-schema", schemars(with = "String", extend("format" = "date-time")))]
    pub occurred_at: SystemTime,
    /// Producing service.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub producer: Option<String>,
    /// Conversation id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub correlation_id: Option<String>,
    /// Id of the message that caused this one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub causation_id: Option<String>,
    /// The aggregate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub aggregate: Option<Aggregate>,
    /// The event data.
    pub data: T,
}

impl<T> Envelope<T> {
    /// A new envelope with a fresh id, occurred now, schema `1`.
    pub fn new(kind: impl Into<String>, data: T) -> Self {
        Self {
            id: crate::message::MessageId::generate().to_string(),
            kind: kind.into(),
            schema_version: "1".into(),
            occurred_at: SystemTime::now(),
            producer: None,
            correlation_id: None,
            causation_id: None,
            aggregate: None,
            data,
        }
    }

    /// The major part of `schema_version`, if it parses.
    pub fn major(&self) -> Option<u32> {
        self.schema_version.split('.').next()?.parse().ok()
    }
}

impl<T: Serialize> Envelope<T> {
    /// Encode as a [`Message`]: the envelope id becomes the message id, and occurred-at,
    /// correlation and causation ids are mirrored into headers (so brokers and the retry
    /// policy can read them without decoding the payload).
    pub fn to_message(&self) -> Result<Message, serde_json::Error> {
        let mut m = Message::with_id_and_payload(self.id.as_str(), serde_json::to_vec(self)?)
            .with_header(headers::OCCURRED_AT, headers::format_time(self.occurred_at));
        if let Some(c) = &self.correlation_id {
            m = m.with_correlation_id(c.clone());
        }
        if let Some(c) = &self.causation_id {
            m = m.with_causation_id(c.clone());
        }
        if let Some(a) = &self.aggregate {
            m = m.with_key(format!("{}:{}", a.kind, a.id));
        }
        Ok(m)
    }
}

impl<T: serde::de::DeserializeOwned> Envelope<T> {
    /// Decode and validate; every failure is a poison [`DecodeError`].
    pub fn decode(bytes: &[u8], supported_major: u32) -> Result<Self, DecodeError> {
        let env: Self = serde_json::from_slice(bytes)?;
        if env.id.trim().is_empty() {
            return Err(DecodeError::Missing("id"));
        }
        if env.major() != Some(supported_major) {
            return Err(DecodeError::SchemaVersion {
                found: env.schema_version,
                supported: supported_major,
            });
        }
        Ok(env)
    }
}

mod rfc3339 {
    use std::time::SystemTime;

    use serde::{Deserialize, Deserializer, Serializer, de::Error};

    pub fn serialize<S: Serializer>(t: &SystemTime, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&crate::headers::format_time(*t))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<SystemTime, D::Error> {
        let raw = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        crate::headers::parse_time(&raw).map_err(D::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{classify::Classifier, classify::ErrorClass};

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Order {
        sku: String,
    }

    #[test]
    fn round_trip_and_unknown_fields_ignored() {
        let env = Envelope::new("order.created", Order { sku: "a".into() });
        let msg = env.to_message().unwrap();
        assert_eq!(msg.id().as_str(), env.id);
        let mut v: serde_json::Value = serde_json::from_slice(msg.payload()).unwrap();
        v["future_field"] = serde_json::json!({"x": 1});
        v["schema_version"] = "1.7".into();
        let back: Envelope<Order> = Envelope::decode(&serde_json::to_vec(&v).unwrap(), 1).unwrap();
        assert_eq!(back.data, env.data);
        assert_eq!(back.schema_version, "1.7");
    }

    #[test]
    fn unknown_major_and_missing_id_are_poison() {
        let env = Envelope {
            schema_version: "2.0".into(),
            ..Envelope::new("t", Order { sku: "a".into() })
        };
        let bytes = serde_json::to_vec(&env).unwrap();
        let err = Envelope::<Order>::decode(&bytes, 1).unwrap_err();
        let boxed: crate::classify::BoxError = Box::new(err);
        assert_eq!(
            Classifier::default().classify(boxed.as_ref()),
            ErrorClass::Poison
        );

        let env = Envelope {
            id: " ".into(),
            ..Envelope::new("t", Order { sku: "a".into() })
        };
        let bytes = serde_json::to_vec(&env).unwrap();
        assert!(matches!(
            Envelope::<Order>::decode(&bytes, 1),
            Err(DecodeError::Missing("id"))
        ));
        assert!(matches!(
            Envelope::<Order>::decode(b"\xff\xfe", 1),
            Err(DecodeError::Json(_))
        ));
    }
}
