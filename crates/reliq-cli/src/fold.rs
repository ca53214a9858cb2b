//! The command's log, one line per cause.
//!
//! A client library that cannot reach its broker says so again on every reconnect:
//! librdkafka logs `AllBrokersDown` every 50 ms, some 450 ERROR lines before a 10 s
//! request gives up. A command-line tool says once what is wrong. [`Fold`] passes the
//! first event of each cause — its level, target and fields with every run of digits
//! taken as the same (ports, addresses, "after 0ms", "1/1 brokers") — and holds back its
//! repeats for a minute, so a long replay still shows a cause that persists. The command
//! ends with one line saying how many were held back; `-v` turns folding off.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tracing::field::{Field, Visit};
use tracing::{Event, Metadata};
use tracing_subscriber::layer::{Context, Filter};

/// How long the repeats of a cause are held back after it was shown.
const QUIET_FOR: Duration = Duration::from_secs(60);

/// A per-layer filter folding repeated events (see the module docs).
#[derive(Clone, Default)]
pub(crate) struct Fold {
    causes: Arc<Mutex<HashMap<String, Cause>>>,
}

struct Cause {
    shown_at: Instant,
    held_back: u64,
}

impl Fold {
    /// The events held back so far, and how many causes they had.
    pub(crate) fn held_back(&self) -> (u64, usize) {
        let causes = self.causes.lock().unwrap_or_else(|p| p.into_inner());
        let held: Vec<u64> = causes
            .values()
            .map(|c| c.held_back)
            .filter(|n| *n > 0)
            .collect();
        (held.iter().sum(), held.len())
    }

    /// Whether an event of `cause` is shown now.
    fn show(&self, cause: String, now: Instant) -> bool {
        let mut causes = self.causes.lock().unwrap_or_else(|p| p.into_inner());
        match causes.get_mut(&cause) {
            None => {
                causes.insert(
                    cause,
                    Cause {
                        shown_at: now,
                        held_back: 0,
                    },
                );
                true
            }
            Some(seen) if now.duration_since(seen.shown_at) >= QUIET_FOR => {
                seen.shown_at = now;
                true
            }
            Some(seen) => {
                seen.held_back += 1;
                false
            }
        }
    }
}

impl<S> Filter<S> for Fold {
    fn enabled(&self, _: &Metadata<'_>, _: &Context<'_, S>) -> bool {
        true
    }

    fn event_enabled(&self, event: &Event<'_>, _: &Context<'_, S>) -> bool {
        let meta = event.metadata();
        let mut key = CauseKey(format!("{} {}", meta.level(), meta.target()));
        event.record(&mut key);
        self.show(key.0, Instant::now())
    }
}

/// An event's fields, each run of digits written as `#`.
struct CauseKey(String);

impl Visit for CauseKey {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        let _ = write!(self.0, " {}=", field.name());
        let mut text = String::new();
        push_folding_digits(&mut text, &format!("{value:?}"));
        // librdkafka's own count of the repeats it folded, in the line's last parenthesis.
        self.0
            .push_str(&text.replace(", # identical error(s) suppressed", ""));
    }
}

/// `text` onto `into`, each run of digits as one `#`.
fn push_folding_digits(into: &mut String, text: &str) {
    let mut in_digits = false;
    for c in text.chars() {
        if c.is_ascii_digit() {
            if !in_digits {
                into.push('#');
            }
            in_digits = true;
        } else {
            into.push(c);
            in_digits = false;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cause_shows_once_a_minute_and_its_repeats_are_counted() {
        let fold = Fold::default();
        let t0 = Instant::now();
        let down = "ERROR librdkafka message=Global error: AllBrokersDown: #/# brokers are down";
        assert!(fold.show(down.into(), t0));
        for i in 1..=450 {
            assert!(!fold.show(down.into(), t0 + Duration::from_millis(50 * i)));
        }
        assert!(fold.show("ERROR librdkafka message=another".into(), t0));
        assert_eq!(fold.held_back(), (450, 1));
        // A cause that persists shows again after the quiet minute.
        assert!(fold.show(down.into(), t0 + QUIET_FOR));
    }

    #[test]
    fn digits_do_not_make_a_new_cause() {
        let key = |text: &str| {
            let mut k = String::new();
            push_folding_digits(&mut k, text);
            k
        };
        assert_eq!(
            key("Connect to ipv4#127.0.0.1:9092 failed (after 0ms in state CONNECT)"),
            "Connect to ipv###.#.#.#:# failed (after #ms in state CONNECT)"
        );
        assert_eq!(
            key("Connect to ipv4#127.0.0.1:9093 failed (after 12ms in state CONNECT)"),
            key("Connect to ipv4#127.0.0.1:9092 failed (after 0ms in state CONNECT)")
        );
        assert_ne!(key("Connection refused"), key("SSL handshake failed"));
    }
}
