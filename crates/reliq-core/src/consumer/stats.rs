//! The counters of a running consumer (the same events as its metrics).

use std::sync::atomic::{AtomicU64, Ordering as AtomicOrdering};

/// Counters of one consumer, readable while it runs (the same events as the metrics).
#[derive(Debug, Default)]
pub struct Stats {
    pub(super) received: AtomicU64,
    pub(super) processed: AtomicU64,
    pub(super) retried: AtomicU64,
    pub(super) dead_lettered: AtomicU64,
    pub(super) discarded: AtomicU64,
    pub(super) duplicates: AtomicU64,
    pub(super) released: AtomicU64,
    pub(super) settle_failures: AtomicU64,
    pub(super) throttled: AtomicU64,
    pub(super) panics: AtomicU64,
    pub(super) in_flight: AtomicU64,
    pub(super) max_in_flight: AtomicU64,
    pub(super) running: AtomicU64,
    pub(super) max_running: AtomicU64,
}

/// A snapshot of [`Stats`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StatsSnapshot {
    /// Deliveries received.
    pub received: u64,
    /// Handled successfully and acknowledged.
    pub processed: u64,
    /// Sent to a retry (confirmed).
    pub retried: u64,
    /// Dead-lettered (confirmed).
    pub dead_lettered: u64,
    /// Dropped by [`crate::retry::FinalRoute::Discard`].
    pub discarded: u64,
    /// Skipped as duplicates: found by the runtime's inbox, or reported by the handler
    /// with [`Duplicate`](crate::inbox::Duplicate).
    pub duplicates: u64,
    /// Released back to the broker unsettled (failed settlement, shutdown).
    pub released: u64,
    /// Settlements that failed.
    pub settle_failures: u64,
    /// Receives held back by the settle back-off (after failed settlements or inbox
    /// claims, until the next success).
    pub throttled: u64,
    /// Handler panics caught.
    pub panics: u64,
    /// Held right now (received, not settled).
    pub in_flight: u64,
    /// Most ever held at once.
    pub max_in_flight: u64,
    /// Most handlers ever running at once.
    pub max_running: u64,
}

impl Stats {
    pub(super) fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, AtomicOrdering::Relaxed);
    }

    /// Read all counters.
    pub fn snapshot(&self) -> StatsSnapshot {
        let r = |c: &AtomicU64| c.load(AtomicOrdering::Relaxed);
        StatsSnapshot {
            received: r(&self.received),
            processed: r(&self.processed),
            retried: r(&self.retried),
            dead_lettered: r(&self.dead_lettered),
            discarded: r(&self.discarded),
            duplicates: r(&self.duplicates),
            released: r(&self.released),
            settle_failures: r(&self.settle_failures),
            throttled: r(&self.throttled),
            panics: r(&self.panics),
            in_flight: r(&self.in_flight),
            max_in_flight: r(&self.max_in_flight),
            max_running: r(&self.max_running),
        }
    }
}
