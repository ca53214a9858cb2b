use std::fmt;

use crate::headers::DeadLetter;

/// The group a dead letter falls into.
///
/// Error fingerprints: 10,000 dead letters of one bug are one group.
///
/// A fingerprint is the dead-letter reason, the error class and the last error's text with
/// everything that varies from one message to the next masked — quoted values, numbers,
/// ids, hex — so `order 8812 not found` and `order 9907 not found` fall together. Its
/// [`Fingerprint::id`] is a short stable hash of the three, safe in a URL or a CLI flag
/// (`reliq dlq replay --fingerprint 3f9a…`), and the same in every reliq version that
/// masks the same way. The masking:
///
/// - a quoted value (`'…'`, `"…"`, `` `…` ``) becomes `<q>`;
/// - a word made of digits only becomes `<n>`;
/// - a word mixing digits with letters (`ord-8812`, a UUID, `0x1f`, `E1234`) becomes `<id>`;
/// - a word of 8 or more hex letters only (`deadbeef`) becomes `<hex>`;
/// - runs of white space become one space.
///
/// Words are runs of letters, digits, `-`, `_` and `.`; punctuation around them stays,
/// so `timeout after 30s (attempt 4)` masks to `timeout after <id> (attempt <n>)`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub struct Fingerprint {
    /// 16 hex digits of a stable hash of reason, class and masked text.
    pub id: String,
    /// The dead-letter reason (`exhausted`, `permanent`, …).
    pub reason: String,
    /// The last error's class, when there was one.
    pub class: Option<String>,
    /// The last error's text, masked (see above); empty when there was none.
    pub masked_error: String,
}

impl Fingerprint {
    /// The fingerprint of a dead-letter record.
    pub fn of(record: &DeadLetter) -> Self {
        let reason = record.reason.as_str().to_owned();
        let class = record.error_class.map(|c| c.as_str().to_owned());
        let masked_error = record.error.as_deref().map(mask_error).unwrap_or_default();
        let mut hash = Fnv1a::default();
        hash.write(reason.as_bytes());
        hash.write(b"\x1f");
        hash.write(class.as_deref().unwrap_or("").as_bytes());
        hash.write(b"\x1f");
        hash.write(masked_error.as_bytes());
        Self {
            id: format!("{:016x}", hash.0),
            reason,
            class,
            masked_error,
        }
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.id, self.reason)?;
        if let Some(class) = &self.class {
            write!(f, "/{class}")?;
        }
        if !self.masked_error.is_empty() {
            write!(f, ": {}", self.masked_error)?;
        }
        Ok(())
    }
}

/// The error text masked as [`Fingerprint`] describes.
pub(crate) fn mask_error(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(&c) = chars.peek() {
        if matches!(c, '\'' | '"' | '`') {
            chars.next();
            // A quote without its closing twin is punctuation, not a value.
            let rest: String = chars.clone().collect();
            match rest.find(c) {
                Some(end) => {
                    for _ in rest[..end].chars() {
                        chars.next();
                    }
                    chars.next();
                    out.push_str("<q>");
                }
                None => out.push(c),
            }
        } else if is_word_char(c) {
            let mut word = String::new();
            while let Some(&w) = chars.peek() {
                if !is_word_char(w) {
                    break;
                }
                word.push(w);
                chars.next();
            }
            out.push_str(&mask_word(&word));
        } else if c.is_whitespace() {
            while chars.peek().is_some_and(|w| w.is_whitespace()) {
                chars.next();
            }
            out.push(' ');
        } else {
            out.push(c);
            chars.next();
        }
    }
    out.trim().to_owned()
}

fn is_word_char(c: char) -> bool {
    c.is_alphanumeric() || matches!(c, '-' | '_' | '.')
}

fn mask_word(word: &str) -> String {
    // A sentence's full stop is not part of the word.
    let (core, tail) = match word.strip_suffix('.') {
        Some(core) if !core.is_empty() => (core, "."),
        _ => (word, ""),
    };
    let digits = core.chars().any(|c| c.is_ascii_digit());
    let masked = if digits && core.chars().all(|c| c.is_ascii_digit() || c == '.') {
        "<n>"
    } else if digits {
        "<id>"
    } else if core.len() >= 8 && core.chars().all(|c| c.is_ascii_hexdigit()) {
        "<hex>"
    } else {
        core
    };
    format!("{masked}{tail}")
}

/// FNV-1a, 64 bits: tiny, and stable across Rust versions (unlike `DefaultHasher`), so a
/// fingerprint id written in a ticket still finds its group next year.
pub(crate) struct Fnv1a(pub(crate) u64);

impl Default for Fnv1a {
    fn default() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv1a {
    pub(crate) fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 ^= u64::from(*b);
            self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::classify::ErrorClass;
    use crate::headers::{DeadLetterReason, Origin};
    use std::time::SystemTime;

    fn record(error: &str) -> DeadLetter {
        DeadLetter {
            reason: DeadLetterReason::Exhausted,
            error_class: Some(ErrorClass::Transient),
            error: Some(error.to_owned()),
            attempts: 4,
            first_failure_at: None,
            dead_lettered_at: SystemTime::UNIX_EPOCH,
            consumer: "c".into(),
            origin: Origin {
                destination: "orders".into(),
                ..Origin::default()
            },
        }
    }

    #[test]
    fn masks_what_varies_and_keeps_the_words() {
        for (text, masked) in [
            ("order 8812 not found", "order <n> not found"),
            (
                "order 'ord-8812' not found in \"eu-1\"",
                "order <q> not found in <q>",
            ),
            (
                "id 0190c3b2-7d4e-7a51-9f00-3e1c2b4a5d6f rejected",
                "id <id> rejected",
            ),
            (
                "timeout after 30s (attempt 4)",
                "timeout after <id> (attempt <n>)",
            ),
            ("price 12.50 is over 10.", "price <n> is over <n>."),
            ("hash deadbeefcafe bad", "hash <hex> bad"),
            ("  two   spaces\n", "two spaces"),
            ("it's a lone quote", "it's a lone quote"),
            ("connection refused", "connection refused"),
        ] {
            assert_eq!(mask_error(text), masked, "{text}");
        }
    }

    #[test]
    fn one_bug_is_one_fingerprint_and_two_bugs_are_two() {
        let a = Fingerprint::of(&record("order 8812 not found"));
        let b = Fingerprint::of(&record("order 9907 not found"));
        let c = Fingerprint::of(&record("customer 8812 not found"));
        assert_eq!(a, b);
        assert_ne!(a.id, c.id);
        assert_eq!(a.id.len(), 16);
        let mut permanent = record("order 8812 not found");
        permanent.reason = DeadLetterReason::Permanent;
        assert_ne!(Fingerprint::of(&permanent).id, a.id);
        // Stable across releases: this id is written in runbooks and tickets.
        assert_eq!(a.id, "97e8860d14f0707b");
        assert_eq!(
            a.to_string(),
            format!("{} exhausted/transient: order <n> not found", a.id)
        );
    }
}
