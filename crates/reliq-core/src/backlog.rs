use std::time::Duration;

/// One consumer's backlog at the broker. Numbers the broker reports as approximate (SQS,
/// RabbitMQ's management counters) are what the broker said, not corrected.
///
/// What waits in the broker for one consumer, as the broker itself tells it: the gauges an
/// operator reads before anything else (is the consumer keeping up, how many retries are
/// waiting, on which tier). Read by [`Broker::backlog`](crate::broker::Broker::backlog); the DLQ's
/// depth and oldest age are [`DeadLetters::count`](crate::dead_letters::DeadLetters::count).
///
/// Every number comes from the broker, never from reliq's own counters: a gauge that a
/// crashed process cannot update would show a healthy zero exactly when it matters.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Backlog {
    /// Messages of the source this consumer has not finished with, as the broker counts
    /// them:
    /// - Kafka: the group's lag, end offset − committed offset summed over the source's
    ///   partitions (a partition with no commit counts from its low watermark). Records
    ///   received and not yet committed are part of it: Kafka has no separate count.
    /// - RabbitMQ: the consumer queue's ready messages.
    /// - NATS: the consumer's pending messages (`num_pending`, due retries included).
    /// - SQS: `ApproximateNumberOfMessages` (visible) plus `ApproximateNumberOfMessagesDelayed`.
    /// - memory: the queue's ready messages.
    pub waiting: u64,
    /// Delivered to a receiver and not settled yet, where the broker keeps such a count
    /// apart from [`Backlog::waiting`]: RabbitMQ's unacknowledged (management API, so
    /// `None` without a `management_url`), NATS `num_ack_pending`, SQS
    /// `ApproximateNumberOfMessagesNotVisible` (retries waiting their visibility timeout
    /// are in it too), memory. `None` on Kafka.
    pub in_flight: Option<u64>,
    /// Retries waiting for their delay, all tiers together, where the broker keeps them
    /// apart from the source: Kafka and RabbitMQ (their retry tiers), NATS (the scheduled
    /// retries), memory. `None` on SQS, whose retries wait invisible in the source queue
    /// (counted in [`Backlog::in_flight`]).
    pub retries: Option<u64>,
    /// The retries waiting on each tier, in [`Subscription::retry_tiers`] order, where each
    /// tier is a route of its own (Kafka retry topics: the relay group's lag; RabbitMQ TTL
    /// queues: their message count). Empty where retries wait in place.
    ///
    /// [`Subscription::retry_tiers`]: crate::subscription::Subscription::retry_tiers
    pub retry_tiers: Vec<TierBacklog>,
}

impl Backlog {
    /// A backlog of `waiting` messages, the rest unknown.
    pub fn waiting(waiting: u64) -> Self {
        Self {
            waiting,
            ..Self::default()
        }
    }

    /// With `in_flight` delivered and not settled.
    pub fn with_in_flight(mut self, in_flight: Option<u64>) -> Self {
        self.in_flight = in_flight;
        self
    }

    /// With `retries` waiting in place (not on tiers of their own).
    pub fn with_retries(mut self, retries: u64) -> Self {
        self.retries = Some(retries);
        self
    }

    /// With one entry per tier; [`Backlog::retries`] becomes their sum.
    pub fn with_tiers(mut self, tiers: Vec<TierBacklog>) -> Self {
        self.retries = Some(tiers.iter().map(|t| t.waiting).sum());
        self.retry_tiers = tiers;
        self
    }
}

/// The retries waiting on one retry tier.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TierBacklog {
    /// The tier's delay.
    pub delay: Duration,
    /// Retries waiting on it.
    pub waiting: u64,
}
