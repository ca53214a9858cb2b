//! Runtime behaviour beyond the portable suite, on the memory backend (virtual time):
//! handler timeouts, unknown errors, custom classification, the discard route, startup
//! validation that names the bad setting, the metrics contract, a backend breaking the
//! `receive_batch` contract, batch handlers, and the acks of deliveries handled together.
//! One module per theme; what they share is in `support`.

// Test code: a failed unwrap is a failed test, in helpers as in #[test] functions.
#![allow(clippy::unwrap_used)]

mod batch;
mod config;
mod failures;
mod observability;
mod settling;
mod support;
