//! Which dead letters an operation touches: one filter for replay, purge and the
//! operator's listings, so "what `ls` shows" and "what `replay` moves" can never differ.

use std::collections::HashSet;
use std::time::SystemTime;

use crate::classify::ErrorClass;
use crate::dead_letters::DeadLetterEntry;
use crate::fingerprint::Fingerprint;
use crate::headers::{DeadLetter, DeadLetterReason};
use crate::message::MessageId;

/// Which dead letters to act on. Every condition set must hold; the empty filter matches
/// every entry that carries a readable dead-letter record.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DeadLetterFilter {
    ids: Option<HashSet<MessageId>>,
    since: Option<SystemTime>,
    until: Option<SystemTime>,
    reasons: Option<Vec<DeadLetterReason>>,
    classes: Option<Vec<ErrorClass>>,
    fingerprints: Option<Vec<String>>,
    headers: Vec<(String, String)>,
    payload_contains: Option<Vec<u8>>,
    limit: Option<usize>,
}

impl DeadLetterFilter {
    /// Only these message ids.
    pub fn ids(mut self, ids: impl IntoIterator<Item = MessageId>) -> Self {
        self.ids = Some(ids.into_iter().collect());
        self
    }
    /// Dead-lettered at or after `t`.
    pub fn since(mut self, t: SystemTime) -> Self {
        self.since = Some(t);
        self
    }
    /// Dead-lettered before `t`.
    pub fn until(mut self, t: SystemTime) -> Self {
        self.until = Some(t);
        self
    }
    /// Only these dead-letter reasons.
    pub fn reasons(mut self, r: impl IntoIterator<Item = DeadLetterReason>) -> Self {
        self.reasons = Some(r.into_iter().collect());
        self
    }
    /// Only these error classes (an entry without a class never matches).
    pub fn classes(mut self, c: impl IntoIterator<Item = ErrorClass>) -> Self {
        self.classes = Some(c.into_iter().collect());
        self
    }
    /// Only these error fingerprints ([`Fingerprint::id`]).
    pub fn fingerprints(mut self, ids: impl IntoIterator<Item = impl Into<String>>) -> Self {
        self.fingerprints = Some(ids.into_iter().map(Into::into).collect());
        self
    }
    /// Only entries whose header `name` is `value` (call again to require several).
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }
    /// Only entries whose payload contains these bytes.
    pub fn payload_contains(mut self, needle: impl Into<Vec<u8>>) -> Self {
        self.payload_contains = Some(needle.into());
        self
    }
    /// At most `n` entries.
    pub fn limit(mut self, n: usize) -> Self {
        self.limit = Some(n);
        self
    }

    /// The limit set with [`DeadLetterFilter::limit`].
    pub fn get_limit(&self) -> Option<usize> {
        self.limit
    }

    /// Whether `entry`, whose dead-letter record is `record`, is selected (the limit is
    /// the caller's to count).
    pub fn matches(&self, entry: &DeadLetterEntry, record: &DeadLetter) -> bool {
        self.ids.as_ref().is_none_or(|ids| ids.contains(entry.id()))
            && self.since.is_none_or(|t| record.dead_lettered_at >= t)
            && self.until.is_none_or(|t| record.dead_lettered_at < t)
            && self
                .reasons
                .as_ref()
                .is_none_or(|rs| rs.contains(&record.reason))
            && self
                .classes
                .as_ref()
                .is_none_or(|cs| record.error_class.is_some_and(|c| cs.contains(&c)))
            && self
                .headers
                .iter()
                .all(|(k, v)| entry.headers().get(k) == Some(v.as_str()))
            && self
                .payload_contains
                .as_ref()
                .is_none_or(|needle| contains(entry.payload(), needle))
            // Last: the only condition that allocates.
            && self
                .fingerprints
                .as_ref()
                .is_none_or(|fs| fs.contains(&Fingerprint::of(record).id))
    }
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    needle.is_empty() || haystack.windows(needle.len()).any(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::headers::Origin;
    use crate::message::Message;
    use std::time::Duration;

    fn entry(id: &str, payload: &str, error: &str, at: u64) -> (DeadLetterEntry, DeadLetter) {
        let record = DeadLetter {
            reason: DeadLetterReason::Exhausted,
            error_class: Some(ErrorClass::Transient),
            error: Some(error.to_owned()),
            attempts: 3,
            first_failure_at: None,
            dead_lettered_at: SystemTime::UNIX_EPOCH + Duration::from_secs(at),
            consumer: "c".into(),
            origin: Origin {
                destination: "orders".into(),
                ..Origin::default()
            },
        };
        let mut message =
            Message::with_id_and_payload(id, payload.to_owned()).with_header("tenant", "eu");
        record.write(message.headers_mut());
        let entry = DeadLetterEntry {
            message,
            position: String::new(),
        };
        (entry, record)
    }

    #[test]
    fn every_condition_must_hold() {
        let (e, r) = entry("a", r#"{"sku":"X-1"}"#, "order 12 not found", 100);
        let t = |s| SystemTime::UNIX_EPOCH + Duration::from_secs(s);
        let fp = Fingerprint::of(&r).id;
        assert!(DeadLetterFilter::default().matches(&e, &r));
        for (filter, expected) in [
            (DeadLetterFilter::default().ids(["a".into()]), true),
            (DeadLetterFilter::default().ids(["b".into()]), false),
            (
                DeadLetterFilter::default().since(t(100)).until(t(101)),
                true,
            ),
            (DeadLetterFilter::default().until(t(100)), false),
            (
                DeadLetterFilter::default().reasons([DeadLetterReason::Poison]),
                false,
            ),
            (
                DeadLetterFilter::default().classes([ErrorClass::Transient]),
                true,
            ),
            (DeadLetterFilter::default().fingerprints([fp.clone()]), true),
            (DeadLetterFilter::default().fingerprints(["0000"]), false),
            (DeadLetterFilter::default().header("tenant", "eu"), true),
            (DeadLetterFilter::default().header("tenant", "us"), false),
            (
                DeadLetterFilter::default()
                    .header("tenant", "eu")
                    .header("x", "1"),
                false,
            ),
            (DeadLetterFilter::default().payload_contains("X-1"), true),
            (DeadLetterFilter::default().payload_contains("X-2"), false),
            (
                DeadLetterFilter::default()
                    .payload_contains("X-1")
                    .reasons([DeadLetterReason::Poison]),
                false,
            ),
        ] {
            assert_eq!(filter.matches(&e, &r), expected, "{filter:?}");
        }
    }
}
