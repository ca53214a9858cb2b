//! The consumer runtime, written once for every backend:
//! receive (bounded) → handle (timeout, panic capture) → classify → ack / retry /
//! dead-letter.
//!
//! Guarantees:
//! - The source delivery is settled only after the retry or dead-letter copy was
//!   confirmed by the broker. If that publish fails, the delivery is *released* (the
//!   broker delivers it again later) and the receive loop backs off — a message is never
//!   dropped and never just logged.
//! - At most `max_in_flight` deliveries are held (received, not yet settled); the broker
//!   is asked for the same prefetch bound. At most `concurrency` handlers run at once.
//! - With [`Ordering::PerKey`], deliveries with the same key are handled one after the
//!   other in arrival order, while other keys run in parallel.
//! - Shutdown stops receiving, lets in-flight work finish within `shutdown_timeout`, then
//!   releases whatever is left. Nothing is lost and nothing is settled twice.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering as AtomicOrdering};
use std::sync::{Arc, Mutex};
use std::task::Poll;
use std::time::{Duration, Instant};

use futures::FutureExt;
use futures::stream::{FuturesUnordered, StreamExt as _};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, SemaphorePermit};
use tokio::task::JoinHandle;
use tokio_util::sync::{CancellationToken, WaitForCancellationFuture};
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use crate::batch::{Batch, BatchError, Failed};
use crate::broker::{Broker, BrokerError, Delivery, Receiver, RetryRequest, Subscription};
use crate::classify::{BoxError, Classifier, ErrorClass};
use crate::headers::{self, DeadLetter, DeadLetterReason};
use crate::inbox::{Claim, Duplicate, Inbox};
use crate::retry::{Decision, Failure, PolicyError, RetryPolicy};
use crate::telemetry::{Clock, ConsumerMetrics, SettleOp, TraceParent};

/// How deliveries of one consumer are ordered relative to each other.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Ordering {
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
}

/// A consumer under construction. Start with [`Consumer::builder`].
pub struct ConsumerBuilder {
    broker: Arc<dyn Broker>,
    name: String,
    source: Option<(String, Option<String>)>,
    policy: RetryPolicy,
    max_in_flight: u32,
    concurrency: Option<usize>,
    ordering: Ordering,
    handler_timeout: Option<Duration>,
    shutdown_timeout: Duration,
    inbox: Option<Arc<dyn Inbox>>,
    classifier: Classifier,
    lease: Duration,
    delivery_limit: Option<u32>,
    settle_backoff: (Duration, Duration),
    batch_size: usize,
}

/// Entry point of the runtime.
pub struct Consumer;

impl Consumer {
    /// A consumer named `name` (the consumer group) on `broker`.
    pub fn builder(broker: Arc<dyn Broker>, name: impl Into<String>) -> ConsumerBuilder {
        ConsumerBuilder {
            broker,
            name: name.into(),
            source: None,
            policy: RetryPolicy::default(),
            max_in_flight: 64,
            concurrency: None,
            ordering: Ordering::Unordered,
            handler_timeout: None,
            shutdown_timeout: Duration::from_secs(30),
            inbox: None,
            classifier: Classifier::default(),
            lease: Duration::from_secs(30),
            delivery_limit: None,
            settle_backoff: (Duration::from_millis(100), Duration::from_secs(10)),
            batch_size: DEFAULT_BATCH_SIZE,
        }
    }
}

impl ConsumerBuilder {
    /// Read `source` (topic / exchange / stream / queue), optionally filtered by a routing
    /// key pattern or subject (`*` one word, `#` any).
    pub fn subscribe(
        mut self,
        source: impl Into<String>,
        filter: impl Into<Option<String>>,
    ) -> Self {
        self.source = Some((source.into(), filter.into()));
        self
    }

    /// The retry policy (default: [`RetryPolicy::default`]).
    pub fn retry(mut self, policy: RetryPolicy) -> Self {
        self.policy = policy;
        self
    }

    /// Most deliveries held at once, received but not settled (default 64). Also the
    /// prefetch asked of the broker.
    pub fn max_in_flight(mut self, n: u32) -> Self {
        self.max_in_flight = n;
        self
    }

    /// Most handlers running at once (default: `max_in_flight`).
    pub fn concurrency(mut self, n: usize) -> Self {
        self.concurrency = Some(n);
        self
    }

    /// Ordering between deliveries (default [`Ordering::Unordered`]).
    pub fn ordering(mut self, ordering: Ordering) -> Self {
        self.ordering = ordering;
        self
    }

    /// A handler running longer fails with a transient timeout error.
    pub fn handler_timeout(mut self, timeout: Duration) -> Self {
        self.handler_timeout = Some(timeout);
        self
    }

    /// How long shutdown waits for in-flight handlers before releasing them (default 30 s).
    pub fn shutdown_timeout(mut self, timeout: Duration) -> Self {
        self.shutdown_timeout = timeout;
        self
    }

    /// Skip messages whose id this consumer already handled.
    pub fn inbox(mut self, inbox: Arc<dyn Inbox>) -> Self {
        self.inbox = Some(inbox);
        self
    }

    /// How errors are classified (default: markers and built-in rules only).
    pub fn classifier(mut self, classifier: Classifier) -> Self {
        self.classifier = classifier;
        self
    }

    /// Lease of a delivery before the broker may hand it out again (default 30 s).
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// The broker-side delivery limit (default: the policy's attempts + 5). Must be above
    /// the policy's attempts, or the broker would dead-letter before the policy does.
    pub fn delivery_limit(mut self, limit: u32) -> Self {
        self.delivery_limit = Some(limit);
        self
    }

    /// Back-off bounds after a failed settlement (default 100 ms doubling to 10 s).
    pub fn settle_backoff(mut self, initial: Duration, max: Duration) -> Self {
        self.settle_backoff = (initial, max);
        self
    }

    /// Most deliveries in one call of a batch handler ([`ConsumerBuilder::start_batch`];
    /// default 64, at most `max_in_flight`). A batch is what the broker has ready, up to
    /// this many: the runtime never waits for a batch to fill.
    pub fn batch_size(mut self, n: usize) -> Self {
        self.batch_size = n;
        self
    }

    /// The subscription this consumer will ask the broker for.
    pub fn subscription(&self) -> Result<Subscription, ConsumerError> {
        let (source, filter) = self.source.clone().ok_or(ConsumerError::Config {
            field: "subscribe",
            reason: "no source: call .subscribe(source, filter)".into(),
        })?;
        let delivery_limit = self
            .delivery_limit
            .unwrap_or_else(|| self.policy.attempts().saturating_add(5));
        Ok(Subscription {
            consumer: self.name.clone(),
            source,
            filter,
            prefetch: self.max_in_flight,
            retry_tiers: self.policy.tier_delays(),
            delivery_limit,
            lease: self.lease,
        })
    }

    fn validate(&self) -> Result<Subscription, ConsumerError> {
        let config = |field, reason: &str| ConsumerError::Config {
            field,
            reason: reason.into(),
        };
        if self.name.trim().is_empty() {
            return Err(config("name", "must not be empty"));
        }
        if self.max_in_flight == 0 {
            return Err(config("max_in_flight", "must be at least 1"));
        }
        if self.concurrency == Some(0) {
            return Err(config("concurrency", "must be at least 1"));
        }
        if self.lease.is_zero() {
            return Err(config("lease", "must be longer than zero"));
        }
        self.policy.validate()?;
        let subscription = self.subscription()?;
        if subscription.delivery_limit <= self.policy.attempts() {
            return Err(config(
                "delivery_limit",
                "must be greater than the retry policy's max attempts",
            ));
        }
        Ok(subscription)
    }

    /// Subscribe and start consuming in the background, one handler call per delivery;
    /// returns a handle to stop it.
    pub async fn start<F, Fut>(self, handler: F) -> Result<ConsumerHandle, ConsumerError>
    where
        F: Fn(Delivery) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), BoxError>> + Send + 'static,
    {
        let subscription = self.validate()?;
        self.launch(
            subscription,
            handler,
            RECEIVE_BATCH,
            dispatch_each::<F, Fut>,
        )
        .await
    }

    /// Like [`ConsumerBuilder::start`], with a batch handler: one call for up to
    /// [`ConsumerBuilder::batch_size`] deliveries, the successes acknowledged together
    /// (see [`crate::batch`]). A batch counts as one handler against `concurrency`, the
    /// handler timeout and the handler metrics. [`Ordering::PerKey`] is refused: two
    /// batches in flight may hold the same key.
    pub async fn start_batch<F, Fut>(self, handler: F) -> Result<ConsumerHandle, ConsumerError>
    where
        F: Fn(Batch) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), BatchError>> + Send + 'static,
    {
        let subscription = self.validate()?;
        if self.ordering == Ordering::PerKey {
            return Err(ConsumerError::Config {
                field: "ordering",
                reason: "per-key ordering needs a per-message handler (start), not start_batch"
                    .into(),
            });
        }
        if self.batch_size == 0 || self.batch_size > self.max_in_flight as usize {
            return Err(ConsumerError::Config {
                field: "batch_size",
                reason: format!(
                    "must be between 1 and max_in_flight ({}), not {}",
                    self.max_in_flight, self.batch_size
                ),
            });
        }
        let max = self.batch_size;
        self.launch(subscription, handler, max, dispatch_batch::<F, Fut>)
            .await
    }

    /// Subscribe and start the receive loop; `dispatch` hands out what each receive
    /// returned (per delivery, or as one batch).
    async fn launch<H: Send + Sync + 'static>(
        self,
        subscription: Subscription,
        handler: H,
        receive_max: usize,
        dispatch: Dispatch<H>,
    ) -> Result<ConsumerHandle, ConsumerError> {
        let receiver: Arc<dyn Receiver> = Arc::from(
            self.broker
                .subscribe(&subscription)
                .await
                .map_err(ConsumerError::Subscribe)?,
        );
        let concurrency = self
            .concurrency
            .unwrap_or(self.max_in_flight as usize)
            .min(Semaphore::MAX_PERMITS);
        let shared = Arc::new(Shared {
            metrics: ConsumerMetrics::new(&self.name),
            name: self.name.into(),
            receiver: receiver.clone(),
            handler,
            policy: self.policy,
            classifier: self.classifier,
            inbox: self.inbox,
            handler_timeout: self.handler_timeout,
            clock: Clock::new(),
            concurrency: (concurrency < self.max_in_flight as usize)
                .then(|| Semaphore::new(concurrency)),
            stats: Arc::new(Stats::default()),
            keyed: Mutex::new(HashMap::new()),
            group_size: (self.max_in_flight as usize
                / (2 * tokio::runtime::Handle::current()
                    .metrics()
                    .num_workers()
                    .max(1)))
            .clamp(1, RECEIVE_BATCH),
            ordering: self.ordering,
            backoff: SettleBackoff {
                failures: AtomicU32::new(0),
                initial: self.settle_backoff.0,
                max: self.settle_backoff.1,
            },
            tracker: TaskTracker::new(),
            hard_stop: Signal::default(),
            crash: Signal::default(),
        });
        let stop = CancellationToken::new();
        let in_flight = Arc::new(Semaphore::new(self.max_in_flight as usize));
        let loop_task = tokio::spawn(receive_loop(
            shared.clone(),
            stop.clone(),
            in_flight,
            receive_max,
            dispatch,
        ));
        tracing::info!(consumer = %shared.name, source = %subscription.source, "consumer started");
        Ok(ConsumerHandle {
            shared,
            stop,
            loop_task,
            shutdown_timeout: self.shutdown_timeout,
            receiver,
        })
    }

    /// Start, run until `shutdown` completes, then shut down gracefully.
    pub async fn run<F, Fut>(
        self,
        handler: F,
        shutdown: impl Future<Output = ()>,
    ) -> Result<ShutdownReport, ConsumerError>
    where
        F: Fn(Delivery) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), BoxError>> + Send + 'static,
    {
        let handle = self.start(handler).await?;
        shutdown.await;
        Ok(handle.shutdown().await)
    }

    /// [`ConsumerBuilder::start_batch`], run until `shutdown` completes, then shut down
    /// gracefully.
    pub async fn run_batch<F, Fut>(
        self,
        handler: F,
        shutdown: impl Future<Output = ()>,
    ) -> Result<ShutdownReport, ConsumerError>
    where
        F: Fn(Batch) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), BatchError>> + Send + 'static,
    {
        let handle = self.start_batch(handler).await?;
        shutdown.await;
        Ok(handle.shutdown().await)
    }
}

/// Counters of one consumer, readable while it runs (the same events as the metrics).
#[derive(Debug, Default)]
pub struct Stats {
    received: AtomicU64,
    processed: AtomicU64,
    retried: AtomicU64,
    dead_lettered: AtomicU64,
    discarded: AtomicU64,
    duplicates: AtomicU64,
    released: AtomicU64,
    settle_failures: AtomicU64,
    throttled: AtomicU64,
    panics: AtomicU64,
    in_flight: AtomicU64,
    max_in_flight: AtomicU64,
    running: AtomicU64,
    max_running: AtomicU64,
}

/// A snapshot of [`Stats`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StatsSnapshot {
    /// Deliveries received.
    pub received: u64,
    /// Handled successfully and acknowledged.
    pub processed: u64,
    /// Sent to a retry (confirmed).
    pub retried: u64,
    /// Dead-lettered (confirmed).
    pub dead_lettered: u64,
    /// Dropped by [`crate::FinalRoute::Discard`].
    pub discarded: u64,
    /// Skipped as duplicates: found by the runtime's inbox, or reported by the handler
    /// with [`Duplicate`].
    pub duplicates: u64,
    /// Released back to the broker unsettled (failed settlement, shutdown).
    pub released: u64,
    /// Settlements that failed.
    pub settle_failures: u64,
    /// Receives held back by the settle back-off (after failed settlements or inbox
    /// claims, until the next success).
    pub throttled: u64,
    /// Handler panics caught.
    pub panics: u64,
    /// Held right now (received, not settled).
    pub in_flight: u64,
    /// Most ever held at once.
    pub max_in_flight: u64,
    /// Most handlers ever running at once.
    pub max_running: u64,
}

impl Stats {
    fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, AtomicOrdering::Relaxed);
    }

    /// Read all counters.
    pub fn snapshot(&self) -> StatsSnapshot {
        let r = |c: &AtomicU64| c.load(AtomicOrdering::Relaxed);
        StatsSnapshot {
            received: r(&self.received),
            processed: r(&self.processed),
            retried: r(&self.retried),
            dead_lettered: r(&self.dead_lettered),
            discarded: r(&self.discarded),
            duplicates: r(&self.duplicates),
            released: r(&self.released),
            settle_failures: r(&self.settle_failures),
            throttled: r(&self.throttled),
            panics: r(&self.panics),
            in_flight: r(&self.in_flight),
            max_in_flight: r(&self.max_in_flight),
            max_running: r(&self.max_running),
        }
    }
}

/// What shutdown did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShutdownReport {
    /// True if every in-flight handler finished within the shutdown timeout.
    pub drained: bool,
    /// The counters at the end.
    pub stats: StatsSnapshot,
}

/// A running consumer.
pub struct ConsumerHandle {
    shared: Arc<dyn Control>,
    stop: CancellationToken,
    loop_task: JoinHandle<()>,
    shutdown_timeout: Duration,
    receiver: Arc<dyn Receiver>,
}

impl ConsumerHandle {
    /// Current counters.
    pub fn stats(&self) -> StatsSnapshot {
        self.shared.stats().snapshot()
    }

    /// Stop receiving, wait up to the shutdown timeout for in-flight handlers, release
    /// the rest, close the receiver.
    pub async fn shutdown(self) -> ShutdownReport {
        self.stop.cancel();
        let _ = self.loop_task.await;
        let tracker = self.shared.tracker();
        tracker.close();
        let drained = tokio::time::timeout(self.shutdown_timeout, tracker.wait())
            .await
            .is_ok();
        if !drained {
            tracing::warn!(
                timeout = ?self.shutdown_timeout,
                "in-flight handlers did not finish in time; releasing their deliveries"
            );
            self.shared.hard_stop().fire();
            tracker.wait().await;
        }
        if let Err(e) = self.receiver.close().await {
            tracing::warn!(error = %e, "closing the receiver failed");
        }
        ShutdownReport {
            drained,
            stats: self.shared.stats().snapshot(),
        }
    }

    /// Stop as if the process died: nothing in flight is settled or released; the
    /// receiver is dropped without closing, so the broker redelivers what was unsettled
    /// (after its lease / on connection loss). For tests of crash behaviour.
    pub async fn crash(self) {
        // Fired before the stop, so the receive loop sees the crash when it stops.
        self.shared.crash().fire();
        self.stop.cancel();
        let _ = self.loop_task.await;
        let tracker = self.shared.tracker();
        tracker.close();
        tracker.wait().await;
    }
}

/// The part of the shared state a handle needs, without the handler type.
trait Control: Send + Sync {
    fn stats(&self) -> &Stats;
    fn tracker(&self) -> &TaskTracker;
    fn hard_stop(&self) -> &Signal;
    fn crash(&self) -> &Signal;
}

impl<F: Send + Sync> Control for Shared<F> {
    fn stats(&self) -> &Stats {
        &self.stats
    }
    fn tracker(&self) -> &TaskTracker {
        &self.tracker
    }
    fn hard_stop(&self) -> &Signal {
        &self.hard_stop
    }
    fn crash(&self) -> &Signal {
        &self.crash
    }
}

/// A one-way stop signal (hard stop, crash) that every in-flight delivery races against.
/// A `CancellationToken::cancelled()` per delivery locks the token and its waiter list to
/// register and again to deregister — shared locks every worker takes for every
/// message. Here a flag is read first, and the token is registered with only when the
/// guarded work has to wait.
#[derive(Default)]
struct Signal {
    fired: AtomicBool,
    token: CancellationToken,
}

impl Signal {
    fn fire(&self) {
        self.fired.store(true, AtomicOrdering::SeqCst);
        self.token.cancel();
    }

    fn is_fired(&self) -> bool {
        self.fired.load(AtomicOrdering::SeqCst)
    }

    /// `work`'s output, or `None` if the signal fired first. Checked before every poll of
    /// `work`, as a biased `select!` with the signal first would.
    fn unless_fired<F: Future>(&self, work: F) -> UnlessFired<'_, F> {
        UnlessFired {
            signal: self,
            work,
            wait: None,
        }
    }
}

pin_project_lite::pin_project! {
    /// [`Signal::unless_fired`]'s future. A named future rather than an `async fn`: an
    /// `async fn` keeps its argument and the pinned copy of it side by side, so each of
    /// the two nested races doubled the per-delivery state (2 KB where the handling
    /// inside needs a few hundred bytes; above ~1 KB every allocation of it also misses
    /// the allocator's per-thread cache).
    struct UnlessFired<'a, F> {
        signal: &'a Signal,
        #[pin]
        work: F,
        #[pin]
        wait: Option<WaitForCancellationFuture<'a>>,
    }
}

impl<F: Future> Future for UnlessFired<'_, F> {
    type Output = Option<F::Output>;

    fn poll(self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        if this.signal.fired.load(AtomicOrdering::SeqCst) {
            return Poll::Ready(None);
        }
        if let Poll::Ready(out) = this.work.poll(cx) {
            return Poll::Ready(Some(out));
        }
        // `work` waits: be woken by the signal too. (No lost wake-up: the token checks
        // its own state when the waiter registers.)
        if this.wait.is_none() {
            this.wait.set(Some(this.signal.token.cancelled()));
        }
        match this.wait.as_pin_mut().map(|w| w.poll(cx)) {
            Some(Poll::Ready(())) => Poll::Ready(None),
            _ => Poll::Pending,
        }
    }
}

struct SettleBackoff {
    failures: AtomicU32,
    initial: Duration,
    max: Duration,
}

impl SettleBackoff {
    fn delay_for(&self, failures: u32) -> Duration {
        if failures == 0 {
            return Duration::ZERO;
        }
        let exp = (failures - 1).min(20);
        self.initial.saturating_mul(1 << exp).min(self.max)
    }

    /// Record a failure; the delay before the failed delivery should come back.
    fn failed(&self) -> Duration {
        let n = self.failures.fetch_add(1, AtomicOrdering::Relaxed) + 1;
        self.delay_for(n)
    }

    fn succeeded(&self) {
        if self.failures.load(AtomicOrdering::Relaxed) != 0 {
            self.failures.store(0, AtomicOrdering::Relaxed);
        }
    }

    fn current(&self) -> Duration {
        self.delay_for(self.failures.load(AtomicOrdering::Relaxed))
    }
}

/// A delivery and its in-flight permit (none if a backend returned more than asked for).
type Held = (Delivery, Option<OwnedSemaphorePermit>);

/// Most deliveries the receive loop takes from the backend in one call for a per-message
/// handler (bounded by the free in-flight room as well).
const RECEIVE_BATCH: usize = 64;

/// Default [`ConsumerBuilder::batch_size`].
const DEFAULT_BATCH_SIZE: usize = 64;

/// Hands out what one `receive_batch` returned: per delivery ([`dispatch_each`]) or as
/// one batch ([`dispatch_batch`]). The permits cover the deliveries the receive asked for.
type Dispatch<H> = fn(&Arc<Shared<H>>, &Arc<Semaphore>, &mut Vec<Delivery>, OwnedSemaphorePermit);

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
    keyed: Mutex<HashMap<String, VecDeque<Held>>>,
    /// Most deliveries one task handles together ([`dispatch_each`]): about two groups
    /// per runtime worker when `max_in_flight` deliveries are held.
    group_size: usize,
    ordering: Ordering,
    backoff: SettleBackoff,
    tracker: TaskTracker,
    hard_stop: Signal,
    crash: Signal,
}

async fn receive_loop<H: Send + Sync + 'static>(
    shared: Arc<Shared<H>>,
    stop: CancellationToken,
    in_flight: Arc<Semaphore>,
    receive_max: usize,
    dispatch: Dispatch<H>,
) {
    let mut receive_errors: u32 = 0;
    let mut batch = Vec::with_capacity(receive_max);
    // One registration for the whole loop (a fresh `cancelled()` per message costs a
    // lock on the token each time).
    let stopped = stop.cancelled();
    tokio::pin!(stopped);
    loop {
        // After failed settlements, slow down instead of hammering a broken route —
        // until a delivery is handled and acknowledged again, which resets the back-off.
        let pause = shared.backoff.current();
        if !pause.is_zero() {
            Stats::bump(&shared.stats.throttled);
            tokio::select! {
                _ = tokio::time::sleep(pause) => {}
                _ = &mut stopped => break,
            }
        }
        let mut permits = tokio::select! {
            p = in_flight.clone().acquire_owned() => match p { Ok(p) => p, Err(_) => break },
            _ = &mut stopped => break,
        };
        // Whatever else is free now joins the batch; nothing waits for more room.
        let more = in_flight.available_permits().min(receive_max - 1);
        if more > 0
            && let Ok(extra) = in_flight
                .clone()
                .try_acquire_many_owned(u32::try_from(more).unwrap_or(1))
        {
            permits.merge(extra);
        }
        // Cancelled by the stop signal, a receive keeps in `batch` whatever it took from
        // the broker (the `receive_batch` cancel-safety contract); it is released below.
        let received = tokio::select! {
            r = shared.receiver.receive_batch(permits.num_permits(), &mut batch) => r,
            _ = &mut stopped => break,
        };
        dispatch(&shared, &in_flight, &mut batch, permits);
        match received {
            Ok(()) => receive_errors = 0,
            Err(BrokerError::Closed) => {
                tracing::info!(consumer = %shared.name, "receiver closed; consumer stops receiving");
                break;
            }
            Err(e) => {
                receive_errors = receive_errors.saturating_add(1);
                let wait = shared.backoff.delay_for(receive_errors);
                tracing::warn!(consumer = %shared.name, error = %e, retry_in = ?wait, "receive failed");
                tokio::select! {
                    _ = tokio::time::sleep(wait) => {}
                    _ = &mut stopped => break,
                }
            }
        }
    }
    // Taken from the broker by a receive the stop cut short: never handed to a handler,
    // so give them back now rather than leave them leased until their lease runs out.
    // (A crash settles and releases nothing, as when the process dies.)
    if !shared.crash.is_fired() {
        for d in batch.drain(..) {
            shared.release(&d, Duration::ZERO).await;
        }
    }
}

/// Count `n` deliveries as received and held.
fn count_received<H>(shared: &Shared<H>, n: usize) {
    let n = n as u64;
    let stats = &shared.stats;
    stats.received.fetch_add(n, AtomicOrdering::Relaxed);
    shared.metrics.received.increment(n);
    let held = stats.in_flight.fetch_add(n, AtomicOrdering::Relaxed) + n;
    stats.max_in_flight.fetch_max(held, AtomicOrdering::Relaxed);
    shared.metrics.in_flight.increment(n as f64);
}

/// Count `n` deliveries as no longer held (settled or released).
fn count_settled<H>(shared: &Shared<H>, n: usize) {
    shared
        .stats
        .in_flight
        .fetch_sub(n as u64, AtomicOrdering::Relaxed);
    shared.metrics.in_flight.decrement(n as f64);
}

/// Per-message handler: count and dispatch what one `receive_batch` returned, one
/// in-flight permit each; permits the batch did not use go back when `permits` drops.
///
/// Deliveries without a key to serialise on run in groups of up to
/// [`Shared::group_size`]: one task per group drives its deliveries' futures together
/// (each completes, settles and frees its permit on its own). A tokio task per delivery
/// cost more than the rest of a cheap handler's path (spawn, a wake-up of another worker,
/// the runtime's task list locked twice); groups stay small enough to spread a CPU-heavy
/// handler's work over every worker.
fn dispatch_each<F, Fut>(
    shared: &Arc<Shared<F>>,
    in_flight: &Arc<Semaphore>,
    batch: &mut Vec<Delivery>,
    mut permits: OwnedSemaphorePermit,
) where
    F: Fn(Delivery) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), BoxError>> + Send + 'static,
{
    if batch.is_empty() {
        return;
    }
    count_received(shared, batch.len());
    if batch.len() > permits.num_permits() {
        // A backend broke the `receive_batch` contract and returned more than asked:
        // handle the extra deliveries anyway (without a permit) rather than drop them.
        tracing::error!(consumer = %shared.name, "receive_batch returned more deliveries than asked for");
    }
    let mut group = Vec::new();
    for delivery in batch.drain(..) {
        match (shared.ordering, delivery.key()) {
            (Ordering::PerKey, Some(key)) => {
                let key = key.to_owned();
                let permit = take_permits(&mut permits, in_flight, 1);
                dispatch_keyed(shared, key, (delivery, permit));
            }
            _ => {
                group.push(delivery);
                if group.len() == shared.group_size {
                    let room = take_permits(&mut permits, in_flight, group.len());
                    spawn_group(shared, std::mem::take(&mut group), room);
                }
            }
        }
    }
    if !group.is_empty() {
        let room = take_permits(&mut permits, in_flight, group.len());
        spawn_group(shared, group, room);
    }
}

/// `n` of the receive's permits, or as many as are left (none, as an empty permit, when
/// a backend returned more deliveries than asked for).
fn take_permits(
    permits: &mut OwnedSemaphorePermit,
    in_flight: &Arc<Semaphore>,
    n: usize,
) -> Option<OwnedSemaphorePermit> {
    permits
        .split(n.min(permits.num_permits()))
        .or_else(|| in_flight.clone().try_acquire_many_owned(0).ok())
}

/// Run `group`'s deliveries concurrently in one task; `room` holds their in-flight
/// permits. After each pass over the group, the successes of the pass are acknowledged
/// together (one `ack_batch`: one lock for Kafka offsets) and the permits of every
/// delivery settled in it are freed at once (one semaphore lock).
fn spawn_group<F, Fut>(
    shared: &Arc<Shared<F>>,
    group: Vec<Delivery>,
    mut room: Option<OwnedSemaphorePermit>,
) where
    F: Fn(Delivery) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), BoxError>> + Send + 'static,
{
    let shared = shared.clone();
    shared.tracker.clone().spawn(async move {
        // Built here, not by the receive loop: each delivery's task node is allocated
        // and freed on the thread that runs the group, and the receive loop — the
        // serial stage — only hands the deliveries over.
        let mut running: FuturesUnordered<_> = group
            .into_iter()
            .map(|delivery| handle_one(shared.clone(), delivery))
            .collect();
        let mut handled = Vec::new();
        loop {
            let mut settled = 0;
            let finished = std::future::poll_fn(|cx| {
                loop {
                    match running.poll_next_unpin(cx) {
                        Poll::Ready(Some(success)) => {
                            settled += 1;
                            handled.extend(success);
                        }
                        Poll::Ready(None) => return Poll::Ready(true),
                        Poll::Pending if settled > 0 => return Poll::Ready(false),
                        Poll::Pending => return Poll::Pending,
                    }
                }
            })
            .await;
            if !handled.is_empty() {
                ack_handled(&shared, &handled).await;
                handled.clear();
            }
            if let Some(room) = room.as_mut()
                && settled > 0
            {
                drop(room.split(settled.min(room.num_permits())));
            }
            if finished {
                break;
            }
        }
    });
}

/// Per-key ordering: a delivery whose key is being handled queues behind it; otherwise
/// one task handles the key's deliveries in order until its queue is empty.
fn dispatch_keyed<F, Fut>(shared: &Arc<Shared<F>>, key: String, held: Held)
where
    F: Fn(Delivery) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), BoxError>> + Send + 'static,
{
    {
        let mut keyed = shared.keyed.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(queue) = keyed.get_mut(&key) {
            // A delivery of this key is being handled: queue behind it.
            queue.push_back(held);
            return;
        }
        keyed.insert(key.clone(), VecDeque::new());
    }
    let shared = shared.clone();
    shared.tracker.clone().spawn(async move {
        let mut next = Some(held);
        while let Some((delivery, permit)) = next {
            process(shared.clone(), delivery).await;
            drop(permit);
            let mut keyed = shared.keyed.lock().unwrap_or_else(|p| p.into_inner());
            next = keyed.get_mut(&key).and_then(VecDeque::pop_front);
            if next.is_none() {
                keyed.remove(&key);
            }
        }
    });
}

#[derive(Clone)]
enum Outcome {
    Done,
    /// The handler returned [`Duplicate`]: ack, skip, count.
    Duplicate,
    Failed(ErrorClass, String),
}

/// Handle and settle one delivery.
async fn process<F, Fut>(shared: Arc<Shared<F>>, delivery: Delivery)
where
    F: Fn(Delivery) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), BoxError>> + Send + 'static,
{
    if let Some(handled) = handle_one(shared.clone(), delivery).await {
        ack_handled(&shared, std::slice::from_ref(&handled)).await;
    }
}

/// A delivery's id as a span field, read only when the field is formatted: a span is
/// built for every delivery, and reading the id may decode the message
/// ([`crate::RawMessage`]); with `tracing`'s `log` feature and no subscriber, a disabled
/// span still evaluates its fields.
struct IdField<'a>(&'a Delivery);

impl std::fmt::Display for IdField<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self.0.id(), f)
    }
}

/// Handle one delivery and settle it — except a success, which is returned for the caller
/// to acknowledge ([`ack_handled`]), so that a group acknowledges its successes together.
async fn handle_one<F, Fut>(shared: Arc<Shared<F>>, delivery: Delivery) -> Option<Delivery>
where
    F: Fn(Delivery) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), BoxError>> + Send + 'static,
{
    let span = tracing::info_span!(
        "reliq.message",
        consumer = %shared.name,
        message_id = %IdField(&delivery),
        attempt = tracing::field::Empty,
        trace_id = tracing::field::Empty,
        parent_span_id = tracing::field::Empty,
    );
    // Only for a span that records them: reading the headers may decode the message.
    if !span.is_disabled() {
        span.record("attempt", delivery.attempt());
        if let Some(tp) = delivery.traceparent().and_then(TraceParent::parse) {
            span.record("trace_id", tp.trace_id);
            span.record("parent_span_id", tp.parent_id);
        }
    }
    let s = shared;
    let d = delivery;
    async move {
        // Graceful path: handle, then settle; a hard stop (shutdown deadline) releases
        // a delivery whose handler is still running. Settling itself is not cut short.
        let work = async {
            match s.hard_stop.unless_fired(s.handle(&d)).await {
                None => {
                    s.abandon_claim(&d).await;
                    s.release(&d, Duration::ZERO).await;
                    None
                }
                Some(Some(Outcome::Done)) => Some(d.clone()),
                Some(Some(outcome)) => {
                    s.settle(&d, outcome).await;
                    None
                }
                Some(None) => None,
            }
        };
        // A crash stops everything at once, a settlement in progress included: nothing
        // more reaches the broker, as when the process dies.
        match s.crash.unless_fired(work).await {
            // A crash rolls back an uncommitted inbox claim, as a transaction would.
            None => {
                s.abandon_claim(&d).await;
                None
            }
            Some(None) => {
                count_settled(&s, 1);
                None
            }
            Some(handled) => handled,
        }
    }
    .instrument(span)
    .await
}

/// Complete the inbox claims of successfully handled deliveries and acknowledge them
/// together — unless the consumer crashed first (the claims are then rolled back).
async fn ack_handled<F, Fut>(shared: &Shared<F>, handled: &[Delivery])
where
    F: Fn(Delivery) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), BoxError>> + Send + 'static,
{
    match shared.crash.unless_fired(shared.ack_done(handled)).await {
        None => {
            for d in handled {
                shared.abandon_claim(d).await;
            }
        }
        Some(()) => count_settled(shared, handled.len()),
    }
}

/// Batch handler: what one `receive_batch` returned is one batch, holding its permits
/// until every delivery of it is settled.
fn dispatch_batch<F, Fut>(
    shared: &Arc<Shared<F>>,
    _in_flight: &Arc<Semaphore>,
    batch: &mut Vec<Delivery>,
    permits: OwnedSemaphorePermit,
) where
    F: Fn(Batch) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), BatchError>> + Send + 'static,
{
    if batch.is_empty() {
        return;
    }
    count_received(shared, batch.len());
    let deliveries = Arc::new(std::mem::replace(
        batch,
        Vec::with_capacity(batch.capacity()),
    ));
    shared
        .tracker
        .spawn(process_batch(shared.clone(), deliveries, permits));
}

async fn process_batch<F, Fut>(
    shared: Arc<Shared<F>>,
    deliveries: Arc<Vec<Delivery>>,
    _permits: OwnedSemaphorePermit,
) where
    F: Fn(Batch) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), BatchError>> + Send + 'static,
{
    let span = tracing::info_span!(
        "reliq.batch",
        consumer = %shared.name,
        size = deliveries.len(),
        first_id = %IdField(&deliveries[0]),
    );
    async {
        // As for one message: a crash stops everything at once and settles nothing.
        match shared
            .crash
            .unless_fired(shared.handle_batch(&deliveries))
            .await
        {
            None => {
                for d in deliveries.iter() {
                    shared.abandon_claim(d).await;
                }
            }
            Some(()) => count_settled(&shared, deliveries.len()),
        }
    }
    .instrument(span)
    .await;
}

impl<F, Fut> Shared<F>
where
    F: Fn(Delivery) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), BoxError>> + Send + 'static,
{
    /// Run the handler. `None` means the delivery was already settled (duplicate, inbox
    /// failure).
    async fn handle(&self, d: &Delivery) -> Option<Outcome> {
        let _slot = self.concurrency_slot().await;
        if !self.claim(d).await {
            return None;
        }
        let outcome = match self.call((self.handler)(d.clone())).await {
            Ok(Ok(())) => Outcome::Done,
            Ok(Err(e)) => self.failure(e),
            Err(outcome) => outcome,
        };
        if let Outcome::Failed(..) = outcome {
            self.abandon_claim(d).await;
        }
        Some(outcome)
    }
}

impl<F, Fut> Shared<F>
where
    F: Fn(Batch) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), BatchError>> + Send + 'static,
{
    /// Claim (with an inbox), call the batch handler once, settle every delivery.
    async fn handle_batch(&self, deliveries: &Arc<Vec<Delivery>>) {
        let slot = self.hard_stop.unless_fired(self.concurrency_slot()).await;
        let Some(_slot) = slot else {
            for d in deliveries.iter() {
                self.release(d, Duration::ZERO).await;
            }
            return;
        };
        let batch = match &self.inbox {
            None => deliveries.clone(),
            Some(_) => {
                let mut first = Vec::with_capacity(deliveries.len());
                for d in deliveries.iter() {
                    if self.claim(d).await {
                        first.push(d.clone());
                    }
                }
                if first.is_empty() {
                    return;
                }
                Arc::new(first)
            }
        };
        let call = async {
            self.metrics.batch_size.record(batch.len() as f64);
            self.call((self.handler)(Batch::new(batch.clone()))).await
        };
        let Some(result) = self.hard_stop.unless_fired(call).await else {
            for d in batch.iter() {
                self.abandon_claim(d).await;
                self.release(d, Duration::ZERO).await;
            }
            return;
        };
        let failed: Vec<(usize, Outcome)> = match result {
            Ok(Ok(())) => Vec::new(),
            Ok(Err(BatchError(Failed::All(e)))) => {
                let outcome = self.failure(e);
                (0..batch.len()).map(|i| (i, outcome.clone())).collect()
            }
            Err(outcome) => (0..batch.len()).map(|i| (i, outcome.clone())).collect(),
            Ok(Err(BatchError(Failed::Some(list)))) => {
                let mut named = vec![false; batch.len()];
                let mut failed = Vec::with_capacity(list.len());
                for (i, e) in list {
                    match named.get_mut(i) {
                        None => tracing::error!(
                            index = i,
                            size = batch.len(),
                            "the batch handler named a failed delivery outside the batch; ignored"
                        ),
                        // Named twice: the first error counts.
                        Some(true) => {}
                        Some(seen) => {
                            *seen = true;
                            failed.push((i, self.failure(e)));
                        }
                    }
                }
                failed
            }
        };
        if failed.is_empty() {
            return self.ack_done(&batch).await;
        }
        let mut is_failed = vec![false; batch.len()];
        failed.iter().for_each(|(i, _)| is_failed[*i] = true);
        let done: Vec<Delivery> = batch
            .iter()
            .zip(&is_failed)
            .filter(|(_, failed)| !**failed)
            .map(|(d, _)| d.clone())
            .collect();
        self.ack_done(&done).await;
        // The failures settle concurrently: each may wait for a retry or DLQ confirm.
        let batch = &batch;
        futures::future::join_all(failed.into_iter().map(|(i, outcome)| async move {
            let d = &batch[i];
            if let Outcome::Failed(..) = outcome {
                self.abandon_claim(d).await;
            }
            self.settle(d, outcome).await;
        }))
        .await;
    }
}

impl<H> Shared<H> {
    /// Wait for a handler slot, held while the handler runs (`None`: no limit to keep).
    async fn concurrency_slot(&self) -> Option<SemaphorePermit<'_>> {
        // The semaphore is never closed.
        self.concurrency.as_ref()?.acquire().await.ok()
    }

    /// Claim `d` in the runtime's inbox, if there is one. False: already settled (a
    /// duplicate, acknowledged; or the claim failed and the delivery was released).
    async fn claim(&self, d: &Delivery) -> bool {
        let Some(inbox) = &self.inbox else {
            return true;
        };
        match inbox.claim(&self.name, d.id()).await {
            Ok(Claim::First) => true,
            Ok(Claim::Duplicate) => {
                self.skip_duplicate(d).await;
                false
            }
            Err(e) => {
                tracing::warn!(error = %e, "inbox claim failed; releasing the delivery");
                let wait = self.backoff.failed();
                self.release(d, wait).await;
                false
            }
        }
    }

    /// One handler call (per message or per batch): counted as running, bounded by the
    /// handler timeout, a panic caught. `Err` is the failure the call itself became.
    async fn call<T>(&self, call: impl Future<Output = T>) -> Result<T, Outcome> {
        let running = self.stats.running.fetch_add(1, AtomicOrdering::Relaxed) + 1;
        self.stats
            .max_running
            .fetch_max(running, AtomicOrdering::Relaxed);
        let started = Instant::now();
        let result = AssertUnwindSafe(async {
            match self.handler_timeout {
                Some(limit) => tokio::time::timeout(limit, call).await.map_err(|_| {
                    Outcome::Failed(
                        ErrorClass::Transient,
                        format!("handler timed out after {limit:?}"),
                    )
                }),
                None => Ok(call.await),
            }
        })
        .catch_unwind()
        .await;
        self.stats.running.fetch_sub(1, AtomicOrdering::Relaxed);
        self.metrics
            .handler_duration
            .record(started.elapsed().as_secs_f64());
        result.unwrap_or_else(|panic| {
            Stats::bump(&self.stats.panics);
            let text = panic_text(panic.as_ref());
            tracing::error!(panic = %text, "handler panicked");
            Err(Outcome::Failed(ErrorClass::Panic, format!("panic: {text}")))
        })
    }

    /// Complete the inbox claims of handled deliveries and acknowledge them together.
    async fn ack_done(&self, done: &[Delivery]) {
        if done.is_empty() {
            return;
        }
        for d in done {
            self.complete_claim(d).await;
        }
        let failed = self.receiver.ack_batch(done).await;
        let acked = (done.len() - failed.len().min(done.len())) as u64;
        if acked > 0 {
            // Claimed, handled and acknowledged: whatever failed before works again.
            self.backoff.succeeded();
        }
        self.stats
            .processed
            .fetch_add(acked, AtomicOrdering::Relaxed);
        self.metrics.processed.increment(acked);
        for (i, e) in failed {
            let id = done.get(i).map(|d| d.id().to_string()).unwrap_or_default();
            self.ack_failed(&e, &id);
        }
    }

    /// What a handler error means: a [`Duplicate`] marker anywhere in its chain, or a
    /// failure of the class the classifier gives it.
    fn failure(&self, e: BoxError) -> Outcome {
        if Duplicate::is_in(e.as_ref()) {
            Outcome::Duplicate
        } else {
            Outcome::Failed(self.classifier.classify(e.as_ref()), chain_text(e.as_ref()))
        }
    }

    /// Acknowledge a delivery whose effect already happened, and count it.
    async fn skip_duplicate(&self, d: &Delivery) {
        Stats::bump(&self.stats.duplicates);
        self.metrics.duplicates.increment(1);
        tracing::debug!("duplicate: already handled, acknowledging");
        self.ack(d).await;
    }

    /// Record this delivery's effect as done in the runtime's inbox, if there is one.
    async fn complete_claim(&self, d: &Delivery) {
        if let Some(inbox) = &self.inbox
            && let Err(e) = inbox.complete(&self.name, d.id()).await
        {
            tracing::warn!(error = %e, id = %d.id(), "inbox complete failed");
        }
    }

    /// Forget this delivery's inbox claim: its effect did not happen.
    async fn abandon_claim(&self, d: &Delivery) {
        if let Some(inbox) = &self.inbox
            && let Err(e) = inbox.abandon(&self.name, d.id()).await
        {
            tracing::warn!(error = %e, "inbox abandon failed");
        }
    }

    async fn settle(&self, d: &Delivery, outcome: Outcome) {
        let (class, text) = match outcome {
            // The one success path: the same as a group's or a batch's successes.
            Outcome::Done => return self.ack_done(std::slice::from_ref(d)).await,
            Outcome::Duplicate => {
                // A duplicate's effect exists too (an earlier delivery made it).
                self.complete_claim(d).await;
                self.skip_duplicate(d).await;
                return;
            }
            Outcome::Failed(class, text) => (class, text),
        };
        // Boxed: the failure path's state (copies, headers, the dead-letter record) would
        // otherwise make every message's task as large as a failing one's.
        Box::pin(self.settle_failure(d, class, text)).await;
    }

    /// Retry, dead-letter or discard a failed delivery, as the policy decides.
    async fn settle_failure(&self, d: &Delivery, class: ErrorClass, text: String) {
        let now = self.clock.now();
        // Brokers that retry in place (no copy, so no failure headers) report when the
        // message was published; that bounds the first failure from below.
        let first_failure = d
            .headers()
            .get(headers::FIRST_FAILURE_AT)
            .and_then(|v| headers::parse_time(v).ok())
            .or_else(|| (d.attempt() > 1).then(|| d.published_at()).flatten())
            .unwrap_or(now);
        let origin_time = d
            .headers()
            .get(headers::OCCURRED_AT)
            .and_then(|v| headers::parse_time(v).ok())
            .unwrap_or(first_failure);
        let failure = Failure {
            class,
            attempt: d.attempt(),
            age: now.duration_since(origin_time).unwrap_or_default(),
        };
        match self.policy.decide(&failure, fastrand::f64()) {
            Decision::Retry {
                delay,
                tier,
                next_attempt,
            } => {
                let mut copy = d.message().clone();
                let h = copy.headers_mut();
                h.insert(headers::ATTEMPT, next_attempt.to_string());
                h.insert(
                    headers::FIRST_FAILURE_AT,
                    headers::format_time(first_failure),
                );
                h.insert(headers::LAST_FAILURE_AT, headers::format_time(now));
                h.insert(headers::LAST_ERROR, headers::sanitize_error(&text));
                h.insert(headers::ERROR_CLASS, class.as_str());
                tracing::info!(class = %class, error = %text, ?delay, next_attempt, "retrying");
                let request = RetryRequest {
                    message: copy,
                    delay,
                    tier,
                };
                match self.receiver.retry(d, request).await {
                    Ok(()) => {
                        self.backoff.succeeded();
                        Stats::bump(&self.stats.retried);
                        self.metrics.retried(class).increment(1);
                    }
                    Err(e) => self.settle_failed(d, SettleOp::Retry, &e).await,
                }
            }
            Decision::DeadLetter(reason) => {
                let record = DeadLetter {
                    reason,
                    error_class: Some(class),
                    error: Some(text.clone()),
                    attempts: d.attempt(),
                    first_failure_at: Some(first_failure),
                    dead_lettered_at: now,
                    consumer: self.name.to_string(),
                    origin: d.origin().clone(),
                };
                let mut copy = d.message().clone();
                record.write(copy.headers_mut());
                tracing::warn!(%reason, class = %class, error = %text, "dead-lettering");
                match self.receiver.dead_letter(d, copy).await {
                    Ok(()) => {
                        self.backoff.succeeded();
                        Stats::bump(&self.stats.dead_lettered);
                        self.metrics.dead_lettered(reason).increment(1);
                    }
                    Err(e) => self.settle_failed(d, SettleOp::DeadLetter, &e).await,
                }
            }
            Decision::Discard(reason) => {
                tracing::warn!(%reason, class = %class, error = %text, "discarding (final route = discard)");
                if self.ack(d).await {
                    Stats::bump(&self.stats.discarded);
                    self.metrics.discarded(reason).increment(1);
                }
            }
        }
    }

    async fn ack(&self, d: &Delivery) -> bool {
        match self.receiver.ack(d).await {
            Ok(()) => true,
            Err(e) => {
                self.ack_failed(&e, d.id().as_str());
                false
            }
        }
    }

    fn ack_failed(&self, e: &BrokerError, id: &str) {
        // The effect is done; the broker will redeliver and the inbox absorbs it.
        Stats::bump(&self.stats.settle_failures);
        self.metrics.settle_failures[SettleOp::Ack as usize].increment(1);
        tracing::warn!(error = %e, id, "ack failed; the message may be delivered again");
    }

    async fn settle_failed(&self, d: &Delivery, op: SettleOp, e: &BrokerError) {
        Stats::bump(&self.stats.settle_failures);
        self.metrics.settle_failures[op as usize].increment(1);
        if let BrokerError::ForeignDelivery = e {
            // Not a broker failure: nothing to back off from, and releasing on this
            // receiver would be refused the same way. The owner's lease returns it.
            tracing::error!(operation = op.as_str(), id = %d.id(), "a delivery of another receiver reached this consumer; left to its owner");
            return;
        }
        let wait = self.backoff.failed();
        tracing::error!(operation = op.as_str(), error = %e, release_delay = ?wait,
            "settlement failed; the source message is released, not acknowledged");
        self.release(d, wait).await;
    }

    async fn release(&self, d: &Delivery, delay: Duration) {
        match self.receiver.release(d, delay).await {
            Ok(()) => Stats::bump(&self.stats.released),
            Err(e) => {
                Stats::bump(&self.stats.settle_failures);
                self.metrics.settle_failures[SettleOp::Release as usize].increment(1);
                tracing::warn!(error = %e, "release failed; the broker redelivers after the lease");
            }
        }
    }
}

/// The error and its sources, `outer: inner: innermost`.
fn chain_text(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut link = e.source();
    while let Some(inner) = link {
        let s = inner.to_string();
        if !text.contains(&s) {
            text.push_str(": ");
            text.push_str(&s);
        }
        link = inner.source();
    }
    text
}

fn panic_text(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-text panic payload".to_owned()
    }
}

/// The dead-letter reason reliq uses for a broker's own delivery-limit move, exposed for
/// backends that translate native metadata (e.g. `x-death reason=delivery_limit`).
pub const BROKER_LIMIT_REASON: DeadLetterReason = DeadLetterReason::MaxDeliveries;
