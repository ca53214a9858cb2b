//! The receiving side: one poll thread per Kafka consumer (the source's group, one relay
//! per retry tier), all feeding one stream of deliveries, with
//! per-partition offset tracking, pause-based flow control and the crash-loop counter.
//!
//! - `poll`: the poll thread and its passes, and its periodic service (commits, due
//!   relay records, pauses);
//! - `flow`: the bound of the buffer ahead of the runtime, and flow control;
//! - `rebalance`: assignments and revocations;
//! - `counter`: the crash-loop counter (delivery limit);
//! - `consumer`: a poll thread's consumer, kept alive by the records it handed out;
//! - `receive`: the runtime's end of the stream;
//! - `settle`: ack, retry, dead-letter, release;
//! - `token`: which record a delivery is.

mod consumer;
mod counter;
mod flow;
mod poll;
mod rebalance;
mod receive;
mod settle;
mod token;

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use rdkafka::consumer::{BaseConsumer, Consumer};
use reliq_core::{
    BrokerError, Delivery, Message, Receiver, ReceiverId, RetryRequest, Subscription,
};
use tokio::sync::mpsc;

use self::consumer::{ClientConsumer, ConsumerHandle};
use self::rebalance::Ctx;
use self::token::{GENERATION_MASK, MAX_CLIENTS, TokenInfo};
use crate::broker::Inner;
use crate::error::KafkaError;
use crate::fetch::Fetched;
use crate::lock;
use crate::names::relay_group;
use crate::options::RetryMode;
use crate::relay::stale_tiers;
use crate::tracker::OffsetTracker;

pub(crate) use self::poll::POLL_BATCH;

/// How long `subscribe` waits for the source consumer's first partition assignment.
const ASSIGN_WAIT: Duration = Duration::from_secs(10);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    Source,
    Relay(Duration),
}

struct Client {
    topic: String,
    /// Where this client's records come from, as deliveries report it: the topic itself,
    /// or for a relay the source topic. Shared, not copied per record.
    origin: Arc<str>,
    group: String,
    role: Role,
}

/// A record as librdkafka handed it out, not decoded yet. The poll thread — the serial
/// stage of the receive path — only tracks its offset; the receive loop makes it a
/// delivery whose message is decoded when first read
/// ([`LazyRecord`](crate::fetch::LazyRecord)), on whichever thread reads it.
///
/// The message refers to its consumer's internals ([`Fetched`]); `owner` keeps that
/// consumer alive as long as the record (see [`ConsumerHandle`]).
struct Polled {
    message: Fetched,
    info: TokenInfo,
    owner: Arc<ConsumerHandle>,
}

/// What the poll threads hand to the receive loop.
enum Record {
    /// Decoded on the poll thread: relay and blocking-mode records, a partition's first
    /// record (crash-loop counter), records handed out again after a release. Boxed:
    /// the rare case, and chunks of small records are cheaper to allocate and move.
    Ready(Box<Delivery>),
    /// The fast path: decoded by the receive loop.
    Polled(Polled),
}

impl Record {
    fn info(&self) -> Option<TokenInfo> {
        match self {
            Record::Ready(d) => TokenInfo::of(d),
            Record::Polled(p) => Some(p.info),
        }
    }
}

struct Held {
    due: SystemTime,
    offset: i64,
    delivery: Delivery,
}

struct Part {
    generation: u64,
    tracker: OffsetTracker,
    /// Handed to the runtime and not yet settled or released.
    busy: usize,
    revoking: bool,
    paused: bool,
    /// Relay records waiting for their due time (head first); in blocking mode, the
    /// failed record waiting for its retry.
    held: VecDeque<Held>,
    /// Payload bytes in `held`.
    held_bytes: usize,
    /// Blocking mode: a record of this partition is with the runtime (or held for its
    /// retry); later records wait in `waiting`.
    out: bool,
    /// Blocking mode: records read behind the one that is out, in offset order.
    waiting: VecDeque<(i64, Delivery)>,
    /// Blocking mode: a retry was requested; the poll thread drops `waiting` and seeks
    /// back to its first offset.
    rewind: bool,
    /// The committed position when the partition was assigned.
    head: Option<i64>,
    /// The counter found in the commit metadata: (offset, deliveries).
    head_count: Option<(i64, u32)>,
    counted: bool,
}

impl Part {
    fn new(generation: u64, head: Option<i64>, head_count: Option<(i64, u32)>) -> Self {
        Self {
            generation: generation & GENERATION_MASK,
            tracker: OffsetTracker::new(),
            busy: 0,
            revoking: false,
            paused: false,
            held: VecDeque::new(),
            held_bytes: 0,
            out: false,
            waiting: VecDeque::new(),
            rewind: false,
            head,
            head_count,
            counted: false,
        }
    }
}

/// Most records a relay partition holds ahead of their due time, and
/// [`RELAY_HOLD_BYTES`] the most payload: a relay reads on past a head that is not due
/// yet rather than pausing at it. At the bound the relay's poll thread stops taking
/// records (they wait in librdkafka's bounded fetch queue) until every partition is down
/// to half; only if that lasts (see `RelayHold`) are the partitions at the bound paused.
/// A pause discards the records librdkafka has fetched, and after a resume librdkafka
/// fetched nothing for ~0.7 s (measured: 20,000 retries on a 200 ms tier lost 0.6–0.7 s
/// per round to it, in most rounds); with a pause per held head each record behind it
/// came back late by that refetch (p99 0.85 s on a 2 s tier).
pub(super) const RELAY_HOLD: usize = 1024;
/// See [`RELAY_HOLD`].
pub(super) const RELAY_HOLD_BYTES: usize = 16 << 20;

impl Part {
    /// Hold a record until `h.due`.
    fn hold(&mut self, h: Held) {
        self.held_bytes += h.delivery.payload().len();
        self.held.push_back(h);
    }

    /// The head held record if it is due at `now`.
    fn take_due(&mut self, now: SystemTime) -> Option<Held> {
        if self.held.front()?.due > now {
            return None;
        }
        let h = self.held.pop_front()?;
        self.held_bytes = self.held_bytes.saturating_sub(h.delivery.payload().len());
        Some(h)
    }

    /// A relay partition's fetch should be paused for what it holds (see [`RELAY_HOLD`]):
    /// at the bound, and until it is down to half.
    fn relay_full(&self) -> bool {
        self.over_hold(self.paused)
    }

    /// What the partition holds is at [`RELAY_HOLD`] / [`RELAY_HOLD_BYTES`]; with
    /// `already` (over it before), above half of them.
    fn over_hold(&self, already: bool) -> bool {
        let (records, bytes) = if already {
            (RELAY_HOLD / 2 + 1, RELAY_HOLD_BYTES / 2 + 1)
        } else {
            (RELAY_HOLD, RELAY_HOLD_BYTES)
        };
        self.held.len() >= records || self.held_bytes >= bytes
    }
}

#[derive(Default)]
struct State {
    /// Per (client, partition). A fast hasher: the poll thread and the settlements look a
    /// partition up for every record, and the keys are not attacker-chosen.
    parts: HashMap<(usize, i32), Part, foldhash::fast::RandomState>,
    /// Deliveries pushed to the stream and not yet taken by the runtime: the buffer
    /// ahead of the runtime, bounded by flow control.
    queued: usize,
    next_generation: u64,
    /// A poll thread waits on [`Shared::room`] for the buffer to drain.
    room_wanted: bool,
}

struct Shared {
    /// Stamped on every delivery's token; settling checks it.
    owner: ReceiverId,
    inner: Arc<Inner>,
    sub: Subscription,
    clients: Vec<Client>,
    state: Mutex<State>,
    /// Signalled when the runtime takes records from a full buffer.
    room: Condvar,
    /// Counts assignments and revocations (see [`Pass`](poll::Pass)).
    rebalances: AtomicU64,
    /// To the runtime, in chunks: all a poll pass handed out, one send (and at most one
    /// wake-up) per pass.
    tx: mpsc::UnboundedSender<Vec<Record>>,
    /// The runtime's end of `tx`. Here rather than in the receiver: a poll thread locks
    /// it to purge its undecoded records before it drops its consumer ([`Polled`]).
    inbound: tokio::sync::Mutex<Inbound>,
    stop: AtomicBool,
    crashed: AtomicBool,
    runtime: tokio::runtime::Handle,
}

/// The runtime's end of the stream: chunks from the poll threads, and what is left of
/// the chunks last taken from.
struct Inbound {
    rx: mpsc::UnboundedReceiver<Vec<Record>>,
    ready: VecDeque<Record>,
    /// The records one receive keeps, between the state lock and decoding (reused).
    kept: Vec<Record>,
}

/// A [`Receiver`] over one or more Kafka consumers.
pub(crate) struct KafkaReceiver {
    shared: Arc<Shared>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl KafkaReceiver {
    /// Declare the topology and start the source consumer and one relay per tier.
    pub(crate) async fn subscribe(
        inner: Arc<Inner>,
        sub: &Subscription,
    ) -> Result<Self, BrokerError> {
        if sub.filter.as_deref().is_some_and(|f| f != "#") {
            return Err(BrokerError::Unsupported {
                backend: "kafka",
                what: "subscription filters (Kafka has no routing keys; use one topic per route)",
            });
        }
        let mut clients = vec![Client {
            topic: sub.source.clone(),
            origin: sub.source.as_str().into(),
            group: sub.consumer.clone(),
            role: Role::Source,
        }];
        let relays = match inner.config.retry_mode {
            RetryMode::Topics => sub.retry_tiers.as_slice(),
            RetryMode::Blocking => &[],
        };
        for delay in relays {
            let topic = sub.retry_name(*delay);
            if clients.iter().any(|c| c.topic == topic) {
                continue;
            }
            clients.push(Client {
                origin: sub.source.as_str().into(),
                group: relay_group(sub, *delay),
                topic,
                role: Role::Relay(*delay),
            });
        }
        if inner.config.retry_mode == RetryMode::Topics {
            let current: Vec<String> = clients.iter().map(|c| c.topic.clone()).collect();
            for stale in stale_tiers(&inner, sub, &current).await? {
                tracing::info!(consumer = %sub.consumer, topic = %stale.topic, lag = stale.lag,
                    "a retry tier the policy no longer has still holds records; draining it");
                clients.push(Client {
                    origin: sub.source.as_str().into(),
                    group: relay_group(sub, stale.delay),
                    topic: stale.topic,
                    role: Role::Relay(stale.delay),
                });
            }
        }
        if clients.len() > MAX_CLIENTS {
            return Err(BrokerError::Config {
                field: "retry.tiers".into(),
                reason: format!(
                    "{} retry tiers; the Kafka backend runs one relay per tier, at most {}",
                    clients.len() - 1,
                    MAX_CLIENTS - 1
                ),
            });
        }
        let mut topics: Vec<String> = clients.iter().map(|c| c.topic.clone()).collect();
        inner.ensure_topics(&topics).await?;
        let dlq = sub.dead_letter_name();
        inner.ensure_dead_letter_topics(&dlq).await?;
        topics.push(dlq);
        inner.wait_visible(&topics).await?;
        let receiver = Self::start(inner, sub, clients).await?;
        receiver.wait_assigned().await;
        Ok(receiver)
    }

    /// Wait (bounded) until the source consumer has joined its group and holds
    /// partitions, so `subscribe` returns a member that is ready to receive: a second
    /// member subscribed right after the first really shares the work. Gives up
    /// quietly after [`ASSIGN_WAIT`] (a group whose partitions all belong to other
    /// members is legitimate); receiving works either way.
    async fn wait_assigned(&self) {
        let deadline = tokio::time::Instant::now() + ASSIGN_WAIT;
        while tokio::time::Instant::now() < deadline {
            if lock(&self.shared.state).parts.keys().any(|(c, _)| *c == 0) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tracing::debug!(consumer = %self.shared.sub.consumer, "no partitions assigned yet; receiving anyway");
    }

    async fn start(
        inner: Arc<Inner>,
        sub: &Subscription,
        clients: Vec<Client>,
    ) -> Result<Self, BrokerError> {
        let (tx, rx) = mpsc::unbounded_channel();
        let shared = Arc::new(Shared {
            owner: ReceiverId::next(),
            inner,
            sub: sub.clone(),
            clients,
            state: Mutex::new(State::default()),
            room: Condvar::new(),
            rebalances: AtomicU64::new(0),
            tx,
            inbound: tokio::sync::Mutex::new(Inbound {
                rx,
                ready: VecDeque::new(),
                kept: Vec::new(),
            }),
            stop: AtomicBool::new(false),
            crashed: AtomicBool::new(false),
            runtime: tokio::runtime::Handle::current(),
        });
        let mut consumers = Vec::new();
        for (i, c) in shared.clients.iter().enumerate() {
            let consumer: BaseConsumer<Ctx> = shared
                .inner
                .config
                .consumer(&c.group, sub.prefetch)
                .create_with_context(Ctx {
                    shared: Arc::downgrade(&shared),
                    client: i,
                    fetch: OnceLock::new(),
                    tokens: shared.inner.tokens.clone(),
                })
                .map_err(KafkaError::from)?;
            let consumer = ClientConsumer::new(consumer)?;
            consumer
                .consumer
                .subscribe(&[c.topic.as_str()])
                .map_err(KafkaError::from)?;
            consumers.push(consumer);
        }
        let mut threads = Vec::new();
        for (i, client) in consumers.into_iter().enumerate() {
            let consumer = Arc::new(ConsumerHandle {
                client: Some(client),
                topic: shared.clients[i].topic.clone(),
            });
            let s = shared.clone();
            let name = format!("reliq-kafka-{i}");
            let t = std::thread::Builder::new()
                .name(name)
                .spawn(move || s.poll_loop(i, consumer))
                .map_err(|e| BrokerError::Other(Box::new(e)))?;
            threads.push(t);
        }
        tracing::info!(consumer = %sub.consumer, source = %sub.source,
            clients = shared.clients.len(), "kafka receiver started");
        Ok(Self {
            shared,
            threads: Mutex::new(threads),
        })
    }
}

impl Shared {
    fn is_stopped(&self) -> bool {
        self.stop.load(Ordering::SeqCst)
    }

    /// Whether `client` retries in place, one record per partition at a time.
    fn blocking(&self, client: usize) -> bool {
        self.clients[client].role == Role::Source
            && self.inner.config.retry_mode == RetryMode::Blocking
    }
}

#[async_trait]
impl Receiver for KafkaReceiver {
    async fn receive(&self) -> Result<Delivery, BrokerError> {
        let mut one = Vec::with_capacity(1);
        self.receive_batch(1, &mut one).await?;
        one.pop().ok_or(BrokerError::Closed)
    }

    async fn receive_batch(&self, max: usize, into: &mut Vec<Delivery>) -> Result<(), BrokerError> {
        self.shared.receive_batch(max, into).await
    }

    async fn ack(&self, delivery: &Delivery) -> Result<(), BrokerError> {
        self.shared.ack(delivery)
    }

    async fn ack_batch(&self, deliveries: &[Delivery]) -> Vec<(usize, BrokerError)> {
        self.shared.ack_batch(deliveries)
    }

    /// Storing offsets is local (the commit runs in the background): never waits.
    fn try_ack_batch(&self, deliveries: &[Delivery]) -> Option<Vec<(usize, BrokerError)>> {
        Some(self.shared.ack_batch(deliveries))
    }

    async fn retry(&self, delivery: &Delivery, retry: RetryRequest) -> Result<(), BrokerError> {
        self.shared.retry(delivery, retry).await
    }

    async fn dead_letter(&self, delivery: &Delivery, dead: Message) -> Result<(), BrokerError> {
        self.shared.dead_letter(delivery, dead).await
    }

    async fn release(&self, delivery: &Delivery, delay: Duration) -> Result<(), BrokerError> {
        self.shared.release(delivery, delay)
    }

    async fn close(&self) -> Result<(), BrokerError> {
        self.shared.stop.store(true, Ordering::SeqCst);
        let threads: Vec<JoinHandle<()>> = std::mem::take(&mut *lock(&self.threads));
        tokio::task::spawn_blocking(move || {
            for t in threads {
                if t.join().is_err() {
                    tracing::warn!("a kafka poll thread panicked");
                }
            }
        })
        .await
        .map_err(|e| BrokerError::Other(Box::new(e)))?;
        Ok(())
    }
}

impl Drop for KafkaReceiver {
    /// Dropped without `close`: behave like a crashed process — commit nothing more,
    /// leave the group; unsettled records are redelivered to the next owner.
    fn drop(&mut self) {
        if !self.shared.stop.swap(true, Ordering::SeqCst) {
            self.shared.crashed.store(true, Ordering::SeqCst);
        }
    }
}
