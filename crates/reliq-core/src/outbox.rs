//! The transactional outbox: the relay, written once for every store.
//!
//! A producer that changes its database *and* publishes an event cannot make both happen
//! atomically (the dual-write problem). With an outbox it writes the event as a row in the
//! **same transaction** as the business change (`enqueue` of reliq-postgres /
//! reliq-sqlite), with the message's stable id. A [`Relay`] then claims unsent rows,
//! publishes them through any [`Broker`] (whose `publish` returns only after the broker
//! confirmed), and marks them sent.
//!
//! Guarantees:
//! - **Nothing is lost**: a row is marked sent only after the broker confirmed it; a failed
//!   publish keeps the row (released for the next attempt, after a back-off).
//! - **At-least-once, same id**: a crash between the confirm and the mark publishes the row
//!   again, with the same message id, once its lease expired. Consumers absorb the copy
//!   with an inbox.
//! - **Several relays may run at once**: a claim leases rows to one relay
//!   ([`OutboxStore::claim_batch`]); while the lease holds no other relay claims them, and
//!   a relay stops publishing a batch before its lease ends (leaving a safety margin of a
//!   tenth of the lease), so a row is not published twice while its lease holds.
//! - **Order**: one relay publishes in enqueue order (the store's sequence), one message
//!   at a time, and stops at the first failure, so a later row never overtakes an earlier
//!   one. A row that can never be published (say, an unroutable destination) therefore
//!   holds back the rows behind it until an operator fixes the destination or deletes
//!   the row; its `attempts` and `last_error` columns say why. With several relays,
//!   batches run in parallel and order between batches is not kept.
//!
//! The store supplies the SQL ([`OutboxStore`]); the relay loop, back-off, lease guard,
//! counters and metrics are here.
//!
//! ```
//! # async fn demo(store: std::sync::Arc<dyn reliq_core::outbox::OutboxStore>,
//! #               broker: std::sync::Arc<dyn reliq_core::Broker>) -> Result<(), Box<dyn std::error::Error>> {
//! use std::time::Duration;
//! use reliq_core::outbox::Relay;
//!
//! let relay = Relay::builder(store, broker)
//!     .name("orders")                       // the `relay` metric label
//!     .batch_size(100)
//!     .lease(Duration::from_secs(30))
//!     .build()?
//!     .start();
//! // … on shutdown: finishes the batch in progress, then stops.
//! let stats = relay.shutdown().await;
//! # let _ = stats; Ok(()) }
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering as AtomicOrdering};
use std::time::Duration;

use async_trait::async_trait;
use backon::{BackoffBuilder, ExponentialBackoff, ExponentialBuilder};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::broker::{Broker, Destination};
use crate::classify::BoxError;
use crate::message::{Headers, Message};
use crate::telemetry::RelayMetrics;

/// One unsent outbox row, as the store hands it to the relay.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutboxRecord {
    /// The store's sequence number: the enqueue order, and the row's handle for
    /// [`OutboxStore::mark_sent`] / [`OutboxStore::release`].
    pub seq: i64,
    /// Where to publish.
    pub destination: Destination,
    /// What to publish (its id is the stable id given at enqueue).
    pub message: Message,
}

/// An outbox row's columns as the SQL stores read them: `(seq, message_id, topic, route,
/// message_key, payload, headers)`, the headers as written by [`encode_headers`].
pub type OutboxColumns = (
    i64,
    String,
    String,
    Option<String>,
    Option<String>,
    Vec<u8>,
    String,
);

impl OutboxRecord {
    /// Build a record from a row's columns; headers that do not decode are an error
    /// naming the row.
    pub fn from_columns(
        (seq, id, topic, route, key, payload, headers): OutboxColumns,
    ) -> Result<Self, OutboxError> {
        let headers = decode_headers(&headers)
            .map_err(|e| OutboxError(format!("outbox row {seq}: bad headers: {e}").into()))?;
        Ok(Self {
            seq,
            destination: Destination { topic, route },
            message: Message::from_parts(id.into(), key, payload.into(), headers),
        })
    }
}

/// The outbox store failed (the database is unreachable, a row cannot be decoded, …).
#[derive(Debug, thiserror::Error)]
#[error("outbox store error: {0}")]
pub struct OutboxError(#[from] pub BoxError);

/// The SQL side of an outbox: how a relay claims, marks and releases rows. Implemented
/// by reliq-postgres (`FOR UPDATE SKIP LOCKED` + lease columns) and reliq-sqlite (lease
/// columns).
#[async_trait]
pub trait OutboxStore: Send + Sync + 'static {
    /// Lease up to `limit` unsent rows whose lease is free (never leased, released, or
    /// expired) to `owner` for `lease`, oldest first, and return them. Two concurrent
    /// calls never return the same row while its lease holds.
    async fn claim_batch(
        &self,
        owner: &str,
        limit: usize,
        lease: Duration,
    ) -> Result<Vec<OutboxRecord>, OutboxError>;

    /// The broker confirmed these rows: mark them sent (whoever holds their lease now).
    async fn mark_sent(&self, owner: &str, seqs: &[i64]) -> Result<(), OutboxError>;

    /// These rows were not published: free their lease (only where `owner` still holds
    /// it) and record `error` as their last error.
    async fn release(&self, owner: &str, seqs: &[i64], error: &str) -> Result<(), OutboxError>;

    /// Something that wakes an idle relay when rows may have been added (Postgres:
    /// `LISTEN`). Called once when the relay starts, before its first claim, so no
    /// notification is missed. The default only waits for the poll interval.
    async fn listen(&self) -> Result<Box<dyn OutboxWakeup>, OutboxError> {
        Ok(Box::new(PollOnly))
    }

    /// The poll interval a relay uses unless told otherwise: short for stores that cannot
    /// notify, a fallback for those that can.
    fn default_poll_interval(&self) -> Duration {
        Duration::from_millis(200)
    }
}

/// Wakes an idle relay. See [`OutboxStore::listen`].
#[async_trait]
pub trait OutboxWakeup: Send {
    /// Return when rows may have been added, or after `timeout` at the latest. Spurious
    /// wake-ups are fine (the relay claims, finds nothing and waits again).
    async fn wait(&mut self, timeout: Duration);
}

/// A wake-up that only polls.
#[derive(Clone, Copy, Debug, Default)]
pub struct PollOnly;

#[async_trait]
impl OutboxWakeup for PollOnly {
    async fn wait(&mut self, timeout: Duration) {
        tokio::time::sleep(timeout).await;
    }
}

/// Encode headers for an outbox row: a JSON array of `[name, value]` pairs (order kept).
pub fn encode_headers(headers: &Headers) -> String {
    let pairs: Vec<(&str, &str)> = headers.iter().collect();
    // Serialising pairs of strings cannot fail.
    serde_json::to_string(&pairs).unwrap_or_else(|_| "[]".to_owned())
}

/// Decode headers written by [`encode_headers`].
pub fn decode_headers(text: &str) -> Result<Headers, serde_json::Error> {
    let pairs: Vec<(String, String)> = serde_json::from_str(text)?;
    Ok(pairs.into_iter().collect())
}

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
    /// released; its rows are published again after their lease. For crash tests.
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
        tracing::warn!(relay = %self.owner, error = %crate::ErrorChain(e), "outbox store: {what} failed");
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
        while !stop.is_cancelled() {
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

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::sync::Mutex;

    use super::*;
    use crate::broker::{BrokerError, Capabilities, Receiver, Subscription};
    use crate::message::MessageId;

    /// An in-memory store with the same lease rules as the SQL ones.
    #[derive(Default)]
    struct TestStore {
        rows: Mutex<BTreeMap<i64, Row>>,
    }

    struct Row {
        record: OutboxRecord,
        sent: bool,
        lease: Option<(String, Instant)>,
        last_error: Option<String>,
    }

    impl TestStore {
        fn add(&self, seq: i64, topic: &str, id: &str) {
            let record = OutboxRecord {
                seq,
                destination: Destination::new(topic),
                message: Message::with_id_and_payload(id, "x"),
            };
            self.rows.lock().unwrap().insert(
                seq,
                Row {
                    record,
                    sent: false,
                    lease: None,
                    last_error: None,
                },
            );
        }
        fn unsent(&self) -> Vec<i64> {
            let rows = self.rows.lock().unwrap();
            rows.iter()
                .filter(|(_, r)| !r.sent)
                .map(|(s, _)| *s)
                .collect()
        }
        fn last_error(&self, seq: i64) -> Option<String> {
            self.rows.lock().unwrap()[&seq].last_error.clone()
        }
    }

    #[async_trait]
    impl OutboxStore for TestStore {
        async fn claim_batch(
            &self,
            owner: &str,
            limit: usize,
            lease: Duration,
        ) -> Result<Vec<OutboxRecord>, OutboxError> {
            let now = Instant::now();
            let mut rows = self.rows.lock().unwrap();
            let mut out = Vec::new();
            for row in rows.values_mut() {
                let free = row.lease.as_ref().is_none_or(|(_, until)| *until <= now);
                if !row.sent && free && out.len() < limit {
                    row.lease = Some((owner.to_owned(), now + lease));
                    out.push(row.record.clone());
                }
            }
            Ok(out)
        }
        async fn mark_sent(&self, _owner: &str, seqs: &[i64]) -> Result<(), OutboxError> {
            let mut rows = self.rows.lock().unwrap();
            for s in seqs {
                if let Some(r) = rows.get_mut(s) {
                    r.sent = true;
                    r.lease = None;
                }
            }
            Ok(())
        }
        async fn release(&self, owner: &str, seqs: &[i64], error: &str) -> Result<(), OutboxError> {
            let mut rows = self.rows.lock().unwrap();
            for s in seqs {
                if let Some(r) = rows.get_mut(s)
                    && r.lease.as_ref().is_some_and(|(o, _)| o == owner)
                {
                    r.lease = None;
                    r.last_error = Some(error.to_owned());
                }
            }
            Ok(())
        }
    }

    /// Records what it confirmed; refuses topics it does not know.
    #[derive(Default)]
    struct TestBroker {
        topics: Mutex<Vec<String>>,
        published: Mutex<Vec<MessageId>>,
    }

    #[async_trait]
    impl Broker for TestBroker {
        fn kind(&self) -> &'static str {
            "test"
        }
        fn capabilities(&self) -> Capabilities {
            Capabilities::default()
        }
        async fn publish(&self, d: &Destination, m: Message) -> Result<(), BrokerError> {
            if !self.topics.lock().unwrap().contains(&d.topic) {
                return Err(BrokerError::Unroutable(d.topic.clone()));
            }
            self.published.lock().unwrap().push(m.id().clone());
            Ok(())
        }
        async fn subscribe(&self, _: &Subscription) -> Result<Box<dyn Receiver>, BrokerError> {
            Err(BrokerError::Unsupported {
                backend: "test",
                what: "subscribe",
            })
        }
        async fn dead_letters(
            &self,
            _: &Subscription,
        ) -> Result<Box<dyn crate::DeadLetters>, BrokerError> {
            Err(BrokerError::Unsupported {
                backend: "test",
                what: "dead_letters",
            })
        }
    }

    fn ids(b: &TestBroker) -> Vec<String> {
        let p = b.published.lock().unwrap();
        p.iter().map(|i| i.as_str().to_owned()).collect()
    }

    #[tokio::test(start_paused = true)]
    async fn publishes_in_order_and_stops_at_the_first_failure() {
        let store = Arc::new(TestStore::default());
        let broker = Arc::new(TestBroker::default());
        broker.topics.lock().unwrap().push("good".into());
        store.add(1, "good", "a");
        store.add(2, "good", "b");
        store.add(3, "missing", "c");
        store.add(4, "good", "d");
        let relay = Relay::builder(store.clone(), broker.clone())
            .batch_size(10)
            .build()
            .unwrap();
        let err = relay.run_once().await.unwrap_err();
        assert!(matches!(err, RelayError::Publish { seq: 3, .. }), "{err}");
        assert_eq!(ids(&broker), ["a", "b"]);
        // The failed row and the one behind it are kept, released, with the error.
        assert_eq!(store.unsent(), [3, 4]);
        assert!(store.last_error(3).unwrap().contains("unroutable"));
        let s = relay.stats();
        assert_eq!((s.published, s.publish_failures, s.batches), (2, 1, 1));

        // Repair the route: the next round publishes the rest, in order.
        broker.topics.lock().unwrap().push("missing".into());
        assert_eq!(relay.run_once().await.unwrap(), 2);
        assert_eq!(ids(&broker), ["a", "b", "c", "d"]);
        assert!(store.unsent().is_empty());
        assert_eq!(relay.run_once().await.unwrap(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_running_relay_backs_off_on_failure_and_catches_up() {
        let store = Arc::new(TestStore::default());
        let broker = Arc::new(TestBroker::default());
        store.add(1, "t", "a");
        let handle = Relay::builder(store.clone(), broker.clone())
            .backoff(Duration::from_secs(1), Duration::from_secs(4))
            .poll_interval(Duration::from_millis(50))
            .build()
            .unwrap()
            .start();
        tokio::time::sleep(Duration::from_secs(20)).await;
        // Backing off 1 s, 2 s, 4 s, 4 s … (plus jitter below the delay): a handful of
        // tries in 20 s, not a hot loop.
        let failures = handle.stats().publish_failures;
        assert!((3..=12).contains(&failures), "{failures} failures");
        assert_eq!(store.unsent(), [1]);
        broker.topics.lock().unwrap().push("t".into());
        store.add(2, "t", "b");
        tokio::time::sleep(Duration::from_secs(10)).await;
        let stats = handle.shutdown().await;
        assert_eq!(ids(&broker), ["a", "b"]);
        assert_eq!(stats.published, 2);
        assert!(store.unsent().is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn two_relays_never_share_a_leased_row() {
        let store = Arc::new(TestStore::default());
        let broker = Arc::new(TestBroker::default());
        broker.topics.lock().unwrap().push("t".into());
        for i in 0..50 {
            store.add(i, "t", &format!("m{i}"));
        }
        let a = Relay::builder(store.clone(), broker.clone())
            .batch_size(7)
            .build()
            .unwrap();
        let b = Relay::builder(store.clone(), broker.clone())
            .batch_size(7)
            .build()
            .unwrap();
        // Claim with both before either marks: their batches are disjoint.
        let ca = store
            .claim_batch(a.owner(), 7, Duration::from_secs(30))
            .await
            .unwrap();
        let cb = store
            .claim_batch(b.owner(), 7, Duration::from_secs(30))
            .await
            .unwrap();
        assert!(ca.iter().all(|r| cb.iter().all(|s| s.seq != r.seq)));
        let (ha, hb) = (a.start(), b.start());
        tokio::time::sleep(Duration::from_secs(60)).await;
        let (sa, sb) = (ha.shutdown().await, hb.shutdown().await);
        let mut published = ids(&broker);
        assert_eq!(sa.published + sb.published, published.len() as u64);
        published.sort();
        published.dedup();
        // The 14 rows claimed by hand were never marked: they came back after their lease
        // and were published once, like every other row.
        assert_eq!(published.len(), 50);
        assert_eq!(ids(&broker).len(), 50);
    }

    #[test]
    fn records_build_from_columns() {
        let cols = |h: &str| {
            (
                7,
                "id-7".to_owned(),
                "t".to_owned(),
                Some("r".to_owned()),
                Some("k".to_owned()),
                b"p".to_vec(),
                h.to_owned(),
            )
        };
        let r = OutboxRecord::from_columns(cols(r#"[["a","1"]]"#)).unwrap();
        assert_eq!(r.seq, 7);
        assert_eq!(r.destination, Destination::new("t").with_route("r"));
        assert_eq!(r.message.id().as_str(), "id-7");
        assert_eq!(r.message.key(), Some("k"));
        assert_eq!(r.message.headers().get("a"), Some("1"));
        let err = OutboxRecord::from_columns(cols("nope")).unwrap_err();
        assert!(err.to_string().contains("outbox row 7"), "{err}");
    }

    #[test]
    fn headers_round_trip_in_order() {
        let h: Headers = [("b", "2"), ("a", "1 \"quoted\"")].into_iter().collect();
        let back = decode_headers(&encode_headers(&h)).unwrap();
        assert_eq!(back, h);
        assert!(decode_headers("{").is_err());
    }

    #[test]
    fn bad_settings_name_the_field() {
        let store: Arc<dyn OutboxStore> = Arc::new(TestStore::default());
        let broker: Arc<dyn Broker> = Arc::new(TestBroker::default());
        let field = |b: RelayBuilder| b.build().err().map(|e| e.field);
        let b = || Relay::builder(store.clone(), broker.clone());
        assert_eq!(field(b().batch_size(0)), Some("batch_size"));
        assert_eq!(field(b().lease(Duration::ZERO)), Some("lease"));
        assert_eq!(field(b().name(" ")), Some("name"));
        assert_eq!(
            field(b().poll_interval(Duration::ZERO)),
            Some("poll_interval")
        );
        assert_eq!(
            field(b().backoff(Duration::from_secs(2), Duration::from_secs(1))),
            Some("backoff")
        );
        assert_eq!(field(b()), None);
    }
}
