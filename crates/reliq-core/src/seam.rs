//! # The backend seam: what a backend implements and what it may use
//!
//! A backend is a thin mapping of these few items onto one broker's own mechanisms; the
//! consumer runtime, the classification, the retry decisions, the dead-letter record and
//! the replay engine stay in this crate and are the same on every backend. This module is
//! the one place to read before writing a sixth backend: the contract is below, each
//! item's own docs give the details, and `reliq-conformance` checks all of it (stamp the
//! suite for the new backend with `conformance_suite!`; name every scenario left out and
//! why in the backend's test file).
//!
//! ## Implement
//!
//! - [`Broker`]: `publish` returns after the broker's confirm, never before;
//!   `subscribe` declares the topology idempotently (source, one retry route per
//!   [`Subscription::retry_tiers`] entry or an in-place delay, the DLQ) and returns a
//!   [`Receiver`]; `dead_letters` returns a [`DeadLetters`] reader; `send_to_consumer`
//!   (replay to one consumer only) where the broker has a per-consumer input; `backlog`
//!   (what waits for the consumer, in flight, on each retry tier) from the broker's own
//!   counters ([`Backlog`]);
//!   `capabilities` says honestly what the broker cannot do ([`Capabilities`]; the
//!   conformance suite adapts its assertions to it, never the other way round). A
//!   [`Subscription::filter`] the broker cannot apply is refused with
//!   [`Subscription::refuse_filter`], not ignored.
//! - [`Receiver`]: a bounded stream — never more than [`Subscription::prefetch`]
//!   unsettled deliveries held — whose `receive` / `receive_batch` are **cancel safe**
//!   (the runtime races them against shutdown; see their `# Cancel safety` sections);
//!   each delivery is settled exactly once, by `ack` / `ack_batch`, `retry` (the copy
//!   confirmed *before* the source is settled), `dead_letter` (likewise) or `release`;
//!   `close` gives back what it holds and leaves nothing leased. A failed `retry` or
//!   `dead_letter` leaves the delivery unsettled: the runtime holds it (keep it leased)
//!   and sends the copy again after its back-off, until it is confirmed or the receiver
//!   answers [`BrokerError::NotHeld`] (it no longer holds the delivery).
//!   `try_receive_batch` / `try_ack_batch` are optional shortcuts for a backend that
//!   hands out or acknowledges without waiting (the embedded broker; Kafka's acks): the
//!   runtime calls them first and builds the boxed `async` call only when they decline.
//! - [`DeadLetters`]: `browse` from a [`Cursor`] without removing, reordering,
//!   redelivering or counting an attempt; `get`, a confirmed `remove` (one entry per id,
//!   the oldest), `count` with the oldest entry's `reliq-dead-lettered-at`
//!   ([`DeadLetterCount::note`] reads it). Every method cancel safe: the cursor is an
//!   input, never reader state. [`IdCounts`] does the one-entry-per-id bookkeeping.
//! - Errors: return [`BrokerError`] and keep the client's error as the source
//!   ([`BrokerError::connection`], [`BrokerError::rejected`], `.caused_by(e)`); the
//!   classifier maps the variants to transient or permanent for handlers that publish.
//!
//! ## Use
//!
//! - [`Delivery`]: build one per received message, with a [`DeliveryToken`] made by
//!   [`DeliveryToken::new`] with this receiver's [`ReceiverId`] (a settle call starts with
//!   [`DeliveryToken::extra_of`] or [`DeliveryToken::check`], which refuse another
//!   receiver's delivery with [`BrokerError::ForeignDelivery`]); a backend whose client
//!   hands out records it can read in place gives a [`RawMessage`] instead of a decoded
//!   [`Message`](crate::message::Message) (`Delivery::raw`), decoded on first read. A backend
//!   that builds deliveries in memory at a high rate makes them from a [`DeliveryPool`],
//!   which recycles each one's allocation when its last clone drops.
//! - [`RetryRequest`]: the copy to hold, its delay and its tier.
//! - [`headers`](crate::headers): the header names every backend writes and reads
//!   (message id, attempt, the dead-letter record, the origin), and their time format.
//! - [`keep_leased`]: renew a per-delivery lease while a handler runs, where the broker
//!   leases each delivery for a fixed time.
//! - With the `test-util` feature, [`Faults`](crate::faults::Faults): the switches a
//!   backend consults where a test cannot break a route for real.

pub use crate::backlog::{Backlog, TierBacklog};
pub use crate::broker::{
    Broker, BrokerError, Capabilities, Delivery, DeliveryPool, DeliveryToken, RawMessage, Receiver,
    ReceiverId, RetryRequest, Subscription,
};
pub use crate::dead_letters::{
    Cursor, DeadLetterCount, DeadLetterEntry, DeadLetterPage, DeadLetters, IdCounts,
};
pub use crate::lease::{Renewed, keep_leased};
