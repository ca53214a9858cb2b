//! The dead-letter engine: replay dead letters to their consumer, replay a corrected copy
//! of one, or purge them — operator actions, never automatic.
//!
//! Dry-run first ([`Replay::dry_run`] lists what would move), then [`Replay::execute`].
//! Each replayed copy keeps its message id, loses the failure headers (so it gets a fresh
//! retry budget), and carries `reliq-replay-count` / `reliq-replayed-at`. The DLQ is
//! browsed without consuming it ([`crate::DeadLetters`]); an entry is removed only after
//! its replayed copy was confirmed; entries that do not match the filter are never
//! touched. A run killed midway loses nothing: what was confirmed but not yet removed is
//! sent again by the next run, with its id, and the consumer's inbox absorbs it. Every
//! replayed id is logged on the `reliq::audit` tracing target.
//!
//! Copies are published [`Replay::in_flight`] at a time — one after another within a
//! message key (so one key's dead letters go back in DLQ order), concurrently across keys —
//! and paced by [`Replay::rate_limit`].
//!
//! ```no_run
//! # async fn demo(broker: std::sync::Arc<dyn reliq_core::Broker>) -> Result<(), reliq_core::BrokerError> {
//! use reliq_core::{Replay, DeadLetterFilter, Subscription, DeadLetterReason};
//! let sub = Subscription::new("inventory", "orders");
//! let filter = DeadLetterFilter::default().reasons([DeadLetterReason::Exhausted]).limit(100);
//! let plan = Replay::new(broker.clone(), sub.clone()).filter(filter.clone()).dry_run().await?;
//! println!("{} messages would be replayed", plan.matched.len());
//! let done = Replay::new(broker, sub).filter(filter).rate_limit(50).execute().await?;
//! assert_eq!(done.replayed.len(), plan.matched.len());
//! # Ok(()) }
//! ```

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::Arc;

use bytes::Bytes;
use futures::StreamExt;
use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use tokio_util::sync::CancellationToken;

use crate::broker::{Broker, BrokerError, Destination, Subscription};
use crate::dead_letters::{Cursor, DeadLetterEntry, DeadLetters};
use crate::filter::DeadLetterFilter;
use crate::headers::{self, DeadLetter};
use crate::message::{Message, MessageId};
use crate::telemetry::{self, Clock};

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

/// One dead letter an operation selected.
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
    /// Replayed (confirmed by the broker) and removed from the DLQ.
    pub replayed: Vec<MessageId>,
    /// Matched but not replayed (left in the DLQ), or replayed but not removed, with why.
    pub failed: Vec<(MessageId, String)>,
    /// Carried no readable dead-letter record (left in the DLQ).
    pub unreadable: usize,
    /// The run was cancelled before it reached the end; what it did is above.
    pub cancelled: bool,
}

/// What a purge run did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PurgeReport {
    /// Dead letters read.
    pub scanned: usize,
    /// Matched the filter (in a dry run: would be removed).
    pub matched: Vec<ReplayEntry>,
    /// Removed from the DLQ, confirmed by the broker.
    pub removed: Vec<MessageId>,
    /// Carried no readable dead-letter record (never purged by a filter).
    pub unreadable: usize,
    /// The run was cancelled before it reached the end; what it did is above.
    pub cancelled: bool,
}

/// How far a replay or purge run is, handed to [`Replay::on_progress`] after every page.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Progress {
    /// Dead letters read so far.
    pub scanned: usize,
    /// Of those, matched the filter.
    pub matched: usize,
    /// Replayed, or removed by a purge.
    pub done: usize,
    /// Failed (left in the DLQ).
    pub failed: usize,
}

type ProgressFn = Arc<dyn Fn(&Progress) + Send + Sync>;

/// A correction for [`Replay::correct`]: the payload to send instead, and headers to set.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Correction {
    /// The corrected payload; `None` keeps the dead letter's.
    pub payload: Option<Bytes>,
    /// Headers to set on the copy (replacing a header of the same name).
    pub headers: Vec<(String, String)>,
}

/// What [`Replay::correct`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Corrected {
    /// The dead letter's id (the copy's causation id).
    pub original: MessageId,
    /// The corrected copy's id: derived from the original id and the correction, so the
    /// same correction sent twice (a retry after a failed remove) has the same id, and the
    /// consumer's inbox takes it once.
    pub copy: MessageId,
}

/// A replay (or a purge) of one consumer's dead letters.
pub struct Replay {
    broker: Arc<dyn Broker>,
    subscription: Subscription,
    filter: DeadLetterFilter,
    per_second: Option<NonZeroU32>,
    target: ReplayTarget,
    scan_max: usize,
    in_flight: usize,
    progress: Option<ProgressFn>,
    cancel: CancellationToken,
}

impl std::fmt::Debug for Replay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replay")
            .field("broker", &self.broker.kind())
            .field("subscription", &self.subscription)
            .field("filter", &self.filter)
            .field("per_second", &self.per_second)
            .field("target", &self.target)
            .field("scan_max", &self.scan_max)
            .field("in_flight", &self.in_flight)
            .finish_non_exhaustive()
    }
}

impl Replay {
    /// Act on dead letters of `subscription`'s consumer.
    pub fn new(broker: Arc<dyn Broker>, subscription: Subscription) -> Self {
        Self {
            broker,
            subscription,
            filter: DeadLetterFilter::default(),
            per_second: None,
            target: ReplayTarget::Consumer,
            scan_max: usize::MAX,
            in_flight: 64,
            progress: None,
            cancel: CancellationToken::new(),
        }
    }

    /// Which messages.
    pub fn filter(mut self, filter: DeadLetterFilter) -> Self {
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

    /// Most dead letters one run reads (default: all). The DLQ is browsed a page at a
    /// time, so a run holds one page in memory whatever this is.
    pub fn scan_max(mut self, n: usize) -> Self {
        self.scan_max = n.max(1);
        self
    }

    /// Copies awaiting their broker confirm at once (default 64; at least 1). With 1, the
    /// whole DLQ goes back in DLQ order; otherwise each key's dead letters do.
    pub fn in_flight(mut self, n: usize) -> Self {
        self.in_flight = n.max(1);
        self
    }

    /// Called with the run's progress after every page (and once at the end).
    pub fn on_progress(mut self, f: impl Fn(&Progress) + Send + Sync + 'static) -> Self {
        self.progress = Some(Arc::new(f));
        self
    }

    /// Stop early when `token` is cancelled: no copy is sent after that, the copies
    /// already confirmed are still removed from the DLQ, and the report says `cancelled`.
    pub fn cancel_on(mut self, token: CancellationToken) -> Self {
        self.cancel = token;
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

    /// Remove the matching dead letters for good (`dry_run`: list them, remove nothing).
    /// Only entries with a readable dead-letter record are ever purged by a filter.
    pub async fn purge(self, dry_run: bool) -> Result<PurgeReport, BrokerError> {
        let sub = &self.subscription;
        let dlq = self.broker.dead_letters(sub).await?;
        let mut scan = Scan::new(&self.filter, self.scan_max);
        let mut report = PurgeReport::default();
        while let Some(page) = scan.next_page(dlq.as_ref()).await? {
            if self.cancel.is_cancelled() {
                report.cancelled = true;
                break;
            }
            let ids: Vec<MessageId> = page.iter().map(|(e, _)| e.id().clone()).collect();
            report
                .matched
                .extend(page.into_iter().map(|(e, record)| ReplayEntry {
                    id: e.message.id().clone(),
                    record,
                }));
            if !dry_run && !ids.is_empty() {
                let removed = dlq.remove(&ids).await?;
                for id in &removed {
                    tracing::info!(target: "reliq::audit", consumer = %sub.consumer, message_id = %id, "dead letter purged");
                }
                report.removed.extend(removed);
            }
            self.report_progress(&scan, report.removed.len(), 0);
        }
        report.scanned = scan.scanned;
        report.unreadable = scan.unreadable;
        self.report_progress(&scan, report.removed.len(), 0);
        tracing::info!(target: "reliq::audit", consumer = %sub.consumer, dry_run, scanned = report.scanned,
            matched = report.matched.len(), removed = report.removed.len(), cancelled = report.cancelled, "purge finished");
        Ok(report)
    }

    /// Replay a corrected copy of the dead letter `id`: a new message (its id derived
    /// from `id` and the correction) whose causation id is `id`, with the correction's
    /// payload and headers, the failure headers stripped and the replay marker set. The
    /// dead letter is removed only after the copy is confirmed. `None` when the DLQ holds
    /// no entry `id`.
    pub async fn correct(
        self,
        id: &MessageId,
        correction: Correction,
    ) -> Result<Option<Corrected>, BrokerError> {
        let sub = &self.subscription;
        let dlq = self.broker.dead_letters(sub).await?;
        let Some(entry) = dlq.get(id).await? else {
            return Ok(None);
        };
        let record = entry
            .record()
            .map_err(|e| BrokerError::Other(Box::new(e)))?;
        let copy_id = corrected_id(id, &correction);
        let (_, key, payload, original_headers) = entry.message.into_parts();
        let mut copy = Message::from_parts(
            copy_id.clone(),
            key,
            correction.payload.clone().unwrap_or(payload),
            original_headers,
        );
        for (name, value) in &correction.headers {
            copy.headers_mut().insert(name.clone(), value.clone());
        }
        copy.headers_mut()
            .insert(headers::CAUSATION_ID, id.as_str().to_owned());
        self.republish(sub, copy, &record, &Clock::new()).await?;
        let removed = dlq.remove(std::slice::from_ref(id)).await?;
        tracing::info!(target: "reliq::audit", consumer = %sub.consumer, message_id = %id, copy_id = %copy_id,
            original_removed = !removed.is_empty(), "corrected copy of a dead letter replayed");
        Ok(Some(Corrected {
            original: id.clone(),
            copy: copy_id,
        }))
    }

    fn report_progress(&self, scan: &Scan<'_>, done: usize, failed: usize) {
        if let Some(f) = &self.progress {
            f(&Progress {
                scanned: scan.scanned,
                matched: scan.matched,
                done,
                failed,
            });
        }
    }

    async fn run(self, dry_run: bool) -> Result<ReplayReport, BrokerError> {
        let sub = &self.subscription;
        let dlq = self.broker.dead_letters(sub).await?;
        // A burst of 1/100 of the rate (10 ms of it): paced evenly, yet reachable when
        // the timer wakes the publishing lanes a millisecond late.
        let limiter = self.per_second.map(|n| {
            let burst = NonZeroU32::new(n.get() / 100).unwrap_or(NonZeroU32::MIN);
            RateLimiter::direct(Quota::per_second(n).allow_burst(burst))
        });
        let clock = Clock::new();
        let replayed_total =
            metrics::counter!(telemetry::REPLAYED, "consumer" => sub.consumer.clone());
        let mut report = ReplayReport::default();
        let mut scan = Scan::new(&self.filter, self.scan_max);
        while let Some(page) = scan.next_page(dlq.as_ref()).await? {
            report
                .matched
                .extend(page.iter().map(|(e, record)| ReplayEntry {
                    id: e.id().clone(),
                    record: record.clone(),
                }));
            if !dry_run {
                // Confirmed copies' DLQ entries are removed after the page: a crash in
                // between leaves a replayed entry in the DLQ, which a later replay sends
                // again (same id: the consumer's inbox absorbs it).
                let (confirmed, cancelled) = self
                    .republish_page(sub, page, limiter.as_ref(), &clock, &mut report)
                    .await;
                self.remove_replayed(dlq.as_ref(), confirmed, &mut report, &replayed_total)
                    .await;
                if cancelled {
                    report.cancelled = true;
                }
            }
            self.report_progress(&scan, report.replayed.len(), report.failed.len());
            if report.cancelled {
                break;
            }
            if self.cancel.is_cancelled() {
                report.cancelled = true;
                break;
            }
        }
        report.scanned = scan.scanned;
        report.unreadable = scan.unreadable;
        self.report_progress(&scan, report.replayed.len(), report.failed.len());
        tracing::info!(target: "reliq::audit", consumer = %sub.consumer, dry_run, scanned = report.scanned,
            matched = report.matched.len(), replayed = report.replayed.len(), failed = report.failed.len(),
            cancelled = report.cancelled, "replay finished");
        Ok(report)
    }

    /// Publish one page's copies, `in_flight` at a time, one key's in order; the ids
    /// confirmed, and whether the run was cancelled midway.
    async fn republish_page(
        &self,
        sub: &Subscription,
        page: Vec<(DeadLetterEntry, DeadLetter)>,
        limiter: Option<&DefaultDirectRateLimiter>,
        clock: &Clock,
        report: &mut ReplayReport,
    ) -> (Vec<MessageId>, bool) {
        // One lane per key, in order of first appearance; keyless messages each alone.
        let mut lanes: Vec<Vec<(DeadLetterEntry, DeadLetter)>> = Vec::new();
        let mut lane_of_key: HashMap<String, usize> = HashMap::new();
        for item in page {
            match item.0.message.key().map(str::to_owned) {
                Some(key) => match lane_of_key.get(&key) {
                    Some(&lane) => lanes[lane].push(item),
                    None => {
                        lane_of_key.insert(key, lanes.len());
                        lanes.push(vec![item]);
                    }
                },
                None => lanes.push(vec![item]),
            }
        }
        let outcomes: Vec<Vec<LaneOutcome>> = futures::stream::iter(lanes)
            .map(|lane| async move {
                let mut out = Vec::with_capacity(lane.len());
                let mut failed = false;
                for (entry, record) in lane {
                    let id = entry.id().clone();
                    // After a failure or a cancel, the rest of the lane stays in the
                    // DLQ: a later message of a key must not overtake an earlier one.
                    if failed || self.cancel.is_cancelled() {
                        out.push((id, None));
                        continue;
                    }
                    if let Some(l) = limiter {
                        l.until_ready().await;
                    }
                    let result = self.republish(sub, entry.message, &record, clock).await;
                    failed = result.is_err();
                    out.push((id, Some(result)));
                }
                out
            })
            .buffer_unordered(self.in_flight)
            .collect()
            .await;
        let mut confirmed = Vec::new();
        let mut cancelled = false;
        for (id, outcome) in outcomes.into_iter().flatten() {
            match outcome {
                Some(Ok(())) => confirmed.push(id),
                Some(Err(e)) => {
                    let why = crate::ErrorChain(&e).to_string();
                    tracing::warn!(target: "reliq::audit", message_id = %id, error = %why, "replay publish failed; left in the DLQ");
                    report.failed.push((id, why));
                }
                None if self.cancel.is_cancelled() => cancelled = true,
                None => report.failed.push((
                    id,
                    "an earlier message of its key failed; left in the DLQ".into(),
                )),
            }
        }
        (confirmed, cancelled)
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

    /// Send `copy` of a dead letter to the replay target: failure headers stripped, the
    /// replay marker set.
    async fn republish(
        &self,
        sub: &Subscription,
        mut copy: Message,
        record: &DeadLetter,
        clock: &Clock,
    ) -> Result<(), BrokerError> {
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

/// One copy's fate in a lane: sent (and how it went), or not sent (`None`: an earlier
/// copy of its key failed, or the run was cancelled).
type LaneOutcome = (MessageId, Option<Result<(), BrokerError>>);

/// The id of a corrected copy: a UUID (v5) of the original id and the correction.
fn corrected_id(original: &MessageId, correction: &Correction) -> MessageId {
    let mut name = Vec::new();
    name.extend_from_slice(original.as_str().as_bytes());
    name.push(0x1f);
    if let Some(p) = &correction.payload {
        name.extend_from_slice(p);
    }
    for (k, v) in &correction.headers {
        name.push(0x1f);
        name.extend_from_slice(k.as_bytes());
        name.push(b'=');
        name.extend_from_slice(v.as_bytes());
    }
    MessageId::from(uuid::Uuid::new_v5(&CORRECTION_NAMESPACE, &name).to_string())
}

/// The UUID namespace of corrected copies' ids.
const CORRECTION_NAMESPACE: uuid::Uuid =
    uuid::Uuid::from_u128(0x7e1c_4f0e_9a55_4d1b_8f6a_2b1e_c0de_f1ed);

/// A DLQ walked a page at a time through a filter, up to the filter's limit and a most
/// scanned; what replay and purge share.
struct Scan<'f> {
    filter: &'f DeadLetterFilter,
    scan_max: usize,
    limit: usize,
    cursor: Cursor,
    scanned: usize,
    matched: usize,
    unreadable: usize,
    done: bool,
}

impl<'f> Scan<'f> {
    fn new(filter: &'f DeadLetterFilter, scan_max: usize) -> Self {
        Self {
            filter,
            scan_max,
            limit: filter.get_limit().unwrap_or(usize::MAX),
            cursor: Cursor::start(),
            scanned: 0,
            matched: 0,
            unreadable: 0,
            done: false,
        }
    }

    /// The next page's matching entries with their records; `None` at the end.
    async fn next_page(
        &mut self,
        dlq: &dyn DeadLetters,
    ) -> Result<Option<Vec<(DeadLetterEntry, DeadLetter)>>, BrokerError> {
        if self.done || self.scanned >= self.scan_max || self.matched >= self.limit {
            return Ok(None);
        }
        let page = dlq
            .browse(&self.cursor, PAGE.min(self.scan_max - self.scanned))
            .await?;
        self.done = page.at_end || page.entries.is_empty();
        self.cursor = page.next;
        let mut selected = Vec::new();
        for entry in page.entries {
            if self.matched >= self.limit {
                self.done = true;
                break;
            }
            self.scanned += 1;
            let record = match entry.record() {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!(message_id = %entry.id(), error = %e, "dead letter without a readable record; left in place");
                    self.unreadable += 1;
                    continue;
                }
            };
            if self.filter.matches(&entry, &record) {
                self.matched += 1;
                selected.push((entry, record));
            }
        }
        Ok(Some(selected))
    }
}

/// Entries read per browse.
const PAGE: usize = 256;
