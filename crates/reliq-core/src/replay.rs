use std::collections::HashSet;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::AtomicUsize;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use bytes::Bytes;
use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::broker::Broker;
use crate::dead_letters::{Cursor, DeadLetterEntry, DeadLetters};
use crate::error::BrokerError;
use crate::filter::DeadLetterFilter;
use crate::headers::{self, DeadLetter};
use crate::message::{Message, MessageId};
use crate::subscription::{Destination, Subscription};
use crate::sync::lock;
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
    /// Why the run's [`ReplayGuard`] stopped it (then `cancelled` too).
    pub stopped: Option<String>,
    /// From the first copy sent to the last one confirmed: the time the rate limit
    /// paces (the reads before and the last removal after are not in it).
    pub publishing: Duration,
}

/// Asked at intervals during a replay whether to go on: a ramped replay after a fix
/// watches the consumer it feeds and stops when the consumer starts failing again.
#[async_trait::async_trait]
pub trait ReplayGuard: Send + Sync {
    /// `Err(why)` stops the run after its copies in flight (what it had not sent stays
    /// in the DLQ); an error reading what it watches should say so, not stop the run.
    async fn check(&self) -> Result<(), String>;
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
///
/// The dead-letter engine: replay dead letters to their consumer, replay a corrected copy
/// of one, or purge them — operator actions, never automatic.
///
/// Dry-run first ([`Replay::dry_run`] lists what would move), then [`Replay::execute`].
/// Each replayed copy keeps its message id, loses the failure headers (so it gets a fresh
/// retry budget), and carries `reliq-replay-count` / `reliq-replayed-at`. The DLQ is
/// browsed without consuming it ([`crate::dead_letters::DeadLetters`]); an entry is removed only after
/// its replayed copy was confirmed; entries that do not match the filter are never
/// touched. A run killed midway loses nothing: what was confirmed but not yet removed is
/// sent again by the next run, with its id, and the consumer's inbox absorbs it. Every
/// replayed id is logged on the `reliq::audit` tracing target.
///
/// Copies are published [`Replay::in_flight`] at a time — one after another within a
/// message key (so one key's dead letters go back in DLQ order), concurrently across keys —
/// and paced by [`Replay::rate_limit`].
///
/// ```no_run
/// # async fn demo(broker: std::sync::Arc<dyn reliq_core::Broker>) -> Result<(), reliq_core::BrokerError> {
/// use reliq_core::{Replay, DeadLetterFilter, Subscription, DeadLetterReason};
/// let sub = Subscription::new("inventory", "orders");
/// let filter = DeadLetterFilter::default().reasons([DeadLetterReason::Exhausted]).limit(100);
/// let plan = Replay::new(broker.clone(), sub.clone()).filter(filter.clone()).dry_run().await?;
/// println!("{} messages would be replayed", plan.matched.len());
/// let done = Replay::new(broker, sub).filter(filter).rate_limit(50).execute().await?;
/// assert_eq!(done.replayed.len(), plan.matched.len());
/// # Ok(()) }
/// ```
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
    /// From this rate per second up to `per_second`, over this long.
    ramp: Option<(NonZeroU32, Duration)>,
    guard: Option<(Duration, Arc<dyn ReplayGuard>)>,
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
            .field("ramp", &self.ramp)
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
            in_flight: 256,
            progress: None,
            cancel: CancellationToken::new(),
            ramp: None,
            guard: None,
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

    /// Start at `start_per_second` and raise the rate evenly to the [rate
    /// limit](Self::rate_limit) over `over` (no effect without a rate limit): after a
    /// fix, a downstream takes the backlog slowly first. Paced copy by copy, no burst.
    pub fn ramp(mut self, start_per_second: u32, over: Duration) -> Self {
        self.ramp = NonZeroU32::new(start_per_second).map(|s| (s, over));
        self
    }

    /// Ask `guard` as the run starts and then every `every` whether to go on (see
    /// [`ReplayGuard`]); a refusal stops the run like a cancel and is the report's
    /// `stopped`.
    pub fn guard(mut self, every: Duration, guard: Arc<dyn ReplayGuard>) -> Self {
        self.guard = Some((every, guard));
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

    /// Copies awaiting their broker confirm at once (default 256; at least 1). With 1, the
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
            self.report_progress(scan.scanned, scan.matched, report.removed.len(), 0);
        }
        report.scanned = scan.scanned;
        report.unreadable = scan.unreadable;
        self.report_progress(scan.scanned, scan.matched, report.removed.len(), 0);
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

    fn report_progress(&self, scanned: usize, matched: usize, done: usize, failed: usize) {
        if let Some(f) = &self.progress {
            f(&Progress {
                scanned,
                matched,
                done,
                failed,
            });
        }
    }

    async fn run(mut self, dry_run: bool) -> Result<ReplayReport, BrokerError> {
        // The guard cancels this run, not the caller's token.
        self.cancel = self.cancel.child_token();
        let sub = &self.subscription;
        let dlq = self.broker.dead_letters(sub).await?;
        let report = if dry_run {
            self.list_matching(dlq.as_ref()).await?
        } else {
            self.replay_matching(dlq.as_ref()).await?
        };
        tracing::info!(target: "reliq::audit", consumer = %sub.consumer, dry_run, scanned = report.scanned,
            matched = report.matched.len(), replayed = report.replayed.len(), failed = report.failed.len(),
            cancelled = report.cancelled, "replay finished");
        Ok(report)
    }

    /// A dry run: what matches, moving nothing.
    async fn list_matching(&self, dlq: &dyn DeadLetters) -> Result<ReplayReport, BrokerError> {
        let mut report = ReplayReport::default();
        let mut scan = Scan::new(&self.filter, self.scan_max);
        while let Some(page) = scan.next_page(dlq).await? {
            report
                .matched
                .extend(page.into_iter().map(|(e, record)| ReplayEntry {
                    id: e.message.id().clone(),
                    record,
                }));
            self.report_progress(scan.scanned, scan.matched, 0, 0);
        }
        report.scanned = scan.scanned;
        report.unreadable = scan.unreadable;
        self.report_progress(scan.scanned, scan.matched, 0, 0);
        Ok(report)
    }

    /// The replay proper, as a pipeline of three stages running at once, so the broker's
    /// read and remove costs hide behind the (rate-limited) publishing:
    ///
    /// 1. the **reader** browses the next page while the current one is published (at
    ///    most two pages ahead);
    /// 2. the **publisher** sends each page's copies, `in_flight` at a time, one key's in
    ///    order, and hands on the ids the broker confirmed;
    /// 3. the **remover** takes confirmed ids out of the DLQ in batches of
    ///    [`REMOVE_BATCH`] — never an id before its copy was confirmed. A run killed
    ///    between a confirm and its batch's removal leaves those entries in the DLQ: the
    ///    next run sends them again with the same ids, and the consumer's inbox absorbs
    ///    them.
    ///
    /// A browse error stops the reader; what was already read is still published and
    /// removed before the error is returned, so nothing confirmed stays behind.
    async fn replay_matching(&self, dlq: &dyn DeadLetters) -> Result<ReplayReport, BrokerError> {
        let run = RunState::new(self);
        let (pages_tx, pages_rx) = mpsc::channel::<Vec<(DeadLetterEntry, DeadLetter)>>(2);
        let (confirmed_tx, confirmed_rx) = mpsc::unbounded_channel::<MessageId>();
        // One lane per worker, `in_flight` of them for the whole run: a key always goes to
        // the same lane (so its dead letters go back in DLQ order, across pages), keyless
        // entries round the lanes; no page waits for the last copy of the one before.
        let (lane_txs, lane_rxs): (Vec<_>, Vec<_>) = (0..self.in_flight)
            .map(|_| mpsc::channel::<(DeadLetterEntry, DeadLetter)>(LANE_DEPTH))
            .unzip();
        let lanes = futures::future::join_all(
            lane_rxs
                .into_iter()
                .map(|lane| self.publish_lane(&run, lane, confirmed_tx.clone())),
        );
        drop(confirmed_tx);
        let publisher = async {
            tokio::join!(self.dispatch_pages(&run, pages_rx, lane_txs), lanes);
        };
        let pipeline = async {
            tokio::join!(
                self.read_pages(dlq, &run.tally, pages_tx),
                publisher,
                self.remove_confirmed(dlq, &run, confirmed_rx)
            )
        };
        // The guard's refusal cancels the run; the pipeline then ends as on a cancel.
        let ((scanned, unreadable, read), (), ()) = tokio::select! {
            done = pipeline => done,
            never = self.watch_guard(&run) => match never {},
        };
        let publishing = lock(&run.publishing).map_or(Duration::ZERO, |(f, l)| l - f);
        let stopped = lock(&run.stopped).take();
        let mut report = run.report.into_inner().unwrap_or_else(|p| p.into_inner());
        report.scanned = scanned;
        report.unreadable = unreadable;
        report.publishing = publishing;
        report.stopped = stopped;
        if self.cancel.is_cancelled()
            && report.matched.len() > report.replayed.len() + report.failed.len()
        {
            report.cancelled = true;
        }
        self.report_tally(&run.tally);
        read.map(|()| report)
    }

    /// Ask the guard at its interval until it refuses: then cancel the run, note why,
    /// and wait for the pipeline to end. Without a guard, only waits.
    async fn watch_guard(&self, run: &RunState) -> std::convert::Infallible {
        if let Some((every, guard)) = &self.guard {
            // The first tick is now: a guard sets its baseline before the first copy
            // (and one that already says no stops the run before it sends anything).
            let mut tick = tokio::time::interval(*every);
            loop {
                tokio::select! {
                    () = self.cancel.cancelled() => break,
                    _ = tick.tick() => {}
                }
                if let Err(why) = guard.check().await {
                    tracing::warn!(target: "reliq::audit", consumer = %self.subscription.consumer,
                        reason = %why, "replay stopped by its guard; the rest stays in the DLQ");
                    *lock(&run.stopped) = Some(why);
                    self.cancel.cancel();
                    break;
                }
            }
        }
        std::future::pending().await
    }

    /// Stage 1: browse the matching pages, at most two ahead of the publisher. Returns
    /// what was scanned and unreadable, and the browse error that stopped it, if any.
    async fn read_pages(
        &self,
        dlq: &dyn DeadLetters,
        tally: &Tally,
        pages: mpsc::Sender<Vec<(DeadLetterEntry, DeadLetter)>>,
    ) -> (usize, usize, Result<(), BrokerError>) {
        let mut scan = Scan::new(&self.filter, self.scan_max);
        let result = loop {
            if self.cancel.is_cancelled() {
                break Ok(());
            }
            let started = Instant::now();
            match scan.next_page(dlq).await {
                Ok(Some(page)) => {
                    tracing::debug!(entries = page.len(), took = ?started.elapsed(), "replay: page read");
                    tally.read(scan.scanned, scan.matched);
                    if pages.send(page).await.is_err() {
                        break Ok(()); // the publisher stopped (cancelled)
                    }
                }
                Ok(None) => break Ok(()),
                Err(e) => break Err(e),
            }
        };
        (scan.scanned, scan.unreadable, result)
    }

    /// Stage 2a: record each page as matched and hand its entries to the lanes (a key
    /// always to the same lane).
    async fn dispatch_pages(
        &self,
        run: &RunState,
        mut pages: mpsc::Receiver<Vec<(DeadLetterEntry, DeadLetter)>>,
        lanes: Vec<mpsc::Sender<(DeadLetterEntry, DeadLetter)>>,
    ) {
        let mut round = 0usize;
        'pages: while let Some(page) = pages.recv().await {
            lock(&run.report)
                .matched
                .extend(page.iter().map(|(e, record)| ReplayEntry {
                    id: e.id().clone(),
                    record: record.clone(),
                }));
            for item in page {
                if self.cancel.is_cancelled() {
                    break 'pages;
                }
                let lane = match item.0.message.key() {
                    Some(key) => lane_of(key, lanes.len()),
                    None => {
                        round = round.wrapping_add(1);
                        round % lanes.len()
                    }
                };
                if lanes[lane].send(item).await.is_err() {
                    break 'pages;
                }
            }
        }
        drop(lanes);
        // Let the reader's pending send fail, so it stops.
        pages.close();
    }

    /// Stage 2b: one lane's copies, in order, at the run's rate; each confirmed id goes
    /// on to the remover, each failure into the report (and its key's later entries stay
    /// in the DLQ, so none overtakes it).
    async fn publish_lane(
        &self,
        run: &RunState,
        mut lane: mpsc::Receiver<(DeadLetterEntry, DeadLetter)>,
        confirmed: mpsc::UnboundedSender<MessageId>,
    ) {
        let mut failed_keys: HashSet<String> = HashSet::new();
        while let Some((entry, record)) = lane.recv().await {
            if self.cancel.is_cancelled() {
                continue; // not sent: stays in the DLQ
            }
            let id = entry.id().clone();
            let key = entry.message.key().map(str::to_owned);
            if key.as_ref().is_some_and(|k| failed_keys.contains(k)) {
                run.tally.failed.fetch_add(1, Relaxed);
                lock(&run.report).failed.push((
                    id,
                    "an earlier message of its key failed; left in the DLQ".into(),
                ));
                continue;
            }
            // Every lane may be waiting here at a cancel: none sends after it.
            if let Some(pacer) = &run.ramp {
                tokio::select! {
                    biased;
                    () = self.cancel.cancelled() => continue, // not sent: stays in the DLQ
                    () = pacer.wait() => {}
                }
            } else if let Some(l) = &run.limiter {
                tokio::select! {
                    biased;
                    () = self.cancel.cancelled() => continue,
                    () = l.until_ready() => {}
                }
            }
            let sent = Instant::now();
            let result = self
                .republish(&self.subscription, entry.message, &record, &run.clock)
                .await;
            {
                let mut window = lock(&run.publishing);
                let first = window.map_or(sent, |(f, _)| f.min(sent));
                *window = Some((first, Instant::now()));
            }
            match result {
                Ok(()) => {
                    let _ = confirmed.send(id);
                }
                Err(e) => {
                    let why = crate::classify::ErrorChain(&e).to_string();
                    tracing::warn!(target: "reliq::audit", message_id = %id, error = %why, "replay publish failed; left in the DLQ");
                    failed_keys.extend(key);
                    run.tally.failed.fetch_add(1, Relaxed);
                    lock(&run.report).failed.push((id, why));
                }
            }
        }
    }

    /// Stage 3: take confirmed ids out of the DLQ in batches of [`REMOVE_BATCH`], or
    /// whatever is confirmed every [`REMOVE_EVERY`]; never an id before its copy was
    /// confirmed.
    async fn remove_confirmed(
        &self,
        dlq: &dyn DeadLetters,
        run: &RunState,
        mut confirmed: mpsc::UnboundedReceiver<MessageId>,
    ) {
        let mut batch = Vec::new();
        let mut last_removal = Instant::now();
        loop {
            let next = match tokio::time::timeout(REMOVE_EVERY, confirmed.recv()).await {
                Ok(next) => next.map(Some),
                Err(_) => Some(None), // nothing new for a while: remove what is due
            };
            let closed = next.is_none();
            batch.extend(next.flatten());
            // Take what else is already confirmed, up to a batch.
            while batch.len() < REMOVE_BATCH {
                match confirmed.try_recv() {
                    Ok(id) => batch.push(id),
                    Err(_) => break,
                }
            }
            let due =
                batch.len() >= REMOVE_BATCH || last_removal.elapsed() >= REMOVE_EVERY || closed;
            if due && !batch.is_empty() {
                last_removal = Instant::now();
                let ids = std::mem::take(&mut batch);
                let started = Instant::now();
                let (replayed, failed) = self.remove_replayed(dlq, ids, &run.replayed_total).await;
                tracing::debug!(removed = replayed.len() - failed.len(), took = ?started.elapsed(), "replay: batch removed");
                run.tally
                    .done
                    .fetch_add(replayed.len() - failed.len(), Relaxed);
                run.tally.failed.fetch_add(failed.len(), Relaxed);
                let mut report = lock(&run.report);
                report.replayed.extend(replayed);
                report.failed.extend(failed);
                drop(report);
                self.report_tally(&run.tally);
            }
            if closed {
                break;
            }
        }
    }

    fn report_tally(&self, t: &Tally) {
        self.report_progress(
            t.scanned.load(Relaxed),
            t.matched.load(Relaxed),
            t.done.load(Relaxed),
            t.failed.load(Relaxed),
        );
    }

    /// Remove the DLQ entries whose replayed copies were confirmed: the ids replayed (all
    /// of `confirmed`) and, of those, the ones still in the DLQ because the removal
    /// failed, with why.
    async fn remove_replayed(
        &self,
        dlq: &dyn DeadLetters,
        confirmed: Vec<MessageId>,
        replayed_total: &metrics::Counter,
    ) -> (Vec<MessageId>, Vec<(MessageId, String)>) {
        let consumer = &self.subscription.consumer;
        let error = match dlq.remove(&confirmed).await {
            Ok(removed) if removed.len() == confirmed.len() => None,
            Ok(removed) => {
                // Gone already (another replay or a purge removed them): still replayed.
                tracing::warn!(target: "reliq::audit", consumer = %consumer,
                    missing = confirmed.len() - removed.len(), "replayed dead letters were no longer in the DLQ");
                None
            }
            Err(e) => Some(crate::classify::ErrorChain(&e).to_string()),
        };
        replayed_total.increment(confirmed.len() as u64);
        let mut failed = Vec::new();
        for id in &confirmed {
            match &error {
                None => {
                    tracing::info!(target: "reliq::audit", consumer = %consumer, message_id = %id, "dead letter replayed")
                }
                Some(e) => {
                    // Replayed but still in the DLQ: a later replay would duplicate it
                    // (the inbox absorbs that). Report it.
                    tracing::warn!(target: "reliq::audit", message_id = %id, error = %e,
                        "replayed, but removing the DLQ copy failed");
                    failed.push((id.clone(), format!("dlq remove: {e}")));
                }
            }
        }
        (confirmed, failed)
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

/// Entries read per browse: large, since a browse has a fixed cost (on RabbitMQ a few
/// channel and consumer set-ups, on SQS a whole scan) that a replay at thousands per
/// second must spread over many entries.
const PAGE: usize = 5_000;

/// Entries waiting in each publishing lane.
const LANE_DEPTH: usize = 64;

/// The lane of `key`: its FNV-1a hash (the fingerprints' hash), modulo `lanes`.
fn lane_of(key: &str, lanes: usize) -> usize {
    let mut hash = crate::fingerprint::Fnv1a::default();
    hash.write(key.as_bytes());
    (hash.0 % lanes as u64) as usize
}

/// Confirmed copies whose DLQ entries are removed together, at the latest after
/// [`REMOVE_EVERY`]: fewer, larger removals (one costs a broker round trip or a ledger
/// append whatever its size, and on some brokers makes the next read wait). What a killed
/// run leaves behind — sent again by the next run, taken once by the inbox — is at most
/// this many, or this long.
const REMOVE_BATCH: usize = 10_000;
const REMOVE_EVERY: Duration = Duration::from_secs(5);

/// What the stages of one replay run share.
struct RunState {
    report: std::sync::Mutex<ReplayReport>,
    tally: Tally,
    /// The first copy's send and the last copy's confirm.
    publishing: std::sync::Mutex<Option<(Instant, Instant)>>,
    limiter: Option<DefaultDirectRateLimiter>,
    /// A ramped rate paces instead of `limiter`.
    ramp: Option<Pacer>,
    /// Why the guard stopped the run.
    stopped: std::sync::Mutex<Option<String>>,
    clock: Clock,
    replayed_total: metrics::Counter,
}

/// Paces copies one at a time at a rate that rises evenly from `start` to `target`
/// over `over` from the first copy: each takes the next slot, 1/rate after the last
/// one (a lane that finds the slot past starts now: no burst).
struct Pacer {
    start: f64,
    target: f64,
    over: Duration,
    /// The first slot handed out (the ramp's zero), and the next one.
    slots: tokio::sync::Mutex<Option<(Instant, Instant)>>,
}

impl Pacer {
    fn rate(&self, began: Instant, at: Instant) -> f64 {
        let done = if self.over.is_zero() {
            1.0
        } else {
            (at.saturating_duration_since(began).as_secs_f64() / self.over.as_secs_f64()).min(1.0)
        };
        self.start + (self.target - self.start) * done
    }

    async fn wait(&self) {
        let slot = {
            let mut slots = self.slots.lock().await;
            let now = Instant::now();
            let (began, next) = slots.unwrap_or((now, now));
            let slot = next.max(now);
            let gap = Duration::from_secs_f64(1.0 / self.rate(began, slot));
            *slots = Some((began, slot + gap));
            slot
        };
        tokio::time::sleep_until(slot.into()).await;
    }
}

impl RunState {
    fn new(replay: &Replay) -> Self {
        // A burst of 1/10 of the rate (100 ms of it): paced, yet a run held up for less
        // than that (a slow confirm, the remover's batch on the same connection, a
        // timer waking the lanes late) catches up rather than falling below the rate
        // for good; it adds at most 100 ms of copies to any window.
        let limiter = replay.per_second.map(|n| {
            let burst = NonZeroU32::new(n.get() / 10).unwrap_or(NonZeroU32::MIN);
            RateLimiter::direct(Quota::per_second(n).allow_burst(burst))
        });
        let consumer = replay.subscription.consumer.clone();
        Self {
            report: std::sync::Mutex::new(ReplayReport::default()),
            tally: Tally::default(),
            publishing: std::sync::Mutex::new(None),
            ramp: replay
                .ramp
                .zip(replay.per_second)
                .map(|((start, over), target)| Pacer {
                    start: f64::from(start.get().min(target.get())),
                    target: f64::from(target.get()),
                    over,
                    slots: tokio::sync::Mutex::new(None),
                }),
            stopped: std::sync::Mutex::new(None),
            limiter,
            clock: Clock::new(),
            replayed_total: metrics::counter!(telemetry::REPLAYED, "consumer" => consumer),
        }
    }
}

/// The running counts of a replay, for its progress callback.
#[derive(Default)]
struct Tally {
    scanned: AtomicUsize,
    matched: AtomicUsize,
    done: AtomicUsize,
    failed: AtomicUsize,
}

impl Tally {
    fn read(&self, scanned: usize, matched: usize) {
        self.scanned.store(scanned, Relaxed);
        self.matched.store(matched, Relaxed);
    }
}
