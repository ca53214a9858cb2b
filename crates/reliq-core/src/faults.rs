use crate::sync::lock;
use std::collections::HashSet;
use std::sync::Mutex;

/// Switches that make a backend's operations fail for chosen consumers (feature
/// `test-util`). One type for every backend: the embedded broker, NATS and SQS consult it.
///
/// Fault injection shared by the backends' test factories.
///
/// Most faults the conformance suite needs are real (a deleted DLQ, a deleted retry
/// queue or topic). Where a broker's retry is an in-place operation that only fails when
/// the connection is gone (NATS `NakWithDelay`, SQS `ChangeMessageVisibility`), a test
/// cannot break it for one consumer alone; backends then consult this switch, handed to
/// them in their options. Production code never sets it.
#[derive(Debug, Default)]
pub struct Faults {
    broken_retry: Mutex<HashSet<String>>,
    broken_dead_letter: Mutex<HashSet<String>>,
}

fn switch(set: &Mutex<HashSet<String>>, consumer: &str, available: bool) {
    let mut set = lock(set);
    if available {
        set.remove(consumer);
    } else {
        set.insert(consumer.to_owned());
    }
}

fn is_set(set: &Mutex<HashSet<String>>, consumer: &str) -> bool {
    lock(set).contains(consumer)
}

impl Faults {
    /// Make retries of `consumer` fail (or work again).
    pub fn set_retry_available(&self, consumer: &str, available: bool) {
        switch(&self.broken_retry, consumer, available);
    }

    /// True while retries of `consumer` are made to fail.
    pub fn retry_broken(&self, consumer: &str) -> bool {
        is_set(&self.broken_retry, consumer)
    }

    /// Make dead-lettering by `consumer` fail (or work again), where the backend cannot
    /// break its DLQ for real.
    pub fn set_dead_letter_available(&self, consumer: &str, available: bool) {
        switch(&self.broken_dead_letter, consumer, available);
    }

    /// True while dead-lettering by `consumer` is made to fail.
    pub fn dead_letter_broken(&self, consumer: &str) -> bool {
        is_set(&self.broken_dead_letter, consumer)
    }
}
