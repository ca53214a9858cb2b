use std::time::Duration;

use async_trait::async_trait;

use crate::backlog::Backlog;
use crate::dead_letters::DeadLetters;
use crate::message::Message;
use crate::topology::{LiveTopology, Plan, TopologyReport};

use crate::delivery::{Delivery, RetryRequest};
use crate::error::BrokerError;
use crate::subscription::{Capabilities, Destination, Subscription};

/// A message broker connection.
///
/// The seam between the runtime and a backend: [`Broker`] and [`Receiver`].
///
/// A backend implements a few small primitives, each mapped to its broker's native
/// mechanism (see the backend crate's docs for the mapping). Everything else — handling,
/// classification, the retry decision, the dead-letter record, metrics, tracing,
/// shutdown — lives once, in the runtime behind [`Consumer`](crate::Consumer).
///
/// Rules every backend keeps (the conformance suite checks them):
/// - `publish` returns only after the broker confirmed the message (a confirm, a PubAck,
///   a delivery report, a 200); an unroutable destination is an error.
/// - `retry` and `dead_letter` make the copy durable (confirmed) *before* they settle the
///   source delivery; when they fail, the source is left unsettled — the runtime then
///   calls `release`.
/// - `receive` never hands out more than [`Subscription::prefetch`] unsettled deliveries.
#[async_trait]
pub trait Broker: Send + Sync + 'static {
    /// The backend's name: `memory`, `kafka`, `rabbit`, `nats`, `sqs`.
    fn kind(&self) -> &'static str;

    /// What this backend can and cannot do.
    fn capabilities(&self) -> Capabilities;

    /// One round trip to the broker that changes nothing — a readiness probe (`/readyz`
    /// of the admin server). `Ok` means the broker answered just now, not that a cached
    /// connection state says it is up. Callers bound it with their own deadline.
    async fn ping(&self) -> Result<(), BrokerError>;

    /// Publish and wait for the broker's confirmation.
    async fn publish(&self, destination: &Destination, message: Message)
    -> Result<(), BrokerError>;

    /// Declare the subscription's topology (idempotently) and start receiving.
    async fn subscribe(
        &self,
        subscription: &Subscription,
    ) -> Result<Box<dyn Receiver>, BrokerError>;

    /// This consumer's dead-letter queue, read without consuming it (see
    /// [`DeadLetters`]): for the replay engine and the operator tools.
    async fn dead_letters(
        &self,
        subscription: &Subscription,
    ) -> Result<Box<dyn DeadLetters>, BrokerError>;

    /// What waits in the broker for this consumer: unreceived messages, deliveries not
    /// settled, retries on each tier ([`Backlog`] says per broker what each number is).
    /// Read from the broker's own counters, cheaply enough for a poller to call every
    /// few seconds. The subscription's topology must exist: a missing queue or stream is
    /// an error, never a zero.
    async fn backlog(&self, subscription: &Subscription) -> Result<Backlog, BrokerError>;

    /// The objects and settings a consumer with this subscription needs at the broker —
    /// what [`Broker::subscribe`] declares, and the settings that change what the broker
    /// does to its messages (see [`Plan`](crate::Plan)). Reads nothing that
    /// changes; may ask the broker for its version.
    async fn plan(&self, subscription: &Subscription) -> Result<Plan, BrokerError>;

    /// The planned objects as the broker has them now, and this consumer's objects the
    /// plan does not have (an earlier policy's retry tiers, with what they hold).
    /// Changes nothing.
    async fn inspect(
        &self,
        subscription: &Subscription,
        plan: &Plan,
    ) -> Result<LiveTopology, BrokerError>;

    /// The plan and every difference the broker has from it.
    async fn check_topology(
        &self,
        subscription: &Subscription,
    ) -> Result<TopologyReport, BrokerError> {
        let plan = self.plan(subscription).await?;
        let live = self.inspect(subscription, &plan).await?;
        Ok(TopologyReport::new(plan, &live))
    }

    /// What the credentials of a service with this `access` must allow at the broker —
    /// derived from the same names as [`Broker::plan`], so least privilege is generated,
    /// not guessed. Reads nothing from the broker. Backends that cannot say return
    /// [`BrokerError::Unsupported`].
    async fn permissions(
        &self,
        access: &crate::permissions::Access,
    ) -> Result<crate::permissions::Permissions, BrokerError> {
        let _ = access;
        Err(BrokerError::Unsupported {
            backend: self.kind(),
            what: "permissions",
        })
    }

    /// Deliver `message` to this consumer only (not to every consumer of its source),
    /// confirmed. Used by replay. Backends without a per-consumer input return
    /// [`BrokerError::Unsupported`].
    async fn send_to_consumer(
        &self,
        subscription: &Subscription,
        message: Message,
    ) -> Result<(), BrokerError> {
        let _ = (subscription, message);
        Err(BrokerError::Unsupported {
            backend: self.kind(),
            what: "send_to_consumer",
        })
    }
}

/// A bounded stream of deliveries for one subscription, and how to settle them.
///
/// Each delivery is settled exactly once by the runtime: `ack`, `retry`, `dead_letter`,
/// or `release`. When `retry`/`dead_letter` fail, the delivery is still unsettled.
/// Dropping the receiver returns every unsettled delivery to the broker.
#[async_trait]
pub trait Receiver: Send + Sync {
    /// The next delivery; waits. [`BrokerError::Closed`] once closed.
    ///
    /// # Cancel safety
    ///
    /// Must be cancel safe: if the future is dropped before it completes, no delivery is
    /// lost — whatever it took from the broker stays with the receiver (buffered for the
    /// next receive) or goes back to the broker.
    async fn receive(&self) -> Result<Delivery, BrokerError>;

    /// Append up to `max` deliveries to `into`: waits for the first, then takes only what
    /// is ready without waiting. Each delivery counts against the prefetch bound as if
    /// received alone. The runtime receives through this, so a backend whose client
    /// already holds records in memory (Kafka's fetch queue) pays its per-receive cost —
    /// a lock, a wake-up — once per batch. The default takes one delivery.
    ///
    /// # Cancel safety
    ///
    /// Must be cancel safe, and the runtime relies on it at shutdown: a delivery taken
    /// from the broker is either pushed into `into` before the next `.await` point or
    /// kept by the receiver for the next receive. When the future is dropped, what is in
    /// `into` is the caller's (the runtime releases it); nothing else is lost or left
    /// leased.
    async fn receive_batch(&self, max: usize, into: &mut Vec<Delivery>) -> Result<(), BrokerError> {
        let _ = max;
        into.push(self.receive().await?);
        Ok(())
    }

    /// [`Receiver::receive_batch`] when deliveries are ready now: appends up to `max` of
    /// them to `into` without waiting and returns `true` if it took any. `false` (the
    /// default): nothing ready, or no such shortcut — the runtime then waits in
    /// `receive_batch`. For a backend that hands out what is ready without I/O (the
    /// embedded broker, under its lock), so that the busy path awaits no boxed future.
    fn try_receive_batch(&self, max: usize, into: &mut Vec<Delivery>) -> bool {
        let _ = (max, into);
        false
    }

    /// The work is done: remove/commit.
    async fn ack(&self, delivery: &Delivery) -> Result<(), BrokerError>;

    /// [`Receiver::ack`] for several deliveries (a batch handler's successes); returns
    /// the failures, by index into `deliveries` (empty: all acknowledged). The default
    /// acks each, concurrently (SQS's delete batcher turns concurrent acks into
    /// `DeleteMessageBatch` calls); a backend that settles many at once cheaper overrides
    /// it (Kafka: one lock for the batch's offsets).
    async fn ack_batch(&self, deliveries: &[Delivery]) -> Vec<(usize, BrokerError)> {
        let acks = futures::future::join_all(deliveries.iter().map(|d| self.ack(d))).await;
        acks.into_iter()
            .enumerate()
            .filter_map(|(i, r)| r.err().map(|e| (i, e)))
            .collect()
    }

    /// [`Receiver::ack_batch`] for a backend whose acknowledgement is a local step that
    /// never waits (the embedded broker; Kafka's offset store): `Some(failures)` when it
    /// acknowledged `deliveries`, `None` (the default) to go through `ack_batch`.
    fn try_ack_batch(&self, deliveries: &[Delivery]) -> Option<Vec<(usize, BrokerError)>> {
        let _ = deliveries;
        None
    }

    /// Hold a copy for `retry.delay`, confirmed, *then* settle the source.
    async fn retry(&self, delivery: &Delivery, retry: RetryRequest) -> Result<(), BrokerError>;

    /// Put `dead` (the message with the dead-letter record in its headers) on this
    /// consumer's DLQ, confirmed, *then* settle the source.
    async fn dead_letter(&self, delivery: &Delivery, dead: Message) -> Result<(), BrokerError>;

    /// Give the delivery back unsettled, to be delivered again after about `delay`
    /// (immediately where the broker cannot delay a release).
    async fn release(&self, delivery: &Delivery, delay: Duration) -> Result<(), BrokerError>;

    /// Stop receiving; unsettled deliveries go back to the broker.
    async fn close(&self) -> Result<(), BrokerError> {
        Ok(())
    }
}
