//! # reliq-nats
//!
//! The NATS JetStream backend of reliq: a thin mapping of reliq's seam onto JetStream.
//!
//! | reliq primitive | JetStream |
//! |---|---|
//! | publish (confirmed) | publish to the source stream's subject, wait for the `PubAck`; `Nats-Msg-Id` = message id (the server deduplicates a producer's retry) |
//! | subscribe | stream `<source>` (subjects `<source>` and `<source>.>`), durable pull consumer `<consumer>`: explicit ack, `ack_wait` = lease, `max_ack_pending` = prefetch + retry headroom (never unlimited, see [`NatsOptions::retry_headroom`]), `max_deliver` = delivery limit |
//! | receive (bounded) | demand-driven pulls of at most `prefetch − held` messages; in-progress acks every `lease / 2` keep long handlers leased |
//! | ack | `+ACK` (double-acked, i.e. confirmed by the server, by default) |
//! | retry after d | `NakWithDelay(d)`: the server redelivers the original after `d`; never a plain `nak()` |
//! | dead-letter | publish to the DLQ stream `DLQ_<stream>_<consumer>` (subject `dlq.<stream>.<consumer>`), wait for the `PubAck`, then `+TERM` |
//! | attempt | the delivery count in the message metadata |
//! | dead_letters | the DLQ stream read without a consumer: **browse** = direct gets of the next message on the DLQ subject from a stream sequence (nothing acked, delivered or moved; cursor = the next stream sequence, text); **get** = a browse for the id (the oldest copy); **remove** = `STREAM.MSG.DELETE` of the entry's sequence, confirmed by the server (oldest copy first; a sequence already gone is skipped); **count** = the stream's message count + the first entry's `reliq-dead-lettered-at` (one read) |
//! | crash loop | `max_deliver`; an **advisory relay** turns `MAX_DELIVERIES` advisories into DLQ entries (reason `max-deliveries`), and `MSG_TERMINATED` advisories of terminations by other clients (reliq's own `+TERM reliq` are skipped) into entries with reason `permanent`, idempotently (`Nats-Msg-Id`) |
//!
//! Capabilities (documented limitations, see [`reliq_core::Capabilities`]):
//! `attempts_count_every_delivery` (the attempt is the server's delivery count, so a release
//! or a crash also uses an attempt), `deduplicates_publishes` (a second publish of an id
//! inside the stream's duplicate window is dropped by the server), no per-consumer input
//! (`send_to_consumer` is unsupported: a replay goes to the original subject, seen by every
//! consumer of that subject — the inbox absorbs it where it was already handled).
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use reliq_core::{Broker, Destination, Message};
//! let broker: Arc<dyn Broker> = Arc::new(reliq_nats::NatsBroker::connect("nats://127.0.0.1:4222").await?);
//! broker.publish(&Destination::new("orders").with_route("created"), Message::new("{}")).await?;
//! # Ok(()) }
//! ```

mod broker;
mod codec;
mod dead_letters;
mod error;
mod names;
mod options;
mod receiver;
mod relay;

pub use broker::NatsBroker;
pub use codec::KEY_HEADER;
pub use names::{dead_letter_stream, dead_letter_subject, stream_name, subject};
pub use options::{ExistingConsumer, NatsOptions};

/// Test fault switches (shared by every backend).
pub use reliq_core::faults::Faults;
