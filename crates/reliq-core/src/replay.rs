//! The replay engine: move dead letters back to their consumer — an operator action,
//! never automatic.
//!
//! Dry-run first ([`Replay::dry_run`] lists what would move), then [`Replay::execute`].
//! Each replayed copy keeps its message id, loses the failure headers (so it gets a fresh
//! retry budget), and carries `reliq-replay-count` / `reliq-replayed-at`. The DLQ is
//! browsed without consuming it ([`crate::DeadLetters`]); an entry is removed only after
//! its replayed copy was confirmed; entries that do not match the filter are never
//! touched. Every replayed id is logged on the `reliq::audit`
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
use std::time::SystemTime;

use governor::{Quota, RateLimiter};

use crate::broker::{Broker, BrokerError, Destination, Subscription};
use crate::classify::ErrorClass;
use crate::dead_letters::{Cursor, DeadLetters};
use crate::headers::{self, DeadLetter, DeadLetterReason};
use crate::message::{Message, MessageId};
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
    target: ReplayTarget,
    scan_max: u32,
}

impl std::fmt::Debug for Replay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replay")
            .field("broker", &self.broker.kind())
            .field("subscription", &self.subscription)
            .field("per_second", &self.per_second)
            .field("scan_max", &self.scan_max)
            .finish_non_exhaustive()
    }
}

impl Replay {
    /// Replay dead letters of `subscription`'s consumer.
    pub fn new(broker: Arc<dyn Broker>, subscription: Subscription) -> Self {
        Self {
            broker,
            subscription,
            filter: ReplayFilter::default(),
            per_second: None,
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

    /// Where replayed messages go.
    pub fn target(mut self, target: ReplayTarget) -> Self {
        self.target = target;
        self
    }

    /// Most dead letters one run reads (default 10,000). The DLQ is browsed a page at a
    /// time, so a run holds one page in memory whatever this is.
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
        let sub = &self.subscription;
        let dlq = self.broker.dead_letters(sub).await?;
        let limiter = self
            .per_second
            .map(|n| RateLimiter::direct(Quota::per_second(n)));
        let clock = Clock::new();
        let replayed_total =
            metrics::counter!(telemetry::REPLAYED, "consumer" => sub.consumer.clone());
        let mut report = ReplayReport::default();
        let limit = self.filter.limit.unwrap_or(usize::MAX);
        let scan_max = self.scan_max as usize;
        let mut cursor = Cursor::start();
        'pages: while report.scanned < scan_max && report.matched.len() < limit {
            let page = dlq
                .browse(&cursor, PAGE.min(scan_max - report.scanned))
                .await?;
            // Replayed copies confirmed on this page; their DLQ entries are removed after
            // the page (a crash in between leaves a replayed entry in the DLQ: a later
            // replay sends it again, and the consumer's inbox absorbs it).
            let mut confirmed = Vec::new();
            for entry in &page.entries {
                if report.matched.len() >= limit {
                    break;
                }
                report.scanned += 1;
                let record = match entry.record() {
                    Ok(r) => r,
                    Err(e) => {
                        tracing::warn!(message_id = %entry.id(), error = %e, "dead letter without a readable record; left in place");
                        report.unreadable += 1;
                        continue;
                    }
                };
                if !self.filter.matches(entry.id(), &record) {
                    continue;
                }
                report.matched.push(ReplayEntry {
                    id: entry.id().clone(),
                    record: record.clone(),
                });
                if dry_run {
                    continue;
                }
                if let Some(l) = &limiter {
                    l.until_ready().await;
                }
                match self.republish(sub, &entry.message, &record, &clock).await {
                    Ok(()) => confirmed.push(entry.id().clone()),
                    Err(e) => {
                        tracing::warn!(target: "reliq::audit", message_id = %entry.id(), error = %crate::ErrorChain(&e), "replay publish failed; left in the DLQ");
                        report
                            .failed
                            .push((entry.id().clone(), crate::ErrorChain(&e).to_string()));
                    }
                }
            }
            self.remove_replayed(dlq.as_ref(), confirmed, &mut report, &replayed_total)
                .await;
            if page.at_end || page.entries.is_empty() {
                break 'pages;
            }
            cursor = page.next;
        }
        tracing::info!(target: "reliq::audit", consumer = %sub.consumer, dry_run, scanned = report.scanned,
            matched = report.matched.len(), replayed = report.replayed.len(), failed = report.failed.len(), "replay finished");
        Ok(report)
    }

    /// Remove the DLQ entries whose replayed copies were confirmed, and report them.
    async fn remove_replayed(
        &self,
        dlq: &dyn DeadLetters,
        confirmed: Vec<MessageId>,
        report: &mut ReplayReport,
        replayed_total: &metrics::Counter,
    ) {
        if confirmed.is_empty() {
            return;
        }
        let consumer = &self.subscription.consumer;
        let error = match dlq.remove(&confirmed).await {
            Ok(removed) if removed.len() == confirmed.len() => None,
            Ok(removed) => {
                // Gone already (another replay or a purge removed them): still replayed.
                tracing::warn!(target: "reliq::audit", consumer = %consumer,
                    missing = confirmed.len() - removed.len(), "replayed dead letters were no longer in the DLQ");
                None
            }
            Err(e) => Some(e),
        };
        for id in confirmed {
            replayed_total.increment(1);
            match &error {
                None => {
                    tracing::info!(target: "reliq::audit", consumer = %consumer, message_id = %id, "dead letter replayed")
                }
                Some(e) => {
                    // Replayed but still in the DLQ: a later replay would duplicate it
                    // (the inbox absorbs that). Report it.
                    tracing::warn!(target: "reliq::audit", message_id = %id, error = %crate::ErrorChain(e),
                        "replayed, but removing the DLQ copy failed");
                    report
                        .failed
                        .push((id.clone(), format!("dlq remove: {}", crate::ErrorChain(e))));
                }
            }
            report.replayed.push(id);
        }
    }

    async fn republish(
        &self,
        sub: &Subscription,
        message: &Message,
        record: &DeadLetter,
        clock: &Clock,
    ) -> Result<(), BrokerError> {
        let mut copy = message.clone();
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

/// Entries read per browse.
const PAGE: usize = 256;
