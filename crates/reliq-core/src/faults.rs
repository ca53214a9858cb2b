//! Fault injection shared by the backends' test factories.
//!
//! Most faults the conformance suite needs are real (a deleted DLQ, a deleted retry
//! queue or topic). Where a broker's retry is an in-place operation that only fails when
//! the connection is gone (NATS `NakWithDelay`, SQS `ChangeMessageVisibility`), a test
//! cannot break it for one consumer alone; backends then consult this switch, handed to
//! them in their options. Production code never sets it.

use std::collections::HashSet;
use std::sync::Mutex;

/// Switches that make a backend's operations fail for chosen consumers.
#[derive(Debug, Default)]
pub struct Faults {
    broken_retry: Mutex<HashSet<String>>,
}

impl Faults {
    /// Make retries of `consumer` fail (or work again).
    pub fn set_retry_available(&self, consumer: &str, available: bool) {
        let mut set = self.broken_retry.lock().unwrap_or_else(|p| p.into_inner());
        if available {
            set.remove(consumer);
        } else {
            set.insert(consumer.to_owned());
        }
    }

    /// True while retries of `consumer` are made to fail.
    pub fn retry_broken(&self, consumer: &str) -> bool {
        self.broken_retry
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(consumer)
    }
}
