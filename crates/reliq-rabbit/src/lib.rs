//! # reliq-rabbit
//!
//! The RabbitMQ backend of reliq, on [lapin]. It is a thin, documented mapping of the
//! [`Broker`]/[`Receiver`] seam onto native RabbitMQ mechanisms; the consumer runtime
//! (classification, the retry decision, the dead-letter record) stays in `reliq-core`.
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
//!     .subscribe("orders", Some("order.*".to_string()))
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
//! ## The mapping
//!
//! | seam | RabbitMQ |
//! |---|---|
//! | topology | per consumer, from the [`Subscription`]: topic exchange `source` (durable); quorum queue `<source>.<consumer>` bound with the filter (or `#`); one TTL queue per retry tier ([`Subscription::retry_name`]) dead-lettering through the default exchange to *this consumer's queue only*; parking queue [`Subscription::dead_letter_name`]. See [`plan`]. |
//! | `publish` | publisher confirms + `mandatory`, persistent; `basic.return` → [`BrokerError::Unroutable`], nack → [`BrokerError::Rejected`], no confirm in time → [`BrokerError::Timeout`]; a missing exchange (channel close 404) → `Unroutable`, and the channel is reopened |
//! | `receive` | one channel per receiver, `basic.qos(prefetch)`, `basic.consume` with manual ack |
//! | `ack` | `basic.ack` |
//! | `retry` | publish the copy (confirmed, mandatory) to the tier's TTL queue via the default exchange, *then* `basic.ack` |
//! | `dead_letter` | publish the copy (confirmed, mandatory) to the parking queue, *then* `basic.ack` |
//! | `release` | `basic.nack(requeue=true)`, after the requested delay (the delivery stays unacked meanwhile) |
//! | drop / `close` | the channel is closed: RabbitMQ requeues every unacked delivery |
//! | attempt | the `reliq-attempt` header (never `x-death`) |
//! | delivery limit | quorum `x-delivery-limit` = [`Subscription::delivery_limit`]; the broker dead-letters (at-least-once) to the parking queue; [`Broker::dead_letters`] turns its `x-death` into a reliq [`DeadLetter`](reliq_core::DeadLetter) record with reason `max-deliveries` |
//! | `send_to_consumer` (replay) | publish to the default exchange with routing key = the consumer's queue |
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
//! [`BrokerError::Config`] (PRECONDITION_FAILED). [`plan`] prints both forms, for
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

mod broker;
mod codec;
mod error;
mod management;
mod names;
mod options;
mod receiver;
mod topology;

pub use broker::RabbitBroker;
pub use codec::{Death, KEY_HEADER, deaths};
pub use error::RabbitError;
pub use management::{Management, Policy, encode_segment};
pub use names::{Names, queue_name};
pub use options::{QueueSettings, QueueType, RabbitOptions, Reconnect};
pub use topology::{knows_quorum_apply_to, plan, rabbit_delivery_limit};
