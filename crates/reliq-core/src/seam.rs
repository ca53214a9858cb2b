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
//!   redelivering or counting an attempt; `get`, a confirmed `remove` (one dead letter
//!   per id, the oldest, with all its copies), `count` with the oldest entry's
//!   `reliq-dead-lettered-at` ([`DeadLetterCount::note`] reads it). Every method cancel
//!   safe: the cursor is an input, never reader state. A dead letter written twice (a
//!   lost confirm, a crash before the source was settled) is one dead letter: browse
//!   shows it once, count counts it once, remove takes every copy — [`CopyIndex`] does
//!   that bookkeeping where the broker cannot deduplicate the writes, [`IdCounts`] the
//!   one-per-id bookkeeping where it can.
//! - `plan` lists every object `subscribe` declares, with the settings that matter
//!   ([`Plan`](crate::topology::Plan)); mark each object that holds the consumer's
//!   messages with [`PlannedObject::carrying`](crate::topology::PlannedObject::carrying) —
//!   the source, each retry tier (or the one object that holds them all), the DLQ — with
//!   the address producers use and the broker's AsyncAPI bindings: the service's AsyncAPI
//!   document ([`AsyncApi`](crate::AsyncApi)) is built from those marks alone.
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
//! - [`headers`]: the header names every backend writes and reads
//!   (message id, attempt, the dead-letter record, the origin), and their time format.
//! - [`keep_leased`]: renew a per-delivery lease while a handler runs, where the broker
//!   leases each delivery for a fixed time.
//! - With the `test-util` feature, `Faults`: the switches a
//!   backend consults where a test cannot break a route for real.

pub use crate::broker::Receiver;
// The root items the contract above names.
#[cfg(doc)]
use crate::{
    backlog::Backlog,
    broker::Broker,
    dead_letters::{Cursor, DeadLetterCount, DeadLetters},
    delivery::Delivery,
    error::BrokerError,
    subscription::{Capabilities, Subscription},
};

pub use crate::dead_letters::{CopyIndex, IdCounts, Picked};
pub use crate::delivery::{DeliveryPool, DeliveryToken, RawMessage, ReceiverId, RetryRequest};
#[cfg(feature = "test-util")]
pub use crate::faults::Faults;
pub use crate::lease::{Renewed, keep_leased};
pub use crate::outbox::{OutboxColumns, OutboxWakeup, PollOnly, decode_headers, encode_headers};
pub use crate::permissions::{aws_partition, iam_policy};
pub use crate::subscription::word_characters;
pub use crate::sync::lock;
pub use crate::topology::{compare, duration_text};

/// The header names every backend writes and reads on every message, their time format,
/// and the attempt count read from them.
///
/// Every name reliq owns starts with [`PREFIX`](headers::PREFIX); the only exceptions are the W3C trace
/// context names (`traceparent`, `tracestate`) and `content-type` (a typed publish's
/// media type, as CloudEvents' bindings spell it), which keep their standard spelling
/// to interoperate with other tracers and readers. Backends map some of these to native fields (AMQP
/// `message_id`, `Nats-Msg-Id`, the Kafka record key) but always carry the header too, so
/// one decoder reads a dead letter from any broker ([`DeadLetter`](crate::DeadLetter)).
///
/// Timestamps are RFC 3339 in UTC with milliseconds (`2026-11-29T09:15:11.123Z`).
pub mod headers {
    pub use crate::headers::{
        ATTEMPT, CAUSATION_ID, CONSUMER, CONTENT_TYPE, CORRELATION_ID, DEAD_LETTER_REASON,
        DEAD_LETTER_VERSION, DEAD_LETTERED_AT, ERROR_CLASS, FAILURE_HEADERS, FIRST_FAILURE_AT,
        LAST_ERROR, LAST_FAILURE_AT, MAX_ERROR_LEN, MESSAGE_ID, OCCURRED_AT, ORIGINAL_DESTINATION,
        ORIGINAL_OFFSET, ORIGINAL_PARTITION, ORIGINAL_ROUTE, ORIGINAL_SEQUENCE, PREFIX,
        REPLAY_COUNT, REPLAYED_AT, TRACEPARENT, TRACESTATE, attempt, format_time, parse_time,
        sanitize_error,
    };
}

/// Secrets in broker URLs: where they may come from, and how they are kept out of
/// process lists, `Debug` output, errors and logs.
///
/// Every backend reads its settings from the URL's query (`key=value`). A setting whose
/// value is a secret can instead name where the value is:
///
/// - `<key>.file=/run/secrets/kafka-password` — the file's contents (one trailing newline
///   dropped), as mounted by Kubernetes or Docker secrets;
/// - `<key>.env=KAFKA_PASSWORD` — an environment variable.
///
/// so that `ps` shows a path, not the password. Query values are percent-decoded
/// (`%26` is `&`), so a password may hold any character.
///
/// [`redact_url`](secrets::redact_url) is what every message, log line and `Debug` of a
/// config shows: the password of the user-info part and the value of every
/// secret-looking key ([`is_secret_key`](secrets::is_secret_key)) become `***`.
pub mod secrets {
    pub use crate::secrets::{
        SecretError, is_secret_key, percent_decode, redact_url, resolve_setting,
    };
}
