//! The outbox relay: its builder, the claim–publish–mark loop with its back-off and lease
//! guard, the running relay's handle, and its counters.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering as AtomicOrdering};
use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBackoff, ExponentialBuilder};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::broker::Broker;
use crate::telemetry::RelayMetrics;

use super::{OutboxError, OutboxStore};

/// A relay setting is invalid.
#[derive(Debug, thiserror::Error)]
#[error("invalid relay setting `{field}`: {reason}")]
pub struct RelayConfigError {
    /// The setting.
    pub field: &'static str,
    /// What is wrong.
    pub reason: &'static str,
}

/// Why one relay round did not publish everything it claimed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RelayError {
    /// The store failed (claim, mark or release).
    #[error(transparent)]
    Store(#[from] OutboxError),
    /// The broker did not confirm a message; it and the rows after it were released.
    #[error("publishing outbox row {seq} failed: {reason}")]
    Publish {
        /// The row that failed.
        seq: i64,
        /// The broker's error.
        reason: String,
    },
}

/// How often a running relay reads its store's backlog for the gauges.
const BACKLOG_EVERY: Duration = Duration::from_secs(5);

/// Counters of one relay (the same events as the metrics).
#[derive(Debug, Default)]
struct RelayCounters {
    published: AtomicU64,
    publish_failures: AtomicU64,
    store_failures: AtomicU64,
    batches: AtomicU64,
}

/// A snapshot of a relay's counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RelayStats {
    /// Messages the broker confirmed.
    pub published: u64,
    /// Publishes that failed (the row was kept and released).
    pub publish_failures: u64,
    /// Store calls that failed (claim, mark, release, listen).
    pub store_failures: u64,
    /// Non-empty batches claimed.
    pub batches: u64,
}

/// Entry point: [`Relay::builder`].
pub struct Relay {
    inner: Arc<RelayInner>,
}

impl std::fmt::Debug for Relay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay").finish_non_exhaustive()
    }
}

/// A relay under construction.
pub struct RelayBuilder {
    store: Arc<dyn OutboxStore>,
    broker: Arc<dyn Broker>,
    name: String,
    batch_size: usize,
    lease: Duration,
    poll_interval: Option<Duration>,
    backoff: (Duration, Duration),
}

impl std::fmt::Debug for RelayBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RelayBuilder")
            .field("broker", &self.broker.kind())
            .field("name", &self.name)
            .field("batch_size", &self.batch_size)
            .field("lease", &self.lease)
            .field("poll_interval", &self.poll_interval)
            .finish_non_exhaustive()
    }
}

impl RelayBuilder {
    /// The relay's name: the `relay` label of its metrics and the prefix of its lease
    /// owner id (default `outbox`).
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// Most rows claimed per round (default 100).
    pub fn batch_size(mut self, n: usize) -> Self {
        self.batch_size = n;
        self
    }

    /// How long a claim holds its rows (default 30 s). Must cover publishing a whole batch;
    /// the relay stops publishing a batch at nine tenths of it and releases the rest.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// How long an idle relay waits before claiming again when nothing woke it (default:
    /// the store's [`OutboxStore::default_poll_interval`]).
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.poll_interval = Some(interval);
        self
    }

    /// Back-off after a failed publish or store call: exponential with jitter from `min`
    /// to `max` (default 100 ms to 30 s).
    pub fn backoff(mut self, min: Duration, max: Duration) -> Self {
        self.backoff = (min, max);
        self
    }

    /// Check the settings and build the relay.
    pub fn build(self) -> Result<Relay, RelayConfigError> {
        let bad = |field, reason| Err(RelayConfigError { field, reason });
        if self.name.trim().is_empty() {
            return bad("name", "must not be empty");
        }
        if self.batch_size == 0 {
            return bad("batch_size", "must be at least 1");
        }
        if self.lease < Duration::from_millis(10) {
            return bad("lease", "must be at least 10 ms");
        }
        if self.backoff.0.is_zero() || self.backoff.1 < self.backoff.0 {
            return bad("backoff", "needs 0 < min <= max");
        }
        let poll_interval = self
            .poll_interval
            .unwrap_or_else(|| self.store.default_poll_interval());
        if poll_interval.is_zero() {
            return bad("poll_interval", "must be longer than zero");
        }
        let owner = format!("{}-{}", self.name, uuid::Uuid::now_v7());
        Ok(Relay {
            inner: Arc::new(RelayInner {
                metrics: RelayMetrics::new(&self.name),
                store: self.store,
                broker: self.broker,
                owner,
                batch_size: self.batch_size,
                lease: self.lease,
                poll_interval,
                backoff: self.backoff,
                counters: RelayCounters::default(),
            }),
        })
    }
}

struct RelayInner {
    store: Arc<dyn OutboxStore>,
    broker: Arc<dyn Broker>,
    owner: String,
    batch_size: usize,
    lease: Duration,
    poll_interval: Duration,
    backoff: (Duration, Duration),
    counters: RelayCounters,
    metrics: RelayMetrics,
}

/// How a batch stopped before its end.
enum Stop {
    Failed(String),
    LeaseEnding,
}

impl Relay {
    /// A relay that moves rows from `store` to `broker`.
    pub fn builder(store: Arc<dyn OutboxStore>, broker: Arc<dyn Broker>) -> RelayBuilder {
        RelayBuilder {
            store,
            broker,
            name: "outbox".to_owned(),
            batch_size: 100,
            lease: Duration::from_secs(30),
            poll_interval: None,
            backoff: (Duration::from_millis(100), Duration::from_secs(30)),
        }
    }

    /// This relay's lease owner id (`<name>-<uuid>`).
    pub fn owner(&self) -> &str {
        &self.inner.owner
    }

    /// The counters so far.
    pub fn stats(&self) -> RelayStats {
        self.inner.stats()
    }

    /// One round: claim a batch, publish it in order, mark what the broker confirmed.
    /// Returns how many rows were published (0: nothing to do). For tests, benchmarks and
    /// callers that drive the relay themselves; [`Relay::start`] loops over it.
    pub async fn run_once(&self) -> Result<usize, RelayError> {
        self.inner.round().await
    }

    /// Run in the background until [`RelayHandle::shutdown`].
    pub fn start(self) -> RelayHandle {
        let stop = CancellationToken::new();
        let inner = self.inner.clone();
        let task = tokio::spawn(inner.run(stop.clone()));
        RelayHandle {
            inner: self.inner,
            stop,
            task,
        }
    }
}

/// A running relay.
pub struct RelayHandle {
    inner: Arc<RelayInner>,
    stop: CancellationToken,
    task: JoinHandle<()>,
}

impl std::fmt::Debug for RelayHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RelayHandle")
            .field("stopping", &self.stop.is_cancelled())
            .finish_non_exhaustive()
    }
}

impl RelayHandle {
    /// The counters so far.
    pub fn stats(&self) -> RelayStats {
        self.inner.stats()
    }

    /// This relay's lease owner id.
    pub fn owner(&self) -> &str {
        &self.inner.owner
    }

    /// Finish the batch in progress (publish, mark), then stop. Returns the counters.
    pub async fn shutdown(self) -> RelayStats {
        self.stop.cancel();
        let _ = self.task.await;
        self.inner.stats()
    }

    /// Stop at once, as if the process died: a batch in progress is neither marked nor
    /// released; its rows are published again after their lease. For crash tests
    /// (feature `test-util`).
    #[cfg(feature = "test-util")]
    pub async fn crash(self) {
        self.task.abort();
        let _ = self.task.await;
    }
}

impl RelayInner {
    fn stats(&self) -> RelayStats {
        let r = |c: &AtomicU64| c.load(AtomicOrdering::Relaxed);
        let c = &self.counters;
        RelayStats {
            published: r(&c.published),
            publish_failures: r(&c.publish_failures),
            store_failures: r(&c.store_failures),
            batches: r(&c.batches),
        }
    }

    fn new_backoff(&self) -> ExponentialBackoff {
        ExponentialBuilder::default()
            .with_min_delay(self.backoff.0)
            .with_max_delay(self.backoff.1)
            .with_factor(2.0)
            .with_jitter()
            .without_max_times()
            .build()
    }

    fn store_failed(&self, what: &str, e: &OutboxError) {
        self.counters
            .store_failures
            .fetch_add(1, AtomicOrdering::Relaxed);
        self.metrics.store_failures.increment(1);
        tracing::warn!(relay = %self.owner, error = %crate::classify::ErrorChain(e), "outbox store: {what} failed");
    }

    /// Set the backlog gauges from the store's count of unsent rows.
    async fn read_backlog(&self) {
        match self.store.backlog().await {
            Ok(Some(b)) => {
                self.metrics.backlog_rows.set(b.rows as f64);
                self.metrics.oldest_age.set(b.oldest_age.as_secs_f64());
            }
            Ok(None) => {}
            Err(e) => self.store_failed("counting the backlog", &e),
        }
    }

    async fn run(self: Arc<Self>, stop: CancellationToken) {
        let mut backoff = self.new_backoff();
        let mut wakeup = loop {
            match self.store.listen().await {
                Ok(w) => break w,
                Err(e) => {
                    self.store_failed("listen", &e);
                    let wait = backoff.next().unwrap_or(self.backoff.1);
                    tokio::select! {
                        _ = tokio::time::sleep(wait) => {}
                        _ = stop.cancelled() => return,
                    }
                }
            }
        };
        tracing::info!(relay = %self.owner, "outbox relay started");
        let mut gauges_due = Instant::now();
        while !stop.is_cancelled() {
            if Instant::now() >= gauges_due {
                self.read_backlog().await;
                gauges_due = Instant::now() + BACKLOG_EVERY;
            }
            match self.round().await {
                Ok(0) => {
                    backoff = self.new_backoff();
                    tokio::select! {
                        _ = wakeup.wait(self.poll_interval) => {}
                        _ = stop.cancelled() => {}
                    }
                }
                // A full or partial batch: there may be more right away.
                Ok(_) => backoff = self.new_backoff(),
                Err(e) => {
                    let wait = backoff.next().unwrap_or(self.backoff.1);
                    tracing::warn!(relay = %self.owner, error = %e, retry_in = ?wait,
                        "outbox relay round failed; rows are kept");
                    tokio::select! {
                        _ = tokio::time::sleep(wait) => {}
                        _ = stop.cancelled() => {}
                    }
                }
            }
        }
        tracing::info!(relay = %self.owner, "outbox relay stopped");
    }

    async fn round(&self) -> Result<usize, RelayError> {
        // Measured from before the claim is sent, so the relay's deadline falls before the
        // store's lease expiry.
        let started = Instant::now();
        let mut batch = match self
            .store
            .claim_batch(&self.owner, self.batch_size, self.lease)
            .await
        {
            Ok(b) => b,
            Err(e) => {
                self.store_failed("claim", &e);
                return Err(e.into());
            }
        };
        if batch.is_empty() {
            return Ok(0);
        }
        self.counters.batches.fetch_add(1, AtomicOrdering::Relaxed);
        batch.sort_by_key(|r| r.seq);
        let deadline = started + self.lease - self.lease / 10;
        let mut sent = Vec::with_capacity(batch.len());
        let mut stopped = None;
        let mut rows = batch.into_iter();
        while let Some(row) = rows.next() {
            let left = deadline.saturating_duration_since(Instant::now());
            let outcome = if left.is_zero() {
                Some(Stop::LeaseEnding)
            } else {
                match tokio::time::timeout(left, self.broker.publish(&row.destination, row.message))
                    .await
                {
                    Ok(Ok(())) => None,
                    Ok(Err(e)) => Some(Stop::Failed(e.to_string())),
                    Err(_) => Some(Stop::Failed(format!(
                        "no confirm within the lease's remaining {left:?}"
                    ))),
                }
            };
            match outcome {
                None => {
                    self.counters
                        .published
                        .fetch_add(1, AtomicOrdering::Relaxed);
                    self.metrics.published.increment(1);
                    sent.push(row.seq);
                }
                Some(stop) => {
                    let rest: Vec<i64> = std::iter::once(row.seq)
                        .chain(rows.by_ref().map(|r| r.seq))
                        .collect();
                    stopped = Some((stop, rest));
                    break;
                }
            }
        }
        if !sent.is_empty()
            && let Err(e) = self.store.mark_sent(&self.owner, &sent).await
        {
            // The broker has them; the rows come back after the lease and are published
            // again with the same ids (the consumers' inbox absorbs the copies).
            self.store_failed("mark_sent", &e);
            return Err(e.into());
        }
        let Some((stop, rest)) = stopped else {
            return Ok(sent.len());
        };
        let (failed, reason) = match stop {
            Stop::LeaseEnding => (false, "the relay's lease was ending".to_owned()),
            Stop::Failed(reason) => {
                self.counters
                    .publish_failures
                    .fetch_add(1, AtomicOrdering::Relaxed);
                self.metrics.publish_failures.increment(1);
                (true, reason)
            }
        };
        if let Err(e) = self.store.release(&self.owner, &rest, &reason).await {
            // Unreleased rows come back when their lease expires.
            self.store_failed("release", &e);
        }
        if !failed {
            return Ok(sent.len());
        }
        Err(RelayError::Publish {
            seq: rest.first().copied().unwrap_or_default(),
            reason,
        })
    }
}
