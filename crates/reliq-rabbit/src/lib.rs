//! # reliq-rabbit
//!
//! The RabbitMQ backend of reliq, on [lapin]. It is a thin, documented mapping of the
//! [`Broker`]/[`Receiver`] seam onto native RabbitMQ mechanisms; the consumer runtime
//! (classification, the retry decision, the dead-letter record) stays in `reliq-core`.
//!
//! ## The mapping
//!
//! | seam | RabbitMQ |
//! |---|---|
//! | topology | per consumer, from the [`Subscription`]: topic exchange `source` (durable); quorum queue `<source>.<consumer>` bound with the filter (or `#`); one TTL queue per retry tier ([`Subscription::retry_name`]) dead-lettering through the default exchange to *this consumer's queue only*; the dead-letter stream `<source>.<consumer>.dlq.stream` (the DLQ), its removal ledger `….dlq.removed` (a stream) and the landing queue [`Subscription::dead_letter_name`] (`….dlq`, the consumer queue's dead-letter target). See [`plan_text`], [`Names`] and [`Broker::plan`]. |
//! | `publish` | publisher confirms + `mandatory`, persistent; `basic.return` → [`BrokerError::Unroutable`], nack → [`BrokerError::Rejected`], no confirm in time → [`BrokerError::Timeout`]; a missing exchange (channel close 404) → `Unroutable`, and the channel is reopened |
//! | `receive` | one channel per receiver, `basic.qos(prefetch)`, `basic.consume` with manual ack |
//! | `ack` | `basic.ack` |
//! | `retry` | publish the copy (confirmed, mandatory) to the tier's TTL queue via the default exchange, *then* `basic.ack` |
//! | `dead_letter` | publish the copy (confirmed, mandatory) to the dead-letter stream, *then* `basic.ack`; every append to a stream (dead letters, ledger records, read fences) goes out on a channel of that stream's own, because RabbitMQ before 4.0 drops and still confirms stream appends on a channel that also publishes elsewhere after the stream's leader changes (see `Inner::publish_to`) |
//! | `release` | `basic.nack(requeue=true)`, after the requested delay (the delivery stays unacked meanwhile) |
//! | drop / `close` | the channel is closed: RabbitMQ requeues every unacked delivery |
//! | attempt | the `reliq-attempt` header (never `x-death`) |
//! | delivery limit | quorum `x-delivery-limit` = [`Subscription::delivery_limit`]; the broker dead-letters (at-least-once) to the landing queue; the running consumer (a relay beside its receiver) and every dead-letter reader call move each landed message into the stream with a reliq [`DeadLetter`](reliq_core::DeadLetter) record made from its `x-death` (reason `max-deliveries`, the move's time, queue, exchange and routing key) — confirmed, *then* acked on the landing queue |
//! | `dead_letters` ([`RabbitDeadLetters`]) | **browse**: a stream consumer (`x-stream-offset` = the cursor, manual ack, prefetch 512) on its own channel; an ack on a stream removes nothing, so a browse changes no depth, order or delivery count; the cursor is the next stream offset; the end is a *read fence* the call appends once its consumer is attached (a confirmed, empty entry with a `reliq-fence` header, skipped by every read), so the read is complete on any node of a cluster. **remove**: the `(offset, id)` pairs of the oldest entries with those ids are appended to the removal ledger, confirmed before it returns; browse, get and count skip what the ledger names. **count**: a read of the stream less the ledger, with the oldest `reliq-dead-lettered-at`, without a fence (gauges poll it): to the end of what the node's member holds (the last chunk, probed with `x-stream-offset=last`). **get**: a read from the start. Each call first moves what sits in the landing queue into the stream. |
//! | `backlog` | `waiting`: the consumer queue's ready count and each TTL queue's, by passive `queue.declare` (live); `in_flight`: the queue's `messages_unacknowledged` from the management API when [`RabbitOptions::management_url`] is set (it trails by the statistics interval). |
//! | `plan` / `inspect` | the exchange, queues, streams and binding of the topology row, each planned argument resolved from the queue's arguments and the matching policy and operator policy (management API: `inspect` needs [`RabbitOptions::management_url`]); retry queues of earlier policies, with a passive declare's message count, as extra objects |
//! | `send_to_consumer` (replay) | publish to the default exchange with routing key = the consumer's queue |
//! | cluster, node loss | the URL may name every node: `amqp://user:password@h1:5672,h2:5672,h3:5672/vhost` (same credentials, vhost and query for each). A connection goes to one node, tried from the one that last answered, each within 10 s; when it is lost, the broker's next channel reconnects to the next node that answers, and the receiver re-declares its topology and resumes consuming there (a subscribe whose declarations lose the connection does the same, for up to 30 s, instead of failing the consumer's start). Unacked deliveries of the lost connection are requeued by RabbitMQ and delivered again (the inbox absorbs a repeated effect). Quorum queues (the default) are replicated on every node and elect a new leader when theirs dies; a dead letter the DLQ stream does not confirm within `confirm_timeout` is released and dead-lettered again later (the stream may then hold it twice). Tested by `just chaos` (leader SIGKILLed mid-run, the DLQ stream's writer suspended for 30 s, the consumer's connection stalled for 10 s). |
//!
//! ### The dead-letter stream
//!
//! - **Why a stream and a landing queue.** A stream is RabbitMQ's only queue type that
//!   can be read without consuming. Checked on 3.10.8: a stream takes confirmed,
//!   mandatory publishes through the default exchange, and a quorum queue's at-least-once
//!   dead-lettering (`overflow=reject-publish`) can target a stream — but the stream then
//!   keeps only flat headers: the `x-death` table (with the move's time and routing key)
//!   is dropped, only `x-first-death-queue/-reason/-exchange` survive. So the consumer
//!   queue dead-letters into a quorum landing queue, which keeps `x-death` whole, and
//!   reliq moves from there (at-least-once: a crash between the confirmed copy and the
//!   ack leaves a second entry with the same id in the stream, never a loss). Streams
//!   also cannot expire (`x-expires` is refused) and cannot delete one message.
//! - **Removal** is a ledger: a stream cannot drop one entry, so `remove` records the
//!   entry's offset and id in `….dlq.removed`, confirmed; every reader skips it from then
//!   on, also a new reader in another process. Removed entries stay on disk until the
//!   stream's retention drops them. Two processes removing the same id at the same moment
//!   may both pick the same entry (each reader serialises its own removals).
//! - **Retention**: none by default — a DLQ must not lose what it holds. An operator who
//!   wants the disk back sets `x-max-age` / `x-max-length-bytes` on the dead-letter stream
//!   with a policy (e.g. `rabbitmqctl set_policy reliq-dlq-retention '\.dlq\.stream$'
//!   '{"max-age":"30D"}' --apply-to queues`, `streams` on 3.12+); retention drops whole
//!   segments, oldest first, removed or not. Keep the ledger without retention (it holds a
//!   few bytes per removal): a ledger record dropped before its entry would bring the
//!   entry back.
//! - **Complete reads on a cluster.** RabbitMQ serves a stream consumer from the
//!   stream's member on the connection's node. A node with none running refuses it
//!   (`INTERNAL_ERROR`, or `PRECONDITION_FAILED` "does not have a replica on the local
//!   node" — seen 10 s after a rolling restart); the read then goes round the URL's
//!   other nodes, each on a connection of its own, for up to 15 s. A member behind its leader — a node just
//!   restarted, or one the leader's committed offset did not reach (the leader sends it
//!   without waiting, and drops it while the nodes' link is down) — delivers a
//!   consistent but short prefix, possibly until the stream is next written. So browse,
//!   get and remove append a fence to the stream and the ledger after attaching their
//!   consumer, and read until it: everything confirmed before the read began comes
//!   first. A member that does not deliver it within 15 s fails the read (naming the
//!   stream) rather than answer short. While the stream cannot take writes (its leader
//!   unavailable) these reads fail; `count`, unfenced, still answers from the node's
//!   member. `just chaos` has a test of it: the leader's replication to one node
//!   suspended while dead letters are parked, and a browse through that node.
//! - **Cost**: each call reads the landing queue, the new part of the ledger and the
//!   stream from its cursor; `count`, `get` and `remove` read the stream from the start.
//!   Browse, get and remove append one fence (~100 bytes) to each stream they read.
//! - **Existing deployments** (reliq before the stream): their quorum parking queue
//!   `<source>.<consumer>.dlq` keeps its name, type and arguments and becomes the landing
//!   queue, so no queue is redeclared with other arguments (a queue redeclared with
//!   another `x-queue-type` fails with PRECONDITION_FAILED, which reliq reports as
//!   [`BrokerError::Config`] naming the queue). The dead letters it holds are moved into
//!   the new stream by the first consumer or reader that starts; nothing to do by hand.
//!
//! Message mapping: id → AMQP `message_id` (the `reliq-id` header for ids over 255
//! bytes); key → the
//! `reliq-key` header ([`KEY_HEADER`]); every header → an AMQP long string.
//!
//! Queue settings (`delivery-limit`, `dead-letter-exchange` = `""`,
//! `dead-letter-routing-key`, `dead-letter-strategy=at-least-once`,
//! `overflow=reject-publish`, `message-ttl` on the tiers) live in **policies** when a
//! management API URL is configured ([`QueueSettings`]): one policy `reliq-<queue>` per
//! queue, put before the queue is declared (and only when it changed — every policy change
//! makes RabbitMQ re-match all queues of the vhost), `apply-to` = `queues` before 3.12 and
//! `quorum_queues` from 3.12 on; before that, reliq checks that no other policy with an
//! equal or higher priority matches the queue (an operator's broader policy would
//! otherwise silently replace reliq's and drop the delivery limit). Without a management URL they are queue arguments, which cannot be
//! changed on an existing queue: redeclaring it with another delivery limit fails with
//! [`BrokerError::Config`] (PRECONDITION_FAILED). [`plan_text`] prints both forms, for
//! operators who manage policies themselves.
//!
//! **Broker setting for operators**: a tier hands an expired message back to its source
//! queue through the broker's at-least-once dead-letter worker, which re-sends a forward
//! whose confirm never came only after `dead_letter_worker_publisher_confirm_timeout`
//! (default 180 s). After a broker restart the first forward can find the source queue
//! not yet up, so every retry that was waiting in a tier then stalls for 3 minutes
//! (measured here). Set it lower in `advanced.config`, e.g.
//! `[{rabbit, [{dead_letter_worker_publisher_confirm_timeout, 5000}]}].` (what
//! `scripts/brokers` does); a forward re-sent too early is a duplicate, which the
//! runtime's inbox absorbs like any redelivery.
//!
//! RabbitMQ 4.3's quorum-queue delayed retry is not used yet: the brokers reliq is tested
//! against here (3.10) do not have it, so retries always go through TTL tiers.
//!
//! ## Example
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use std::time::Duration;
//! use reliq_core::{BoxError, Broker, Consumer, Delivery, Destination, Message, RetryPolicy};
//! use reliq_rabbit::RabbitBroker;
//!
//! let broker = Arc::new(RabbitBroker::connect("amqp://guest:guest@127.0.0.1:5672/%2f").await?);
//! let consumer = Consumer::builder(broker.clone(), "inventory")
//!     .subscribe("orders").filter("order.*")
//!     .retry(RetryPolicy::tiers([Duration::from_secs(5), Duration::from_secs(30)]))
//!     .start(|d: Delivery| async move {
//!         let _text = d.text()?;
//!         Ok::<(), BoxError>(())
//!     })
//!     .await?;
//! broker
//!     .publish(&Destination::new("orders").with_route("order.created"), Message::new("hi"))
//!     .await?;
//! consumer.shutdown().await;
//! # Ok(()) }
//! ```
//!
//! ## Capabilities
//!
//! - `rejects_unroutable: true` — `mandatory` + returns, and a missing exchange is an error.
//! - `exact_retry_delay: false` — a retry waits for its tier's TTL: the policy's jitter is
//!   not applied (each tier is one queue with one TTL, so nothing blocks at the head).
//! - `delivery_limit: true` for quorum queues, `false` for classic queues (classic queues
//!   have no delivery limit, and their dead-lettering is at-most-once).
//! - `consumer_redelivery: true` — replay goes to one consumer's queue.
//!
//! Leases: RabbitMQ has no per-delivery lease; an unacked delivery stays with its channel
//! until it is settled, the channel closes or the broker's `consumer_timeout` (30 min by
//! default) fires. [`Subscription::lease`] is not used.
//!
//! ## Reconnecting
//!
//! A lost connection or channel is reopened with bounded exponential backoff and jitter
//! ([`Reconnect`]); the receiver re-declares its topology and consumes again. Deliveries
//! that were unacked on the lost channel come back from the broker (settling them on the
//! old channel fails with [`BrokerError::Connection`], and the runtime moves on). After
//! [`Reconnect::max_failures`] consecutive failures the operation returns a
//! `BrokerError::Connection` naming the last error.
//!
//! [lapin]: https://docs.rs/lapin
#![cfg_attr(test, allow(clippy::unwrap_used))]

#[cfg(doc)]
use reliq_core::{Broker, BrokerError, Subscription, seam::Receiver};

mod backlog;
mod broker;
mod client;
mod codec;
mod dead_letters;
mod error;
mod inspect;
mod management;
mod names;
mod options;
mod permissions;
mod receiver;
mod topology;

pub use client::RabbitBroker;
pub use codec::{Death, KEY_HEADER, deaths};
pub use dead_letters::RabbitDeadLetters;
pub use error::RabbitError;
pub use management::{Management, Policy};
pub use names::{Names, queue_name};
pub use options::encode_segment;
pub use options::{QueueSettings, QueueType, RabbitOptions, Reconnect, Tls};
pub use topology::{knows_quorum_apply_to, plan_text, rabbit_delivery_limit};

/// The URL schemes this backend serves (`reliq::connect` dispatches on them).
pub const SCHEMES: &[&str] = &["amqp", "amqps"];

/// Connect to the broker an `amqp://` or `amqps://` URL names, as a
/// [`reliq_core::Broker`], with the options its query gives ([`RabbitOptions::from_url`]:
/// `reliq.management=15672` for the management API; `cacertfile`, `certfile`, `keyfile`
/// for a private CA and a client certificate; `password.file` / `password.env`).
pub async fn connect(
    url: &str,
) -> Result<std::sync::Arc<dyn reliq_core::Broker>, reliq_core::BrokerError> {
    let (url, options) = RabbitOptions::from_url(url)?;
    Ok(std::sync::Arc::new(
        RabbitBroker::connect_with(&url, options).await?,
    ))
}
