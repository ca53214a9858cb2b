//! The replay engine: move dead letters back to their consumer — an operator action,
//! never automatic.
//!
//! Dry-run first ([`Replay::dry_run`] lists what would move), then [`Replay::execute`].
//! Each replayed copy keeps its message id, loses the failure headers (so it gets a fresh
//! retry budget), and carries `reliq-replay-count` / `reliq-replayed-at`. The DLQ copy is
//! acknowledged only after the replayed copy was confirmed; messages that do not match
//! the filter are left in the DLQ. Every replayed id is logged on the `reliq::audit`
//! tracing target.
//!
//! ```no_run
//! # async fn demo(broker: std::sync::Arc<dyn reliq_core::Broker>) -> Result<(), reliq_core::BrokerError> {
//! use reliq_core::{Replay, ReplayFilter, Subscription, DeadLetterReason};
//! let sub = Subscription::new("inventory", "orders");
//! let filter = ReplayFilter::default().reasons([DeadLetterReason::Exhausted]).limit(100);
//! let plan = Replay::new(broker.clone(), sub.clone()).filter(filter.clone()).dry_run().await?;
//! println!("{} messages would be replayed", plan.matched.len());
//! let done = Replay::new(broker, sub).filter(filter).rate_limit(50).execute().await?;
//! assert_eq!(done.replayed.len(), plan.matched.len());
//! # Ok(()) }
//! ```

use std::collections::HashSet;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use governor::{Quota, RateLimiter};

use crate::broker::{Broker, BrokerError, Delivery, Destination, Subscription};
use crate::classify::ErrorClass;
use crate::headers::{self, DeadLetter, DeadLetterReason};
use crate::message::MessageId;
use crate::telemetry::{self, Clock};

/// Which dead letters to replay. Empty filter = all.
#[derive(Clone, Debug, Default)]
pub struct ReplayFilter {
    ids: Option<HashSet<MessageId>>,
    since: Option<SystemTime>,
    until: Option<SystemTime>,
    reasons: Option<Vec<DeadLetterReason>>,
    classes: Option<Vec<ErrorClass>>,
    limit: Option<usize>,
}

impl ReplayFilter {
    /// Only these message ids.
    pub fn ids(mut self, ids: impl IntoIterator<Item = MessageId>) -> Self {
        self.ids = Some(ids.into_iter().collect());
        self
    }
    /// Dead-lettered at or after `t`.
    pub fn since(mut self, t: SystemTime) -> Self {
        self.since = Some(t);
        self
    }
    /// Dead-lettered before `t`.
    pub fn until(mut self, t: SystemTime) -> Self {
        self.until = Some(t);
        self
    }
    /// Only these dead-letter reasons.
    pub fn reasons(mut self, r: impl IntoIterator<Item = DeadLetterReason>) -> Self {
        self.reasons = Some(r.into_iter().collect());
        self
    }
    /// Only these error classes.
    pub fn classes(mut self, c: impl IntoIterator<Item = ErrorClass>) -> Self {
        self.classes = Some(c.into_iter().collect());
        self
    }
    /// At most `n` messages.
    pub fn limit(mut self, n: usize) -> Self {
        self.limit = Some(n);
        self
    }

    fn matches(&self, id: &MessageId, r: &DeadLetter) -> bool {
        self.ids.as_ref().is_none_or(|ids| ids.contains(id))
            && self.since.is_none_or(|t| r.dead_lettered_at >= t)
            && self.until.is_none_or(|t| r.dead_lettered_at < t)
            && self
                .reasons
                .as_ref()
                .is_none_or(|rs| rs.contains(&r.reason))
            && self
                .classes
                .as_ref()
                .is_none_or(|cs| r.error_class.is_some_and(|c| cs.contains(&c)))
    }
}

/// Where replayed messages go.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum ReplayTarget {
    /// Only the consumer that dead-lettered them (default; falls back to the original
    /// destination on backends without per-consumer delivery).
    #[default]
    Consumer,
    /// The original destination (every consumer of it sees the message again).
    OriginalDestination,
}

/// One dead letter the engine looked at.
#[derive(Clone, Debug, PartialEq)]
pub struct ReplayEntry {
    /// The message id.
    pub id: MessageId,
    /// Its dead-letter record.
    pub record: DeadLetter,
}

/// What a replay run did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ReplayReport {
    /// Dead letters read.
    pub scanned: usize,
    /// Matched the filter (in a dry run: would be replayed).
    pub matched: Vec<ReplayEntry>,
    /// Replayed and removed from the DLQ.
    pub replayed: Vec<MessageId>,
    /// Matched but could not be replayed (left in the DLQ), with the error.
    pub failed: Vec<(MessageId, String)>,
    /// Carried no readable dead-letter record (left in the DLQ).
    pub unreadable: usize,
}

/// A replay of one consumer's dead letters.
pub struct Replay {
    broker: Arc<dyn Broker>,
    subscription: Subscription,
    filter: ReplayFilter,
    per_second: Option<NonZeroU32>,
    idle: Duration,
    target: ReplayTarget,
    scan_max: u32,
}

impl Replay {
    /// Replay dead letters of `subscription`'s consumer.
    pub fn new(broker: Arc<dyn Broker>, subscription: Subscription) -> Self {
        Self {
            broker,
            subscription,
            filter: ReplayFilter::default(),
            per_second: None,
            idle: Duration::from_secs(2),
            target: ReplayTarget::Consumer,
            scan_max: 10_000,
        }
    }

    /// Which messages.
    pub fn filter(mut self, filter: ReplayFilter) -> Self {
        self.filter = filter;
        self
    }

    /// At most `per_second` messages per second (0 = unlimited).
    pub fn rate_limit(mut self, per_second: u32) -> Self {
        self.per_second = NonZeroU32::new(per_second);
        self
    }

    /// The scan ends when the DLQ yields nothing for this long (default 2 s).
    pub fn idle_timeout(mut self, idle: Duration) -> Self {
        self.idle = idle;
        self
    }

    /// Where replayed messages go.
    pub fn target(mut self, target: ReplayTarget) -> Self {
        self.target = target;
        self
    }

    /// Most dead letters one run reads (default 10,000); unmatched ones are held until
    /// the scan ends, so this bounds the memory a run uses.
    pub fn scan_max(mut self, n: u32) -> Self {
        self.scan_max = n.max(1);
        self
    }

    /// List what would be replayed; moves nothing.
    pub async fn dry_run(self) -> Result<ReplayReport, BrokerError> {
        self.run(true).await
    }

    /// Replay.
    pub async fn execute(self) -> Result<ReplayReport, BrokerError> {
        self.run(false).await
    }

    async fn run(self, dry_run: bool) -> Result<ReplayReport, BrokerError> {
        let mut sub = self.subscription.clone();
        sub.prefetch = self.scan_max;
        let dlq = self.broker.dead_letters(&sub).await?;
        let limiter = self
            .per_second
            .map(|n| RateLimiter::direct(Quota::per_second(n)));
        let clock = Clock::new();
        let replayed_total =
            metrics::counter!(telemetry::REPLAYED, "consumer" => sub.consumer.clone());
        let mut report = ReplayReport::default();
        let mut held: Vec<Delivery> = Vec::new();
        let limit = self.filter.limit.unwrap_or(usize::MAX);
        while report.scanned < self.scan_max as usize && report.matched.len() < limit {
            let d = match tokio::time::timeout(self.idle, dlq.receive()).await {
                Err(_) | Ok(Err(BrokerError::Closed)) => break,
                Ok(Err(e)) => {
                    release_all(dlq.as_ref(), held).await;
                    return Err(e);
                }
                Ok(Ok(d)) => d,
            };
            report.scanned += 1;
            let record = match DeadLetter::read(d.headers()) {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!(message_id = %d.id(), error = %e, "dead letter without a readable record; left in place");
                    report.unreadable += 1;
                    held.push(d);
                    continue;
                }
            };
            if !self.filter.matches(d.id(), &record) {
                held.push(d);
                continue;
            }
            report.matched.push(ReplayEntry {
                id: d.id().clone(),
                record: record.clone(),
            });
            if dry_run {
                held.push(d);
                continue;
            }
            if let Some(l) = &limiter {
                l.until_ready().await;
            }
            match self.republish(&sub, &d, &record, &clock).await {
                Ok(()) => match dlq.ack(&d).await {
                    Ok(()) => {
                        tracing::info!(target: "reliq::audit", consumer = %sub.consumer, message_id = %d.id(),
                            reason = %record.reason, "dead letter replayed");
                        replayed_total.increment(1);
                        report.replayed.push(d.id().clone());
                    }
                    Err(e) => {
                        // Replayed but still in the DLQ: a later replay would duplicate it
                        // (the inbox absorbs that). Report it.
                        tracing::warn!(target: "reliq::audit", message_id = %d.id(), error = %e,
                            "replayed, but removing the DLQ copy failed");
                        report.replayed.push(d.id().clone());
                        report
                            .failed
                            .push((d.id().clone(), format!("dlq ack: {e}")));
                    }
                },
                Err(e) => {
                    tracing::warn!(target: "reliq::audit", message_id = %d.id(), error = %e, "replay publish failed; left in the DLQ");
                    report.failed.push((d.id().clone(), e.to_string()));
                    held.push(d);
                }
            }
        }
        release_all(dlq.as_ref(), held).await;
        dlq.close().await?;
        tracing::info!(target: "reliq::audit", consumer = %sub.consumer, dry_run, scanned = report.scanned,
            matched = report.matched.len(), replayed = report.replayed.len(), failed = report.failed.len(), "replay finished");
        Ok(report)
    }

    async fn republish(
        &self,
        sub: &Subscription,
        d: &Delivery,
        record: &DeadLetter,
        clock: &Clock,
    ) -> Result<(), BrokerError> {
        let mut copy = d.message().clone();
        let h = copy.headers_mut();
        let count: u32 = h
            .get(headers::REPLAY_COUNT)
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        h.retain(|name| !headers::FAILURE_HEADERS.contains(&name));
        h.insert(headers::REPLAY_COUNT, (count + 1).to_string());
        h.insert(headers::REPLAYED_AT, headers::format_time(clock.now()));
        let original = Destination {
            topic: record.origin.destination.to_string(),
            route: record.origin.route.clone(),
        };
        match self.target {
            ReplayTarget::OriginalDestination => self.broker.publish(&original, copy).await,
            ReplayTarget::Consumer => match self.broker.send_to_consumer(sub, copy.clone()).await {
                Err(BrokerError::Unsupported { .. }) => self.broker.publish(&original, copy).await,
                other => other,
            },
        }
    }
}

async fn release_all(dlq: &dyn crate::broker::Receiver, held: Vec<Delivery>) {
    for d in held {
        if let Err(e) = dlq.release(&d, Duration::ZERO).await {
            tracing::warn!(message_id = %d.id(), error = %e, "releasing a dead letter failed; the broker returns it after its lease");
        }
    }
}
