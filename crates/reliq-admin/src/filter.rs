//! The filter as operators write it — CLI flags, a query string, a JSON body — parsed
//! into the engine's [`DeadLetterFilter`], with an error naming the field it could not
//! read.

use std::str::FromStr;
use std::time::{Duration, SystemTime};

use reliq_core::{DeadLetterFilter, DeadLetterReason, ErrorClass, MessageId};
use serde::{Deserialize, Serialize};

use crate::error::AdminError;

/// Which dead letters, in the operator's words. Every field set must hold; lists match
/// any of their values. The same spec drives `stats`, `ls`, `replay` and `purge`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FilterSpec {
    /// Dead-letter reasons (`exhausted`, `permanent`, `poison`, `expired`,
    /// `max-deliveries`, `panic`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub reason: Vec<String>,
    /// Error classes (`transient`, `permanent`, `poison`, `panic`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub class: Vec<String>,
    /// Error fingerprint ids, as `stats` prints them.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub fingerprint: Vec<String>,
    /// Message ids.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub id: Vec<String>,
    /// Headers as `name=value`; every one must match.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub header: Vec<String>,
    /// A substring of the payload.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub payload_contains: Option<String>,
    /// Dead-lettered at or after: an RFC 3339 time, or an age (`2h`, `30m`) before now.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub since: Option<String>,
    /// Dead-lettered before: an RFC 3339 time, or an age before now.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub until: Option<String>,
    /// At most this many entries.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub limit: Option<usize>,
}

impl FilterSpec {
    /// The engine's filter, times relative to `now`; an error names the field.
    pub fn to_filter(&self, now: SystemTime) -> Result<DeadLetterFilter, AdminError> {
        let mut filter = DeadLetterFilter::default();
        if !self.reason.is_empty() {
            let reasons = self
                .reason
                .iter()
                .map(|r| {
                    DeadLetterReason::from_str(r).map_err(|_| {
                        invalid("reason", r, "expected one of exhausted, permanent, poison, expired, max-deliveries, panic")
                    })
                })
                .collect::<Result<Vec<_>, _>>()?;
            filter = filter.reasons(reasons);
        }
        if !self.class.is_empty() {
            let classes = self
                .class
                .iter()
                .map(|c| {
                    ErrorClass::from_str(c).map_err(|_| {
                        invalid(
                            "class",
                            c,
                            "expected one of transient, permanent, poison, panic",
                        )
                    })
                })
                .collect::<Result<Vec<_>, _>>()?;
            filter = filter.classes(classes);
        }
        if !self.fingerprint.is_empty() {
            for f in &self.fingerprint {
                if f.len() != 16 || !f.bytes().all(|b| b.is_ascii_hexdigit()) {
                    return Err(invalid(
                        "fingerprint",
                        f,
                        "expected 16 hex digits, as `stats` prints",
                    ));
                }
            }
            filter = filter.fingerprints(self.fingerprint.iter().map(|f| f.to_ascii_lowercase()));
        }
        if !self.id.is_empty() {
            filter = filter.ids(self.id.iter().map(|i| MessageId::from(i.as_str())));
        }
        for pair in &self.header {
            let (name, value) = pair
                .split_once('=')
                .filter(|(n, _)| !n.is_empty())
                .ok_or_else(|| invalid("header", pair, "expected name=value"))?;
            filter = filter.header(name, value);
        }
        if let Some(needle) = &self.payload_contains {
            filter = filter.payload_contains(needle.as_bytes().to_vec());
        }
        if let Some(since) = &self.since {
            filter = filter.since(parse_when("since", since, now)?);
        }
        if let Some(until) = &self.until {
            filter = filter.until(parse_when("until", until, now)?);
        }
        if let Some(limit) = self.limit {
            if limit == 0 {
                return Err(invalid("limit", "0", "expected at least 1"));
            }
            filter = filter.limit(limit);
        }
        Ok(filter)
    }

    /// Read from query-string pairs, where list fields repeat (`reason=exhausted&reason=panic`)
    /// or hold comma-separated values. Other names (`cursor`, `max`, `source`) are the
    /// caller's; [`FILTER_FIELDS`] lists the ones read here.
    pub fn from_pairs(pairs: &[(String, String)]) -> Result<Self, AdminError> {
        let mut spec = Self::default();
        for (name, value) in pairs {
            let list = || {
                value
                    .split(',')
                    .filter(|v| !v.is_empty())
                    .map(str::to_owned)
            };
            match name.as_str() {
                "reason" => spec.reason.extend(list()),
                "class" => spec.class.extend(list()),
                "fingerprint" => spec.fingerprint.extend(list()),
                "id" => spec.id.extend(list()),
                "header" => spec.header.push(value.clone()),
                "payload_contains" => spec.payload_contains = Some(value.clone()),
                "since" => spec.since = Some(value.clone()),
                "until" => spec.until = Some(value.clone()),
                "limit" => {
                    spec.limit = Some(
                        value
                            .parse()
                            .map_err(|_| invalid("limit", value, "expected a whole number"))?,
                    )
                }
                _ => {}
            }
        }
        Ok(spec)
    }

    /// True when the spec selects everything.
    pub fn is_empty(&self) -> bool {
        self == &Self::default()
    }
}

/// The query-string names [`FilterSpec::from_pairs`] reads.
pub const FILTER_FIELDS: &[&str] = &[
    "reason",
    "class",
    "fingerprint",
    "id",
    "header",
    "payload_contains",
    "since",
    "until",
    "limit",
];

fn parse_when(field: &'static str, text: &str, now: SystemTime) -> Result<SystemTime, AdminError> {
    if let Ok(t) = humantime::parse_rfc3339_weak(text) {
        return Ok(t);
    }
    let age: Duration = humantime::parse_duration(text).map_err(|_| {
        invalid(
            field,
            text,
            "expected an RFC 3339 time (2026-12-01T03:00:00Z) or an age (2h, 30m)",
        )
    })?;
    now.checked_sub(age)
        .ok_or_else(|| invalid(field, text, "reaches before the epoch"))
}

fn invalid(field: &'static str, value: &str, expected: &str) -> AdminError {
    AdminError::InvalidInput {
        field,
        value: value.chars().take(80).collect(),
        expected: expected.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_fields_are_named() {
        let now = SystemTime::now();
        for (spec, field) in [
            (
                FilterSpec {
                    reason: vec!["tired".into()],
                    ..FilterSpec::default()
                },
                "reason",
            ),
            (
                FilterSpec {
                    class: vec!["odd".into()],
                    ..FilterSpec::default()
                },
                "class",
            ),
            (
                FilterSpec {
                    fingerprint: vec!["xyz".into()],
                    ..FilterSpec::default()
                },
                "fingerprint",
            ),
            (
                FilterSpec {
                    header: vec!["novalue".into()],
                    ..FilterSpec::default()
                },
                "header",
            ),
            (
                FilterSpec {
                    since: Some("yesterday".into()),
                    ..FilterSpec::default()
                },
                "since",
            ),
            (
                FilterSpec {
                    limit: Some(0),
                    ..FilterSpec::default()
                },
                "limit",
            ),
        ] {
            match spec.to_filter(now) {
                Err(AdminError::InvalidInput { field: f, .. }) => assert_eq!(f, field),
                other => panic!("{spec:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn query_pairs_repeat_or_list() {
        let pairs: Vec<(String, String)> = serde_urlencoded::from_str(
            "reason=exhausted,panic&reason=poison&header=tenant%3Deu&header=a%3Db&limit=5&cursor=x",
        )
        .unwrap_or_default();
        let spec = FilterSpec::from_pairs(&pairs).expect("parses");
        assert_eq!(spec.reason, ["exhausted", "panic", "poison"]);
        assert_eq!(spec.header, ["tenant=eu", "a=b"]);
        assert_eq!(spec.limit, Some(5));
        assert!(spec.to_filter(SystemTime::now()).is_ok());
        let ago = FilterSpec {
            since: Some("2h".into()),
            ..FilterSpec::default()
        };
        assert!(ago.to_filter(SystemTime::now()).is_ok());
    }
}
