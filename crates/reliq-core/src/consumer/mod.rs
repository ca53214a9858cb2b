//! The consumer runtime, written once for every backend: what it guarantees is on
//! [`Consumer`].
//!
//! The files follow a delivery, each using only the ones after it: `receive.rs` (the
//! receive loop and how deliveries are handed out: in groups, per key, as a batch) →
//! `handle.rs` (the handler call, the inbox claim, the outcome) → `settle.rs` (ack,
//! retry, dead-letter, release, each confirmed). `builder.rs` assembles them;
//! `running.rs` is the [`ConsumerHandle`] of a started consumer.

mod builder;
mod error;
mod handle;
mod rate;
mod receive;
mod running;
mod settle;
mod signal;
mod stats;

pub use builder::{Consumer, ConsumerBuilder};
pub use error::ConsumerError;
pub use receive::DeliveryOrder;
pub use running::{ConsumerHandle, ShutdownReport};
pub use stats::{Stats, StatsSnapshot};
