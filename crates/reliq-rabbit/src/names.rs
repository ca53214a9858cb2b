//! The names reliq gives the exchange and queues of one subscription.

use std::time::Duration;

use lapin::types::ShortString;
use reliq_core::{BrokerError, Subscription};

/// Every name one subscription uses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Names {
    /// The source topic exchange.
    pub exchange: String,
    /// The binding key (the filter, or `#`).
    pub binding_key: String,
    /// This consumer's queue: `<source>.<consumer>`.
    pub queue: String,
    /// The retry (TTL) queues, one per tier: `(delay, name)`.
    pub retry: Vec<(Duration, String)>,
    /// The dead-letter stream (the DLQ): `<source>.<consumer>.dlq.stream`. reliq publishes
    /// its dead letters here (confirmed) and moves the broker's own from
    /// [`Names::landing`]; readers browse it by offset without consuming it.
    pub parking: String,
    /// The landing queue: `<source>.<consumer>.dlq` ([`Subscription::dead_letter_name`]),
    /// a queue of the consumer's queue type that the consumer queue dead-letters to
    /// (delivery limit, at-least-once). reliq moves what lands here into
    /// [`Names::parking`]; it is normally empty. It has the name of the parking queue of
    /// earlier reliq releases, so an existing deployment keeps that queue and its
    /// arguments, and what it holds is moved into the stream.
    pub landing: String,
    /// The removal ledger: `<source>.<consumer>.dlq.removed`, a stream of the offsets of
    /// [`Names::parking`] that were removed (a stream cannot delete one message).
    pub removed: String,
}

impl Names {
    /// The names for `sub`.
    pub fn of(sub: &Subscription) -> Self {
        Self {
            exchange: sub.source.clone(),
            binding_key: sub.filter.clone().unwrap_or_else(|| "#".to_owned()),
            queue: queue_name(sub),
            retry: sub
                .retry_tiers
                .iter()
                .map(|d| (*d, sub.retry_name(*d)))
                .collect(),
            parking: format!("{}.stream", sub.dead_letter_name()),
            landing: sub.dead_letter_name(),
            removed: format!("{}.removed", sub.dead_letter_name()),
        }
    }
}

/// The name of `sub`'s consumer queue: `<source>.<consumer>`.
pub fn queue_name(sub: &Subscription) -> String {
    format!("{}.{}", sub.source, sub.consumer)
}

pub(crate) fn short(field: &str, value: &str) -> Result<ShortString, BrokerError> {
    ShortString::try_new(value).map_err(|_| BrokerError::Config {
        field: field.to_owned(),
        reason: format!(
            "`{}…` is longer than AMQP's 255-byte limit for names",
            value.chars().take(40).collect::<String>()
        ),
    })
}
