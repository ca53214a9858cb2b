//! Queue names and the topic → queues convention.
//!
//! SQS queue names allow `[A-Za-z0-9_-]` and at most 80 characters. Every other character
//! becomes `_`; a name that is still too long keeps its first characters (at most 63) and
//! ends in a 16-hex-digit FNV-1a hash of the full name, so it stays unique and stable.
//!
//! A consumer's queue is `<source>-<consumer>`: its name starts with [`topic_prefix`] of
//! its source, which is how a publisher finds the queues of a topic (`ListQueues` with
//! that prefix). Names can collide across topics (`a-b` + `c` vs `a` + `b-c`, or after
//! sanitizing), so the publisher then keeps only queues **tagged** `reliq-source=<topic>`.

use reliq_core::Subscription;

/// SQS's queue name limit.
pub const MAX_QUEUE_NAME: usize = 80;
const KEEP: usize = MAX_QUEUE_NAME - 17;

/// Tag: the topic a consumer queue subscribes to (exact, unsanitized).
pub const SOURCE_TAG: &str = "reliq-source";
/// Tag: the consumer (group) name.
pub const CONSUMER_TAG: &str = "reliq-consumer";
/// Tag: the subscription's route filter (absent = everything).
pub const FILTER_TAG: &str = "reliq-filter";
/// Tag: `consumer` or `dead-letter`.
pub const ROLE_TAG: &str = "reliq-role";

/// Replace every character SQS does not allow in a queue name with `_`.
pub fn sanitize(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

fn fit(full: String, keep: usize) -> String {
    if full.len() <= MAX_QUEUE_NAME {
        return full;
    }
    // `full` is ASCII after sanitizing, so byte slicing is safe.
    let keep = keep.min(KEEP);
    format!("{}{:016x}", &full[..keep], fnv1a(&full))
}

/// The prefix every consumer queue of `topic` starts with.
pub fn topic_prefix(topic: &str) -> String {
    let mut p = sanitize(topic);
    p.push('-');
    p.truncate(KEEP);
    p
}

/// The queue of one consumer of one source: `<source>-<consumer>`.
pub fn queue_name(sub: &Subscription) -> String {
    let full = format!("{}-{}", sanitize(&sub.source), sanitize(&sub.consumer));
    fit(full, topic_prefix(&sub.source).len())
}

/// The consumer's dead-letter queue: [`Subscription::dead_letter_name`], sanitized
/// (`<source>_<consumer>_dlq`).
pub fn dead_letter_queue_name(sub: &Subscription) -> String {
    fit(sanitize(&sub.dead_letter_name()), KEEP)
}

/// Whether a route matches a subscription filter (`*` one word, `#` any number of words,
/// words separated by `.`); no filter matches everything.
pub fn filter_matches(filter: Option<&str>, route: Option<&str>) -> bool {
    let Some(filter) = filter else { return true };
    let pattern: Vec<&str> = filter.split('.').collect();
    let route = route.unwrap_or_default();
    let words: Vec<&str> = if route.is_empty() {
        Vec::new()
    } else {
        route.split('.').collect()
    };
    fn go(p: &[&str], w: &[&str]) -> bool {
        match p.split_first() {
            None => w.is_empty(),
            Some((&"#", rest)) => (0..=w.len()).any(|i| go(rest, &w[i..])),
            Some((&"*", rest)) => !w.is_empty() && go(rest, &w[1..]),
            Some((word, rest)) => w.first() == Some(word) && go(rest, &w[1..]),
        }
    }
    go(&pattern, &words)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_valid_and_start_with_the_topic_prefix() {
        let sub = Subscription::new("inventory", "orders.eu");
        assert_eq!(queue_name(&sub), "orders_eu-inventory");
        assert_eq!(dead_letter_queue_name(&sub), "orders_eu_inventory_dlq");
        assert!(queue_name(&sub).starts_with(&topic_prefix("orders.eu")));
        let long = Subscription::new("c".repeat(70), "t".repeat(70));
        let name = queue_name(&long);
        assert!(name.len() <= MAX_QUEUE_NAME, "{name}");
        assert!(name.starts_with(&topic_prefix(&long.source)));
        assert_ne!(
            name,
            queue_name(&Subscription::new("d".repeat(70), "t".repeat(70)))
        );
        assert!(dead_letter_queue_name(&long).len() <= MAX_QUEUE_NAME);
    }

    #[test]
    fn filters_match_like_amqp_topics() {
        assert!(filter_matches(None, Some("a.b")));
        assert!(filter_matches(Some("#"), None));
        assert!(filter_matches(Some("order.*"), Some("order.created")));
        assert!(!filter_matches(Some("order.*"), Some("order.created.eu")));
        assert!(filter_matches(Some("order.#"), Some("order.created.eu")));
        assert!(!filter_matches(Some("order.created"), None));
    }
}
