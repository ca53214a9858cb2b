//! # reliq-nats
//!
//! The NATS JetStream backend of reliq: a thin mapping of reliq's seam onto JetStream.
//!
//! | reliq primitive | JetStream |
//! |---|---|
//! | publish (confirmed) | publish to the source stream's subject, wait for the `PubAck`; `Nats-Msg-Id` = message id (the server deduplicates a producer's retry) |
//! | subscribe | stream `<source>` (subjects `<source>`, `<source>.>` and `retry.<stream>.>`, message schedules allowed — NATS 2.12+; an existing stream is updated to have them), durable pull consumer `<consumer>`: explicit ack, `ack_wait` = lease, `max_ack_pending` = prefetch + headroom for delayed releases (never unlimited, see [`NatsOptions::retry_headroom`]), `max_deliver` = delivery limit, filter subjects = its filter (or `<source>`, `<source>.>`) and its own `retry.<stream>.<consumer>.due` |
//! | receive (bounded) | demand-driven pull requests (5 s expiry) of at most `prefetch − held` messages, all answered on one inbox the receiver keeps subscribed for its life; in-progress acks every `lease / 2` keep long handlers leased |
//! | close | the inbox is read until the open pull request ends; what arrives, and what is released after the close, is NAKed with a delay that outlasts that request (the server would hand a message NAKed at once straight back to it) — nothing waits for the ack wait |
//! | ack | `+ACK` (double-acked, i.e. confirmed by the server, by default) |
//! | retry after d | publish the retry copy (same id, failure headers) as a scheduled message to `retry.<stream>.<consumer>.at.<seq>` with `Nats-Schedule: @at <now + d>` (now in the server's clock, which fires it: this host's time plus the server's offset, measured from `STREAM.INFO`'s `ts`; a host minutes off still waits `d`) and `Nats-Schedule-Target: retry.<stream>.<consumer>.due`, wait for the `PubAck`, then `+ACK` the delivery: the retry waits durably in the stream, outside the consumer's `max_ack_pending`, and the server publishes it to the consumer's due subject after `d` (one schedule per subject: a retry scheduled again after a lost ack replaces it). The copy carries its origin (`reliq-nats-origin`: sequence and subject) |
//! | dead-letter | publish to the DLQ stream `DLQ_<stream>_<consumer>` (subject `dlq.<stream>.<consumer>`) with `Nats-Msg-Id` `dl:<stream>:<sequence of the message first consumed>` (a redelivery, a retry copy and the advisory watcher's entry for it park no second entry within the DLQ stream's duplicate window, 10 min; not the message id, which a foreign producer may reuse), wait for the `PubAck`, then `+TERM` |
//! | attempt | the delivery count in the message metadata; on a retry copy, the attempt it was retried at plus its own redeliveries |
//! | dead_letters | the DLQ stream read without a consumer: **browse** = direct gets of the next message on the DLQ subject from a stream sequence (nothing acked, delivered or moved; cursor = the next stream sequence, text); **get** = a browse for the id (the oldest copy); **remove** = `STREAM.MSG.DELETE` of the entry's sequence, confirmed by the server (oldest copy first; a sequence already gone is skipped); **count** = the stream's message count + the first entry's `reliq-dead-lettered-at` (one read) |
//! | backlog | the consumer's `num_pending` (due retries included) and `num_ack_pending`; retries waiting: the schedules on `retry.<stream>.<consumer>.at.>`, counted from the stream's per-subject totals |
//! | plan / inspect | the source stream (subjects, message schedules, no age/count/size limit, file storage), the DLQ stream (the same limits) and the durable consumer (`ack_policy`, `max_deliver`, filter subjects; `ack_wait`, `max_ack_pending` cosmetic), from `STREAM.INFO` and `CONSUMER.INFO` |
//! | crash loop | `max_deliver` (per stream message: the original and each retry copy); an **advisory watcher** turns `MAX_DELIVERIES` advisories into DLQ entries (reason `max-deliveries`), and `MSG_TERMINATED` advisories of terminations by other clients (reliq's own `+TERM reliq` are skipped) into entries with reason `permanent`, under the receiver's `Nats-Msg-Id` (one entry per message, whichever path parks it) |
//! | cluster, node loss | the URL may name every server: `nats://h1:4222,h2:4222,h3:4222?reliq.replicas=3`; async-nats connects to one and reconnects to another when it is lost (any server the cluster advertises, or only the URL's with `reliq.ignore_discovered_servers=true`: behind a proxy or NAT), and reliq's streams (source, DLQ) get `reliq.replicas` replicas ([`NatsOptions::replicas`]; an existing stream keeps its own). An R3 stream and its durable consumer elect a new leader when a node dies; a pull in flight then fails and is made again, unacked deliveries come back after `ack_wait`. Subscribing and opening the DLQ wait up to 30 s through an election. Tested by `just chaos` (the stream leader SIGKILLed mid-run, the DLQ stream refusing publishes for 30 s, the consumer's connection stalled for 10 s). |
//!
//! Why retries are scheduled messages, not `NakWithDelay`: a message naked with a delay
//! stays in the consumer's ack-pending set until it comes due, so a failure burst larger
//! than `max_ack_pending` held back every later message until the burst's tier ran out.
//! A schedule is an ordinary stored message (durable, replicated like the stream), counted
//! against no consumer. The schedules and due copies live in the source stream because a
//! schedule's target must be a subject of its own stream; each consumer reads only its own
//! due subject, so no other consumer of the source sees them. Consequences: a source
//! stream must be able to allow message schedules (not a mirror); the source names `retry`
//! and `dlq` are taken; a consumer made by an older reliq has a different filter and needs
//! [`ExistingConsumer::Update`] once.
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

mod advisories;
mod broker;
mod client;
mod clock;
mod codec;
mod dead_letters;
mod error;
mod names;
mod options;
mod permissions;
mod receiver;
mod topology;

pub use client::NatsBroker;
pub use codec::KEY_HEADER;
pub use error::NatsError;
pub use names::{
    dead_letter_stream, dead_letter_subject, retry_due_subject, retry_subjects, stream_name,
    subject,
};
pub use options::{ExistingConsumer, NatsOptions};

/// Test fault switches (shared by every backend; feature `test-util`).
#[cfg(feature = "test-util")]
pub use reliq_core::seam::Faults;

/// The URL schemes this backend serves (`reliq::connect` dispatches on them).
pub const SCHEMES: &[&str] = &["nats", "tls"];

/// Connect to the server a `nats://` or `tls://` URL names, as a [`reliq_core::Broker`].
pub async fn connect(
    url: &str,
) -> Result<std::sync::Arc<dyn reliq_core::Broker>, reliq_core::BrokerError> {
    Ok(std::sync::Arc::new(NatsBroker::connect(url).await?))
}
