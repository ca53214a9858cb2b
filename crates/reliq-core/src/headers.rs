use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::SystemTime;

use crate::classify::ErrorClass;

/// Message headers: an ordered list of text name/value pairs.
///
/// Text only, because it is the one header type every broker carries (AMQP tables, Kafka
/// record headers, NATS headers, SQS string attributes). Names are case-sensitive;
/// [`Headers::insert`] replaces an existing value. reliq's own names all start with
/// [`PREFIX`].
///
/// The [`Headers`] of a message, the one header scheme reliq writes in them on every
/// backend, and the [`DeadLetter`] record.
///
/// Every name reliq owns starts with [`PREFIX`]; the only exceptions are the W3C trace
/// context names (`traceparent`, `tracestate`), which must keep their standard spelling
/// to interoperate with other tracers. Backends map some of these to native fields (AMQP
/// `message_id`, `Nats-Msg-Id`, the Kafka record key) but always carry the header too, so
/// one decoder reads a dead letter from any broker.
///
/// Timestamps are RFC 3339 in UTC with milliseconds (`2026-11-29T09:15:11.123Z`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Headers(Vec<(String, String)>);

impl Headers {
    /// No headers.
    pub const fn new() -> Self {
        Self(Vec::new())
    }

    /// The value of `name`, if present.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// Set `name` to `value`, replacing a previous value.
    pub fn insert(&mut self, name: impl Into<String>, value: impl Into<String>) {
        let name = name.into();
        let value = value.into();
        match self.0.iter_mut().find(|(n, _)| *n == name) {
            Some(slot) => slot.1 = value,
            None => self.0.push((name, value)),
        }
    }

    /// Remove `name`; returns its value if it was present.
    pub fn remove(&mut self, name: &str) -> Option<String> {
        let pos = self.0.iter().position(|(n, _)| n == name)?;
        Some(self.0.remove(pos).1)
    }

    /// Keep only the headers for which `keep(name)` is true.
    pub fn retain(&mut self, mut keep: impl FnMut(&str) -> bool) {
        self.0.retain(|(n, _)| keep(n));
    }

    /// Iterate over `(name, value)` pairs in insertion order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.0.iter().map(|(n, v)| (n.as_str(), v.as_str()))
    }

    /// Number of headers.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// True when there are no headers.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl<K: Into<String>, V: Into<String>> FromIterator<(K, V)> for Headers {
    fn from_iter<T: IntoIterator<Item = (K, V)>>(iter: T) -> Self {
        let mut h = Headers::new();
        for (k, v) in iter {
            h.insert(k, v);
        }
        h
    }
}

/// The prefix of every reliq header name.
pub const PREFIX: &str = "reliq-";

/// The stable message id (also mapped to the broker's native id field where one exists).
pub const MESSAGE_ID: &str = "reliq-id";
/// The 1-based number of the delivery attempt this copy is for (absent = 1).
pub const ATTEMPT: &str = "reliq-attempt";
/// When the business event happened (producer-set; the origin of `max_age`).
pub const OCCURRED_AT: &str = "reliq-occurred-at";
/// When handling first failed.
pub const FIRST_FAILURE_AT: &str = "reliq-first-failure-at";
/// When handling last failed.
pub const LAST_FAILURE_AT: &str = "reliq-last-failure-at";
/// The last error's text, truncated to [`MAX_ERROR_LEN`] bytes, control characters removed.
pub const LAST_ERROR: &str = "reliq-last-error";
/// The last error's class: `transient|permanent|poison|panic|unknown`.
pub const ERROR_CLASS: &str = "reliq-error-class";
/// The destination (topic / exchange / stream subject / queue) the message was consumed from.
pub const ORIGINAL_DESTINATION: &str = "reliq-original-destination";
/// The routing key or subject the message was published with, if any.
pub const ORIGINAL_ROUTE: &str = "reliq-original-route";
/// Kafka partition of the original record.
pub const ORIGINAL_PARTITION: &str = "reliq-original-partition";
/// Kafka offset of the original record.
pub const ORIGINAL_OFFSET: &str = "reliq-original-offset";
/// Stream sequence of the original message (NATS JetStream).
pub const ORIGINAL_SEQUENCE: &str = "reliq-original-sequence";
/// The consumer (group) that handled the message.
pub const CONSUMER: &str = "reliq-consumer";
/// Why the message was dead-lettered: `poison|permanent|exhausted|expired|max-deliveries|panic`.
pub const DEAD_LETTER_REASON: &str = "reliq-dead-letter-reason";
/// When the message was dead-lettered.
pub const DEAD_LETTERED_AT: &str = "reliq-dead-lettered-at";
/// Version of the dead-letter record layout (see [`DeadLetter::VERSION`]).
pub const DEAD_LETTER_VERSION: &str = "reliq-dead-letter-version";
/// How many times an operator replayed this message.
pub const REPLAY_COUNT: &str = "reliq-replay-count";
/// When it was last replayed.
pub const REPLAYED_AT: &str = "reliq-replayed-at";
/// Correlation id (the conversation this message belongs to).
pub const CORRELATION_ID: &str = "reliq-correlation-id";
/// Causation id (the id of the message that caused this one).
pub const CAUSATION_ID: &str = "reliq-causation-id";
/// W3C trace context parent.
pub const TRACEPARENT: &str = "traceparent";
/// W3C trace context vendor state.
pub const TRACESTATE: &str = "tracestate";
/// The payload's media type (`application/json`, `application/vnd.apache.avro+binary`),
/// written by a typed publish ([`TypedPublisher`](crate::TypedPublisher)); the name
/// CloudEvents' Kafka and AMQP bindings use.
pub const CONTENT_TYPE: &str = "content-type";

/// Upper bound, in bytes, of [`LAST_ERROR`]. Brokers cap header sizes (SQS: 256 KiB for the
/// whole message) and an error chain with a payload dump in it must not push a dead letter
/// over that limit.
pub const MAX_ERROR_LEN: usize = 1024;

/// The headers that describe one failure/dead-lettering rather than the message itself.
/// A replay strips them so the replayed copy starts with a fresh retry budget.
pub const FAILURE_HEADERS: &[&str] = &[
    ATTEMPT,
    FIRST_FAILURE_AT,
    LAST_FAILURE_AT,
    LAST_ERROR,
    ERROR_CLASS,
    ORIGINAL_DESTINATION,
    ORIGINAL_ROUTE,
    ORIGINAL_PARTITION,
    ORIGINAL_OFFSET,
    ORIGINAL_SEQUENCE,
    CONSUMER,
    DEAD_LETTER_REASON,
    DEAD_LETTERED_AT,
    DEAD_LETTER_VERSION,
];

/// Format a timestamp the way every reliq header does.
pub fn format_time(t: SystemTime) -> String {
    humantime::format_rfc3339_millis(t).to_string()
}

/// Parse a timestamp written by [`format_time`] (any RFC 3339 UTC value is accepted).
pub fn parse_time(s: &str) -> Result<SystemTime, HeaderError> {
    humantime::parse_rfc3339_weak(s).map_err(|_| HeaderError::Invalid {
        name: "timestamp",
        value: truncate(s, 64),
    })
}

/// Make an error text safe for every broker's header rules: no control characters (NATS
/// headers cannot hold CR/LF), at most [`MAX_ERROR_LEN`] bytes, cut on a char boundary.
pub fn sanitize_error(text: &str) -> String {
    let cleaned: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    truncate(&cleaned, MAX_ERROR_LEN)
}

fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_owned()
}

/// The attempt number carried by `headers` (1 when absent or unreadable).
pub fn attempt(headers: &Headers) -> u32 {
    headers
        .get(ATTEMPT)
        .and_then(|v| v.parse().ok())
        .filter(|n| *n >= 1)
        .unwrap_or(1)
}

/// A header was missing or unreadable.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum HeaderError {
    /// A required header is absent.
    #[error("header `{0}` is missing")]
    Missing(&'static str),
    /// A header has a value that cannot be parsed.
    #[error("header `{name}` has an invalid value `{value}`")]
    Invalid {
        /// The header name.
        name: &'static str,
        /// The (truncated) value found.
        value: String,
    },
    /// The record was written by a newer, incompatible layout.
    #[error("dead-letter record version {0} is newer than this reliq understands")]
    UnsupportedVersion(u32),
}

/// Why a message was moved to the dead-letter queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeadLetterReason {
    /// It could not be decoded (bad JSON, invalid UTF-8, unknown schema, missing id).
    Poison,
    /// The handler said retrying cannot help (validation, 4xx, state conflict).
    Permanent,
    /// The retry budget (max attempts) ran out.
    Exhausted,
    /// The message outlived the policy's max age before it could succeed.
    Expired,
    /// The broker's own delivery limit moved it (the crash-loop safety net).
    MaxDeliveries,
    /// The handler panicked (and the policy dead-letters panics).
    Panic,
}

impl DeadLetterReason {
    /// Every reason, for metrics pre-registration and docs.
    pub const ALL: [DeadLetterReason; 6] = [
        Self::Poison,
        Self::Permanent,
        Self::Exhausted,
        Self::Expired,
        Self::MaxDeliveries,
        Self::Panic,
    ];

    /// The header/metric label spelling.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Poison => "poison",
            Self::Permanent => "permanent",
            Self::Exhausted => "exhausted",
            Self::Expired => "expired",
            Self::MaxDeliveries => "max-deliveries",
            Self::Panic => "panic",
        }
    }
}

impl fmt::Display for DeadLetterReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for DeadLetterReason {
    type Err = HeaderError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|r| r.as_str() == s)
            .ok_or_else(|| HeaderError::Invalid {
                name: DEAD_LETTER_REASON,
                value: truncate(s, 64),
            })
    }
}

/// Where a message came from: destination plus the broker's position, where it has one.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Origin {
    /// Topic, exchange, stream or queue name (shared: a backend hands the same name to
    /// every delivery of a source without copying it).
    pub destination: Arc<str>,
    /// Routing key or subject, if the broker routes by one.
    pub route: Option<String>,
    /// Kafka partition.
    pub partition: Option<i32>,
    /// Kafka offset.
    pub offset: Option<i64>,
    /// Stream sequence (NATS JetStream).
    pub sequence: Option<u64>,
}

/// The metadata of a dead-lettered message, as one versioned record.
///
/// The runtime writes it into the dead-letter copy's headers ([`DeadLetter::write`]); the
/// replay engine and the operator tools read it back ([`DeadLetter::read`]) from any
/// backend. Fields only grow; a reader accepts records of its version or older.
///
/// ```
/// use std::time::SystemTime;
/// use reliq_core::{DeadLetter, DeadLetterReason, ErrorClass, Headers, Origin};
/// let record = DeadLetter {
///     reason: DeadLetterReason::Exhausted,
///     error_class: Some(ErrorClass::Transient),
///     error: Some("connection reset".into()),
///     attempts: 4,
///     first_failure_at: Some(SystemTime::UNIX_EPOCH),
///     dead_lettered_at: SystemTime::UNIX_EPOCH,
///     consumer: "inventory".into(),
///     origin: Origin { destination: "orders".into(), ..Origin::default() },
/// };
/// let mut headers = Headers::new();
/// record.write(&mut headers);
/// assert_eq!(DeadLetter::read(&headers).unwrap(), record);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeadLetter {
    /// Why it was dead-lettered.
    pub reason: DeadLetterReason,
    /// The class of the last error, when there was one (not for `max-deliveries`).
    pub error_class: Option<ErrorClass>,
    /// The last error's text (sanitized, truncated).
    pub error: Option<String>,
    /// How many delivery attempts were made.
    pub attempts: u32,
    /// When handling first failed.
    pub first_failure_at: Option<SystemTime>,
    /// When it was dead-lettered.
    pub dead_lettered_at: SystemTime,
    /// The consumer (group) that gave up on it.
    pub consumer: String,
    /// Where it was consumed from.
    pub origin: Origin,
}

impl DeadLetter {
    /// The record layout version written by this reliq.
    pub const VERSION: u32 = 1;

    /// Write the record into `headers` (replacing earlier values of the same names).
    pub fn write(&self, headers: &mut Headers) {
        headers.insert(DEAD_LETTER_VERSION, Self::VERSION.to_string());
        headers.insert(DEAD_LETTER_REASON, self.reason.as_str());
        match self.error_class {
            Some(class) => headers.insert(ERROR_CLASS, class.as_str()),
            None => drop(headers.remove(ERROR_CLASS)),
        }
        match &self.error {
            Some(e) => headers.insert(LAST_ERROR, sanitize_error(e)),
            None => drop(headers.remove(LAST_ERROR)),
        }
        headers.insert(ATTEMPT, self.attempts.to_string());
        if let Some(t) = self.first_failure_at {
            headers.insert(FIRST_FAILURE_AT, format_time(t));
        }
        headers.insert(DEAD_LETTERED_AT, format_time(self.dead_lettered_at));
        headers.insert(CONSUMER, self.consumer.clone());
        headers.insert(ORIGINAL_DESTINATION, &*self.origin.destination);
        let optional = [
            (ORIGINAL_ROUTE, self.origin.route.clone()),
            (
                ORIGINAL_PARTITION,
                self.origin.partition.map(|v| v.to_string()),
            ),
            (ORIGINAL_OFFSET, self.origin.offset.map(|v| v.to_string())),
            (
                ORIGINAL_SEQUENCE,
                self.origin.sequence.map(|v| v.to_string()),
            ),
        ];
        for (name, value) in optional {
            match value {
                Some(v) => headers.insert(name, v),
                None => drop(headers.remove(name)),
            }
        }
    }

    /// Read a record from `headers`.
    pub fn read(headers: &Headers) -> Result<Self, HeaderError> {
        let version: u32 = parse_required(headers, DEAD_LETTER_VERSION)?;
        if version > Self::VERSION {
            return Err(HeaderError::UnsupportedVersion(version));
        }
        let reason = required(headers, DEAD_LETTER_REASON)?.parse()?;
        let error_class = headers
            .get(ERROR_CLASS)
            .map(|v| {
                v.parse().map_err(|_| HeaderError::Invalid {
                    name: ERROR_CLASS,
                    value: truncate(v, 64),
                })
            })
            .transpose()?;
        Ok(Self {
            reason,
            error_class,
            error: headers.get(LAST_ERROR).map(str::to_owned),
            attempts: parse_required(headers, ATTEMPT)?,
            first_failure_at: headers.get(FIRST_FAILURE_AT).map(parse_time).transpose()?,
            dead_lettered_at: parse_time(required(headers, DEAD_LETTERED_AT)?)?,
            consumer: required(headers, CONSUMER)?.to_owned(),
            origin: Origin {
                destination: required(headers, ORIGINAL_DESTINATION)?.into(),
                route: headers.get(ORIGINAL_ROUTE).map(str::to_owned),
                partition: parse_optional(headers, ORIGINAL_PARTITION)?,
                offset: parse_optional(headers, ORIGINAL_OFFSET)?,
                sequence: parse_optional(headers, ORIGINAL_SEQUENCE)?,
            },
        })
    }
}

fn required<'h>(headers: &'h Headers, name: &'static str) -> Result<&'h str, HeaderError> {
    headers.get(name).ok_or(HeaderError::Missing(name))
}

fn parse_required<T: FromStr>(headers: &Headers, name: &'static str) -> Result<T, HeaderError> {
    let raw = required(headers, name)?;
    raw.parse().map_err(|_| HeaderError::Invalid {
        name,
        value: truncate(raw, 64),
    })
}

fn parse_optional<T: FromStr>(
    headers: &Headers,
    name: &'static str,
) -> Result<Option<T>, HeaderError> {
    headers
        .get(name)
        .map(|raw| {
            raw.parse().map_err(|_| HeaderError::Invalid {
                name,
                value: truncate(raw, 64),
            })
        })
        .transpose()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn sanitize_strips_control_and_bounds_length() {
        let long = format!("line1\r\nline2\t{}", "é".repeat(2000));
        let s = sanitize_error(&long);
        assert!(s.len() <= MAX_ERROR_LEN);
        assert!(!s.contains('\n') && !s.contains('\r') && !s.contains('\t'));
        assert!(s.starts_with("line1  line2 "));
    }

    #[test]
    fn record_round_trips_with_all_fields() {
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_millis(1_764_400_000_123);
        let record = DeadLetter {
            reason: DeadLetterReason::MaxDeliveries,
            error_class: None,
            error: None,
            attempts: 7,
            first_failure_at: None,
            dead_lettered_at: t0,
            consumer: "c".into(),
            origin: Origin {
                destination: "orders".into(),
                route: Some("order.created".into()),
                partition: Some(2),
                offset: Some(41),
                sequence: Some(9),
            },
        };
        let mut h = Headers::new();
        h.insert("user", "kept");
        record.write(&mut h);
        assert_eq!(DeadLetter::read(&h).unwrap(), record);
        assert_eq!(h.get("user"), Some("kept"));
    }

    #[test]
    fn newer_record_version_is_rejected() {
        let mut h = Headers::new();
        h.insert(DEAD_LETTER_VERSION, "2");
        assert_eq!(
            DeadLetter::read(&h),
            Err(HeaderError::UnsupportedVersion(2))
        );
    }

    #[test]
    fn missing_field_is_named() {
        let mut h = Headers::new();
        h.insert(DEAD_LETTER_VERSION, "1");
        h.insert(DEAD_LETTER_REASON, "poison");
        assert_eq!(DeadLetter::read(&h), Err(HeaderError::Missing(ATTEMPT)));
    }
}
