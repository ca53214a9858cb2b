//! Queue names and the topic → queues convention.
//!
//! SQS queue names allow `[A-Za-z0-9_-]` and at most 80 characters (FIFO queues end in
//! `.fifo`, within the 80). Every other character becomes `_`; a base name over 75
//! characters keeps its first characters (at most 59) and ends in a 16-hex-digit FNV-1a
//! hash of the full name, so it stays unique and stable; FIFO queues add `.fifo` to the
//! same base.
//!
//! A consumer's queue is `<source>-<consumer>`: its name starts with [`topic_prefix`] of
//! its source, which is how a publisher finds the queues of a topic (`ListQueues` with
//! that prefix). Names can collide across topics (`a-b` + `c` vs `a` + `b-c`, or after
//! sanitizing), so the publisher then keeps only queues **tagged** `reliq-source=<topic>`.

use reliq_core::Subscription;

/// SQS's queue name limit.
pub const MAX_QUEUE_NAME: usize = 80;
/// The suffix SQS requires of FIFO queue names.
pub const FIFO_SUFFIX: &str = ".fifo";
/// Longest name before the FIFO suffix: standard and FIFO queues of one subscription
/// share their base name (and so the topic prefix).
const MAX_BASE: usize = MAX_QUEUE_NAME - FIFO_SUFFIX.len();
/// Characters kept from a name that is too long (the rest is a 16-hex-digit hash).
const KEEP: usize = MAX_BASE - 16;

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
    reliq_core::seam::word_characters(name)
}

fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

fn fit(full: String, keep: usize) -> String {
    if full.len() <= MAX_BASE {
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

/// Whether `url` (or a name) is a FIFO queue's.
pub fn is_fifo(url: &str) -> bool {
    url.ends_with(FIFO_SUFFIX)
}

fn with_kind(base: String, fifo: bool) -> String {
    if fifo { base + FIFO_SUFFIX } else { base }
}

/// The queue of one consumer of one source: `<source>-<consumer>` (`.fifo` appended for
/// FIFO queues).
pub fn queue_name(sub: &Subscription, fifo: bool) -> String {
    let full = format!("{}-{}", sanitize(&sub.source), sanitize(&sub.consumer));
    with_kind(fit(full, topic_prefix(&sub.source).len()), fifo)
}

/// The consumer's dead-letter queue: [`Subscription::dead_letter_name`], sanitized
/// (`<source>_<consumer>_dlq`, `.fifo` appended for FIFO queues: a FIFO queue's DLQ must
/// be FIFO too).
pub fn dead_letter_queue_name(sub: &Subscription, fifo: bool) -> String {
    with_kind(fit(sanitize(&sub.dead_letter_name()), KEEP), fifo)
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

/// A value for `MessageGroupId` / `MessageDeduplicationId`: at most 128 characters of
/// ASCII 33–126. Anything else (a longer or non-ASCII id or key) becomes `sha256-<hex>`
/// of it, so distinct values stay distinct.
pub fn fifo_token(value: &str) -> String {
    let fits =
        !value.is_empty() && value.len() <= 128 && value.bytes().all(|b| (33..=126).contains(&b));
    if fits {
        return value.to_owned();
    }
    use sha2::Digest as _;
    let digest = sha2::Sha256::digest(value.as_bytes());
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256-{hex}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_valid_and_start_with_the_topic_prefix() {
        let sub = Subscription::new("inventory", "orders.eu");
        assert_eq!(queue_name(&sub, false), "orders_eu-inventory");
        assert_eq!(
            dead_letter_queue_name(&sub, false),
            "orders_eu_inventory_dlq"
        );
        assert_eq!(queue_name(&sub, true), "orders_eu-inventory.fifo");
        assert_eq!(
            dead_letter_queue_name(&sub, true),
            "orders_eu_inventory_dlq.fifo"
        );
        assert!(queue_name(&sub, false).starts_with(&topic_prefix("orders.eu")));
        let long = Subscription::new("c".repeat(70), "t".repeat(70));
        for fifo in [false, true] {
            let name = queue_name(&long, fifo);
            assert!(name.len() <= MAX_QUEUE_NAME, "{name}");
            assert!(name.starts_with(&topic_prefix(&long.source)));
            assert_eq!(is_fifo(&name), fifo);
            assert_ne!(
                name,
                queue_name(&Subscription::new("d".repeat(70), "t".repeat(70)), fifo)
            );
            assert!(dead_letter_queue_name(&long, fifo).len() <= MAX_QUEUE_NAME);
        }
    }

    #[test]
    fn fifo_tokens_are_valid_and_distinct() {
        assert_eq!(fifo_token("0190-abc"), "0190-abc");
        let spaced = fifo_token("customer 7");
        assert!(spaced.starts_with("sha256-") && spaced.len() <= 128);
        assert_ne!(spaced, fifo_token("customer 8"));
        assert!(fifo_token(&"x".repeat(200)).len() <= 128);
        assert!(fifo_token("").starts_with("sha256-"));
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
