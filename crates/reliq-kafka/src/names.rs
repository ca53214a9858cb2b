//! The topic and consumer-group names reliq derives from a subscription.
//!
//! This consumer's retry topics (`<topic>.<group>.retry.<ms>ms`,
//! [`Subscription::retry_name`]) and its DLQ (`<topic>.<group>.dlq`,
//! [`Subscription::dead_letter_name`]) are reliq's portable names; the Kafka backend adds
//! the ones below. Every group id also gets the configured `reliq.group.prefix` when a
//! consumer is made ([`KafkaConfig`](crate::options::KafkaConfig)).

use std::time::Duration;

use reliq_core::Subscription;

/// Suffix of the removal ledger's topic name (after the DLQ's).
const LEDGER_SUFFIX: &str = ".removed";

/// The relay group of `sub`'s tier `delay`: `<group>.retry.<ms>ms`.
pub(crate) fn relay_group(sub: &Subscription, delay: Duration) -> String {
    format!("{}.retry.{}ms", sub.consumer, delay.as_millis())
}

/// The delay of `topic` if it is one of `sub`'s retry topics
/// (`<topic>.<group>.retry.<ms>ms`, [`Subscription::retry_name`]), whether or not the
/// current policy has that tier.
pub(crate) fn retry_tier(sub: &Subscription, topic: &str) -> Option<Duration> {
    let prefix = format!("{}.{}.retry.", sub.source, sub.consumer);
    topic
        .strip_prefix(&prefix)
        .and_then(|rest| rest.strip_suffix("ms"))
        .and_then(|ms| ms.parse::<u64>().ok())
        .map(Duration::from_millis)
}

/// The removal ledger of the DLQ topic `dlq`: `<dlq>.removed` (see `dead_letters`).
pub(crate) fn ledger_topic(dlq: &str) -> String {
    format!("{dlq}{LEDGER_SUFFIX}")
}

/// The group id of `sub`'s dead-letter reader: `<group>.dlq-browse` (never joined: the
/// reader's consumer is assigned partitions and commits nothing).
pub(crate) fn browse_group(sub: &Subscription) -> String {
    format!("{}.dlq-browse", sub.consumer)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_topics_give_back_their_tier() {
        let sub = Subscription::new("billing", "orders");
        let delay = Duration::from_millis(5_000);
        assert_eq!(retry_tier(&sub, &sub.retry_name(delay)), Some(delay));
        assert_eq!(retry_tier(&sub, "orders"), None);
        assert_eq!(retry_tier(&sub, "orders.billing.dlq"), None);
        let other = Subscription::new("shipping", "orders");
        assert_eq!(retry_tier(&sub, &other.retry_name(delay)), None);
        assert_eq!(relay_group(&sub, delay), "billing.retry.5000ms");
        assert_eq!(
            ledger_topic(&sub.dead_letter_name()),
            "orders.billing.dlq.removed"
        );
    }
}
