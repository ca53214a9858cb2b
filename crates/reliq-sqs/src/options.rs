//! Settings of an SQS connection.

#[cfg(feature = "test-util")]
use std::sync::Arc;
use std::time::Duration;

/// The longest delay SQS can hold a message invisible (12 h).
pub const MAX_VISIBILITY: Duration = Duration::from_secs(12 * 60 * 60);

/// Settings of an SQS connection.
#[derive(Clone, Debug)]
pub struct SqsOptions {
    /// Longest long-poll wait (`WaitTimeSeconds`, ≤ 20 s). The receiver uses at most half
    /// the lease, so a poll still open when a consumer dies ends before the dead
    /// consumer's messages become visible again (and cannot swallow a redelivery).
    pub wait_time: Duration,
    /// How long a publisher caches the queues of a topic.
    pub topic_cache_ttl: Duration,
    /// How long the visibility extender keeps one delivery leased at most.
    pub max_lease_extension: Duration,
    /// The scan lease: how long a dead-letter scan (every browse, get, remove and count
    /// is one) keeps what it received hidden at most. A scan makes everything visible
    /// again when it ends; the lease only matters for a scan that dies mid-way (its
    /// entries stay hidden this long) and must outlast the longest scan (a scan of the
    /// whole DLQ).
    pub dead_letter_lease: Duration,
    /// Most entries one dead-letter scan (browse, get, remove) reads; a DLQ holding more
    /// shows only the first this many received (standard queues: any of them).
    pub dead_letter_scan_max: usize,
    /// Most entries the scan of [`DeadLetters::count`](reliq_core::DeadLetters::count)
    /// reads to find the oldest dead-lettered-at time (the count itself is SQS's).
    pub dead_letter_count_scan_max: usize,
    /// How long sends and deletes for one queue wait to be batched
    /// (`SendMessageBatch` / `DeleteMessageBatch`, ≤ 10 entries); zero still batches
    /// what arrives together.
    pub batch_window: Duration,
    /// Declare FIFO queues (`.fifo`, also via the URL option `fifo=true`): the message key
    /// is the `MessageGroupId` (keyless messages share one group), the message id the
    /// `MessageDeduplicationId`, so a producer's retry of a publish within SQS's 5-minute
    /// window is dropped by SQS. Order holds within a group: the receiver hands out one
    /// message per group at a time, so any concurrency keeps it (groups run side by
    /// side). A retry (`ChangeMessageVisibility`) holds its whole group: later messages
    /// with the same key wait until the retried one is settled — in-place, ordered
    /// retries. Replay (`send_to_consumer`) uses a fresh deduplication id, so it is not
    /// dropped as a duplicate of the original.
    pub fifo: bool,
    /// Fault injection for tests (see [`Faults`]; feature `test-util`).
    #[cfg(feature = "test-util")]
    pub faults: Option<Arc<Faults>>,
}

impl Default for SqsOptions {
    fn default() -> Self {
        Self {
            wait_time: Duration::from_secs(20),
            topic_cache_ttl: Duration::from_secs(1),
            max_lease_extension: Duration::from_secs(60 * 60),
            dead_letter_lease: Duration::from_secs(60),
            dead_letter_scan_max: 10_000,
            dead_letter_count_scan_max: 1_000,
            batch_window: Duration::from_millis(5),
            fifo: false,
            #[cfg(feature = "test-util")]
            faults: None,
        }
    }
}

/// Test fault switches (shared by every backend; feature `test-util`).
#[cfg(feature = "test-util")]
pub use reliq_core::seam::Faults;
