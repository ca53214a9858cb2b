//! The consumer runtime, written once for every backend:
//! receive (bounded) → handle (timeout, panic capture) → classify → ack / retry /
//! dead-letter.
//!
//! The files follow a delivery, each using only the ones after it: `receive.rs` (the
//! receive loop and how deliveries are handed out: in groups, per key, as a batch) →
//! `handle.rs` (the handler call, the inbox claim, the outcome) → `settle.rs` (ack,
//! retry, dead-letter, release, each confirmed). `builder.rs` assembles them;
//! `running.rs` is the [`ConsumerHandle`] of a started consumer.
//!
//! Guarantees:
//! - The source delivery is settled only after the retry or dead-letter copy was
//!   confirmed by the broker. If that publish fails (the DLQ or retry route down, a node
//!   lost), the delivery is *held* — still leased, its handler not called again, no
//!   attempt spent — and the copy sent again after the settle back-off, until it is
//!   confirmed; a hard stop releases it (the broker delivers it again later). A delivery
//!   the receiver no longer holds (its channel closed, its partition revoked) is left to
//!   the broker's redelivery. A message is never dropped and never just logged.
//! - At most `max_in_flight` deliveries are held (received, not yet settled); the broker
//!   is asked for the same prefetch bound. At most `concurrency` handlers run at once.
//! - With [`DeliveryOrder::PerKey`], deliveries with the same key are handled one after the
//!   other in arrival order, while other keys run in parallel.
//! - Shutdown stops receiving, lets in-flight work finish within `shutdown_timeout`, then
//!   releases whatever is left. Nothing is lost and nothing is settled twice.

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

use crate::headers::DeadLetterReason;

/// The dead-letter reason reliq uses for a broker's own delivery-limit move, exposed for
/// backends that translate native metadata (e.g. `x-death reason=delivery_limit`).
pub const BROKER_LIMIT_REASON: DeadLetterReason = DeadLetterReason::MaxDeliveries;
