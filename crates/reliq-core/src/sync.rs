//! The one poison-tolerant lock helper, for this crate and the backends.

use std::sync::{Mutex, MutexGuard};

/// Lock `m`, taking the value of a poisoned lock. Every critical section in reliq leaves
/// what it guards consistent (single inserts, removes, swaps), so a panic that unwound
/// through one leaves usable data; refusing it would turn one panic into a stuck consumer.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}
