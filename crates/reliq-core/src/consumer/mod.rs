//! The consumer runtime, written once for every backend:
//! receive (bounded) → handle (timeout, panic capture) → classify → ack / retry /
//! dead-letter.
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
mod dispatch;
mod handle;
mod rate;
mod settle;
mod signal;
mod stats;

pub use builder::{Consumer, ConsumerBuilder};
pub use handle::{ConsumerHandle, ShutdownReport};
pub use stats::{Stats, StatsSnapshot};

use self::dispatch::Held;
use self::settle::SettleBackoff;
use self::signal::Signal;
use crate::broker::{BrokerError, Receiver};
use crate::classify::Classifier;
use crate::headers::DeadLetterReason;
use crate::inbox::Inbox;
use crate::retry::{PolicyError, RetryPolicy};
use crate::telemetry::{Clock, ConsumerMetrics};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Semaphore;
use tokio_util::task::TaskTracker;

/// How deliveries of one consumer are ordered relative to each other.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum DeliveryOrder {
    /// Any delivery may run beside any other (up to `concurrency`).
    #[default]
    Unordered,
    /// Deliveries with the same key run one at a time, in arrival order; different keys
    /// (and keyless messages) run in parallel.
    PerKey,
}

/// Errors of the consumer builder and runtime.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConsumerError {
    /// A setting is invalid; names it.
    #[error("invalid consumer setting `{field}`: {reason}")]
    Config {
        /// The setting.
        field: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// The retry policy is invalid.
    #[error(transparent)]
    Policy(#[from] PolicyError),
    /// The broker refused the subscription.
    #[error("subscribing failed: {0}")]
    Subscribe(#[source] BrokerError),
    /// The start-up topology check ([`StartupCheck::Refuse`](crate::StartupCheck::Refuse))
    /// found a difference that breaks delivery guarantees; the report names each.
    #[error("the broker's topology breaks this consumer's guarantees: {0}")]
    Topology(Box<crate::TopologyReport>),
    /// The start-up topology check ([`StartupCheck::Refuse`](crate::StartupCheck::Refuse))
    /// could not read the broker.
    #[error("checking the topology failed: {0}")]
    TopologyCheck(#[source] BrokerError),
}

struct Shared<F> {
    name: Arc<str>,
    receiver: Arc<dyn Receiver>,
    handler: F,
    policy: RetryPolicy,
    classifier: Classifier,
    inbox: Option<Arc<dyn Inbox>>,
    handler_timeout: Option<Duration>,
    clock: Clock,
    /// Most handlers running at once; `None` when that is no stricter than the in-flight
    /// bound (a handler holds at least one in-flight delivery), which saves a semaphore
    /// per message.
    concurrency: Option<Semaphore>,
    stats: Arc<Stats>,
    metrics: ConsumerMetrics,
    /// The spans' names and constant attributes.
    spans: crate::telemetry::SpanNames,
    /// The rate limit on deliveries taken, if any.
    rate: Option<rate::HandlerRate>,
    /// The circuit breaker on handler outcomes, if any.
    breaker: Option<crate::CircuitBreaker>,
    keyed: Mutex<HashMap<String, VecDeque<Held>>>,
    /// Most deliveries one task handles together ([`dispatch_each`]): about two groups
    /// per runtime worker when `max_in_flight` deliveries are held.
    group_size: usize,
    /// The tasks that run those groups, kept between groups.
    runners: dispatch::GroupRunners,
    ordering: DeliveryOrder,
    backoff: SettleBackoff,
    tracker: TaskTracker,
    hard_stop: Signal,
    crash: Signal,
}

/// The dead-letter reason reliq uses for a broker's own delivery-limit move, exposed for
/// backends that translate native metadata (e.g. `x-death reason=delivery_limit`).
pub const BROKER_LIMIT_REASON: DeadLetterReason = DeadLetterReason::MaxDeliveries;
