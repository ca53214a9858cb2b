//! The receiving side: one poll thread per Kafka consumer (the source's group, one relay
//! per retry tier), all feeding one stream of deliveries, with
//! per-partition offset tracking, pause-based flow control and the crash-loop counter.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use bytes::Bytes;
use rdkafka::ClientContext;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance};
use rdkafka::producer::Producer as _;
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use reliq_core::headers::{self, DeadLetter, DeadLetterReason, Origin};
use reliq_core::{
    BrokerError, Clock, Delivery, DeliveryToken, Headers, Message, MessageId, Receiver, ReceiverId,
    RetryRequest, Subscription,
};
use tokio::sync::mpsc;

use crate::config::RetryMode;
use crate::fetch::{FetchQueue, Fetched, KafkaRecord, LazyRecord, RecordOwner};
use crate::tracker::OffsetTracker;
use crate::{DUE_AT_HEADER, Inner, KafkaError, SOURCE_OFFSET_HEADER, SOURCE_PARTITION_HEADER};

/// Longest a poll blocks, so settlements (commits, resumes) are applied promptly.
const POLL_SLICE: Duration = Duration::from_millis(20);
/// While the buffer ahead of the runtime is full the poll thread stops taking records
/// but leaves them in librdkafka's own bounded fetch queue (`queued.max.messages.kbytes`),
/// waiting for the runtime to take some (at most [`FULL_RECHECK`] per wait). Pausing
/// would discard that queue and cost a refetch (hundreds of milliseconds) on resume; only
/// a buffer full for longer than this pauses the partitions, so the poll loop goes back
/// to serving rebalances and `max.poll.interval.ms` while slow handlers catch up.
const FLOW_PAUSE_AFTER: Duration = Duration::from_secs(1);
/// Longest a poll thread waits for room in a full buffer before it looks again (the
/// runtime wakes it as soon as it takes records).
const FULL_RECHECK: Duration = Duration::from_millis(1);
/// Most records the poll thread takes from librdkafka in one pass, between two looks at
/// the buffer bound.
pub(crate) const POLL_BATCH: usize = 256;
/// How often a poll thread routes its assigned partitions to its fetch queue again. A
/// partition is routed before its assignment starts its fetch; but a fetch stop still
/// pending from an earlier revoke of the same partition, completing after that, drops
/// the route — and the fetch that starts next keeps records on the partition's own
/// queue. Routing again is idempotent and cheap (a lookup and a forward per partition);
/// it bounds that stall to this long.
const ROUTE_EVERY: Duration = Duration::from_millis(100);
/// How long a stopping poll thread waits for its group leave beyond the revoke's
/// drain.
const LEAVE_WAIT: Duration = Duration::from_secs(5);
/// How long a closing poll thread waits for its consumer's close events per poll.
const CLOSE_POLL: Duration = Duration::from_millis(100);
/// Most events (rebalances, errors, commit results) a poll pass serves before it takes
/// records; the rest wait for the next pass.
const EVENTS_PER_PASS: usize = 16;
/// Shortest interval between two services (commits, due relay records, pauses) while
/// records keep arriving: none of them needs to run per record, and an asynchronous
/// commit per record would be a broker request per record.
const SERVICE_EVERY: Duration = Duration::from_millis(2);
/// How long `subscribe` waits for the source consumer's first partition assignment.
const ASSIGN_WAIT: Duration = Duration::from_secs(10);
/// Prefix of the commit metadata that carries the crash-loop counter.
const COUNTER_PREFIX: &str = "reliq-deliveries";

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

/// Which record a delivery is, packed into its [`DeliveryToken`] without an allocation:
/// `tag` = offset; `lane` = a marker bit (63) | generation (bits 40–61, wrapping) |
/// client (bits 32–39) | partition (bits 0–31).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct TokenInfo {
    client: usize,
    partition: i32,
    offset: i64,
    /// The partition's assignment generation, masked to [`GENERATION_MASK`].
    generation: u64,
}

const TOKEN_MARKER: u64 = 1 << 63;
const GENERATION_MASK: u64 = (1 << 22) - 1;
/// Most Kafka consumers one receiver runs (source + relays), so a client index fits the
/// token's 8 bits.
const MAX_CLIENTS: usize = 256;

impl TokenInfo {
    fn token(self, owner: ReceiverId) -> DeliveryToken {
        let lane = TOKEN_MARKER
            | (self.generation & GENERATION_MASK) << 40
            | (self.client as u64 & 0xff) << 32
            | u64::from(self.partition as u32);
        DeliveryToken::new(owner, self.offset as u64).with_lane(lane as i64)
    }

    /// The record a delivery's token names (its receiver is checked at the seam,
    /// [`Shared::check`]).
    fn of(d: &Delivery) -> Option<Self> {
        let t = d.token();
        let lane = t.lane() as u64;
        (lane & TOKEN_MARKER != 0).then_some(Self {
            client: ((lane >> 32) & 0xff) as usize,
            partition: lane as u32 as i32,
            offset: t.tag() as i64,
            generation: (lane >> 40) & GENERATION_MASK,
        })
    }
}

/// A record as librdkafka handed it out, not decoded yet. The poll thread — the serial
/// stage of the receive path — only tracks its offset; the receive loop makes it a
/// delivery whose message is decoded when first read ([`LazyRecord`]), on whichever
/// thread reads it.
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
            out: false,
            waiting: VecDeque::new(),
            rewind: false,
            head,
            head_count,
            counted: false,
        }
    }
}

/// Most deliveries buffered ahead of the runtime (which itself holds at most
/// `prefetch`): four times the prefetch, at least 16, so the handlers never wait for the
/// poll thread.
pub(crate) fn buffer_bound(prefetch: u32) -> usize {
    (prefetch.max(1) as usize).saturating_mul(4).max(16)
}

/// Room in the buffer a poll thread waits for before its next pass (a quarter of the
/// bound, at most one pass): passes of a few records would cost a lock, a clock read and
/// a wake-up each.
fn refill_room(bound: usize) -> usize {
    (bound / 4).clamp(1, POLL_BATCH)
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

impl State {
    /// The buffer ahead of the runtime has reached [`buffer_bound`].
    fn full(&self, prefetch: u32) -> bool {
        self.queued >= buffer_bound(prefetch)
    }
}

/// Flow control of one poll thread (see [`FLOW_PAUSE_AFTER`]).
#[derive(Default)]
struct Flow {
    /// Since when the buffer has been full.
    full_since: Option<Instant>,
    /// The partitions are paused because the buffer stayed full; they resume once it is
    /// down to a quarter.
    paused: bool,
}

impl Flow {
    /// Update with the buffer state; `true` = take no records now (the caller waits
    /// for room and checks again), `false` = poll (records, or only events while the
    /// partitions are paused). The buffer counts as full while less than a
    /// [`refill_room`] is left, so a stuck runtime leads to the pause (and polling for
    /// events) whatever the level it stopped at.
    fn hold_back(&mut self, queued: usize, prefetch: u32, now: Instant) -> bool {
        let high = buffer_bound(prefetch);
        if high.saturating_sub(queued) >= refill_room(high) {
            self.full_since = None;
            if self.paused && queued <= high / 4 {
                self.paused = false;
            }
            return false;
        }
        let since = *self.full_since.get_or_insert(now);
        if now.duration_since(since) >= FLOW_PAUSE_AFTER {
            self.paused = true;
        }
        !self.paused
    }
}

/// One poll thread's view for its current pass: the generations of its partitions that
/// take the fast path, and the records of that path waiting to be tracked. The view is
/// refreshed whenever a rebalance ran (rebalance callbacks run inside `poll`, on this
/// thread, so a record is always tagged with the generation it was polled under).
struct Pass {
    /// [`Shared::rebalances`] when `fast` was read; `u64::MAX` = read again.
    seen: u64,
    /// (partition, generation) of partitions assigned, not revoking, past their first
    /// record.
    fast: Vec<(i32, u64)>,
    pending: Vec<Polled>,
    /// The poll thread's consumer, for the records it hands out.
    owner: Arc<ConsumerHandle>,
}

impl Pass {
    fn new(owner: Arc<ConsumerHandle>) -> Self {
        Self {
            seen: u64::MAX,
            fast: Vec::new(),
            pending: Vec::with_capacity(POLL_BATCH),
            owner,
        }
    }

    /// Read the partitions again before the next record.
    fn stale(&mut self) {
        self.seen = u64::MAX;
    }

    /// The generation of `partition` if its records take the fast path.
    fn generation(&mut self, shared: &Shared, client: usize, partition: i32) -> Option<u64> {
        let now = shared.rebalances.load(Ordering::Acquire);
        if now != self.seen {
            self.seen = now;
            self.fast.clear();
            let s = lock(&shared.state);
            self.fast.extend(
                s.parts
                    .iter()
                    .filter(|((c, _), part)| *c == client && part.counted && !part.revoking)
                    .map(|((_, p), part)| (*p, part.generation)),
            );
        }
        self.fast
            .iter()
            .find(|(p, _)| *p == partition)
            .map(|(_, g)| *g)
    }
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
    /// Counts assignments and revocations (see [`Pass`]).
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

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Critical sections leave the state consistent; a poisoned lock is usable.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Purges a poll thread's undecoded records when the thread leaves ([`Shared::purge_polled`]);
/// a panicking poll thread also stops the receiver, which has lost a consumer.
struct PurgeOnExit<'a> {
    shared: &'a Shared,
    client: usize,
}

impl Drop for PurgeOnExit<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            tracing::error!(
                client = self.client,
                "a kafka poll thread panicked; the receiver stops"
            );
            self.shared.crashed.store(true, Ordering::SeqCst);
            self.shared.stop.store(true, Ordering::SeqCst);
        }
        self.shared.purge_polled(self.client);
    }
}

struct Ctx {
    shared: Weak<Shared>,
    client: usize,
    /// The consumer's fetch queue, once made (it needs the consumer's handle).
    fetch: OnceLock<Weak<FetchQueue>>,
}

impl Ctx {
    /// Route the partitions about to be assigned to the fetch queue (before the
    /// assignment starts their fetch; see [`FetchQueue::route`]).
    fn route(&self, tpl: &TopicPartitionList) {
        if let Some(fetch) = self.fetch.get().and_then(Weak::upgrade) {
            for e in tpl.elements() {
                fetch.route(e.topic(), e.partition());
            }
        }
    }
}

/// A poll thread's consumer and its fetch queue. The queue is declared first: it goes
/// before the consumer it refers to.
struct ClientConsumer {
    fetch: Arc<FetchQueue>,
    consumer: BaseConsumer<Ctx>,
}

/// A poll thread's consumer, shared with every record it hands out.
///
/// librdkafka destroys a consumer only after all of its messages, and a delivery holds
/// its record until it is dropped (its message is decoded on demand, [`LazyRecord`]) —
/// possibly after the receiver is gone, if a handler keeps it. So the poll thread
/// *closes* its consumer when it stops (final commit, group leave: nothing waits for the
/// deliveries), and the handle *destroys* it with the last reference, the poll thread's
/// or a record's.
struct ConsumerHandle {
    /// `None` only while dropping.
    client: Option<ClientConsumer>,
    /// The consumer's topic (for the fallback id of a record without one).
    topic: String,
}

impl ConsumerHandle {
    fn get(&self) -> &ClientConsumer {
        self.client
            .as_ref()
            .expect("a consumer handle holds its consumer until it is dropped")
    }
}

impl RecordOwner for ConsumerHandle {
    fn decode(&self, record: &Fetched) -> Message {
        decode(record, &self.topic).message
    }
}

impl Drop for ConsumerHandle {
    fn drop(&mut self) {
        let Some(client) = self.client.take() else {
            return;
        };
        // The last record went on a runtime thread: destroying a consumer joins
        // librdkafka's threads, which must not block a runtime worker.
        if tokio::runtime::Handle::try_current().is_ok() {
            let spawned = std::thread::Builder::new()
                .name("reliq-kafka-destroy".into())
                .spawn(move || drop(client));
            if let Err(e) = spawned {
                tracing::warn!(error = %e, "no thread to destroy a kafka consumer on; it is leaked");
            }
        }
    }
}

impl ClientConsumer {
    fn new(consumer: BaseConsumer<Ctx>) -> Result<Self, BrokerError> {
        // SAFETY: the handle is the consumer's, which `Self` drops after the queue.
        #[allow(unsafe_code)]
        let fetch = unsafe { FetchQueue::new(consumer.client().native_ptr()) }
            .map(Arc::new)
            .ok_or_else(|| BrokerError::Other("librdkafka could not make a queue".into()))?;
        let _ = consumer.context().fetch.set(Arc::downgrade(&fetch));
        Ok(Self { fetch, consumer })
    }
}

impl ClientContext for Ctx {}

impl ConsumerContext for Ctx {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Revoke(tpl) => {
                if let Some(shared) = self.shared.upgrade() {
                    let lost = consumer.assignment_lost();
                    shared.revoke(self.client, consumer, tpl, lost);
                }
            }
            Rebalance::Error(e) => tracing::warn!(error = %e, "rebalance error"),
            Rebalance::Assign(tpl) => self.route(tpl),
        }
    }

    fn post_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let (Rebalance::Assign(tpl), Some(shared)) = (rebalance, self.shared.upgrade()) {
            shared.assign(self.client, consumer, tpl);
        }
    }
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

/// The relay group of `sub`'s tier `delay`.
fn relay_group(sub: &Subscription, delay: Duration) -> String {
    format!("{}.retry.{}ms", sub.consumer, delay.as_millis())
}

/// A retry topic of this consumer that its current policy has no tier for.
struct StaleTier {
    delay: Duration,
    topic: String,
    /// Records its relay group has not consumed.
    lag: i64,
}

/// This consumer's retry topics on the broker (`<source>.<consumer>.retry.<ms>ms`, by
/// metadata) other than `current` that still hold records their relay group has not
/// consumed: retries a redeploy with another policy would strand.
async fn stale_tiers(
    inner: &Arc<Inner>,
    sub: &Subscription,
    current: &[String],
) -> Result<Vec<StaleTier>, BrokerError> {
    let inner = inner.clone();
    let sub = sub.clone();
    let current = current.to_vec();
    tokio::task::spawn_blocking(move || {
        let prefix = format!("{}.{}.retry.", sub.source, sub.consumer);
        let metadata = inner
            .route_producer
            .client()
            .fetch_metadata(None, STALE_WAIT)
            .map_err(|e| {
                BrokerError::connection(format!("listing topics for old retry tiers: {e}"))
                    .caused_by(e)
            })?;
        let mut stale = Vec::new();
        for t in metadata.topics() {
            let Some(ms) = t
                .name()
                .strip_prefix(&prefix)
                .and_then(|rest| rest.strip_suffix("ms"))
                .and_then(|ms| ms.parse::<u64>().ok())
            else {
                continue;
            };
            if current.iter().any(|c| c == t.name()) || t.partitions().is_empty() {
                continue;
            }
            let delay = Duration::from_millis(ms);
            let lag = relay_lag(&inner, &relay_group(&sub, delay), t)?;
            if lag > 0 {
                stale.push(StaleTier {
                    delay,
                    topic: t.name().to_owned(),
                    lag,
                });
            }
        }
        Ok(stale)
    })
    .await
    .map_err(|e| BrokerError::Other(Box::new(e)))?
}

/// How long looking for old retry tiers may wait for one answer.
const STALE_WAIT: Duration = Duration::from_secs(10);

/// Records of `topic` that `group` has not committed past (its committed offsets read
/// without joining the group).
fn relay_lag(
    inner: &Inner,
    group: &str,
    topic: &rdkafka::metadata::MetadataTopic,
) -> Result<i64, BrokerError> {
    let name = topic.name();
    let failed = |what: &str, e: rdkafka::error::KafkaError| {
        BrokerError::connection(format!("reading {what} of old retry tier {name}: {e}"))
            .caused_by(e)
    };
    let consumer: BaseConsumer = inner
        .config
        .consumer(group, 1)
        .create()
        .map_err(|e| failed("a consumer", e))?;
    let mut tpl = TopicPartitionList::new();
    for p in topic.partitions() {
        tpl.add_partition(name, p.id());
    }
    let committed = consumer
        .committed_offsets(tpl, STALE_WAIT)
        .map_err(|e| failed("the relay's committed offsets", e))?;
    let mut lag = 0;
    for p in topic.partitions() {
        let (low, high) = consumer
            .fetch_watermarks(name, p.id(), STALE_WAIT)
            .map_err(|e| failed("the watermarks", e))?;
        let done = match committed.find_partition(name, p.id()).map(|e| e.offset()) {
            Some(Offset::Offset(o)) => o.max(low),
            _ => low,
        };
        lag += (high - done).max(0);
    }
    Ok(lag)
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

    fn poll_loop(self: Arc<Self>, client: usize, owned: Arc<ConsumerHandle>) {
        // Borrowed, not moved out: the argument drops after every local, on a panic too,
        // and its fields in order (the fetch queue, then the consumer it refers to).
        let (fetch, consumer) = (&*owned.get().fetch, &owned.get().consumer);
        // Dropped before `owned` (locals go before arguments), on a panic too.
        let purge = PurgeOnExit {
            shared: &self,
            client,
        };
        let mut flow = Flow::default();
        let bound = buffer_bound(self.sub.prefetch);
        let mut next_service = Instant::now();
        let mut timeout = Duration::ZERO;
        // What this pass handed out; sent to the runtime as one chunk at the end of the
        // pass (before the next poll may block).
        let mut out = Vec::with_capacity(POLL_BATCH);
        let mut pass = Pass::new(owned.clone());
        let mut fetched = Vec::with_capacity(POLL_BATCH);
        let mut next_route = Instant::now() + ROUTE_EVERY;
        while !self.is_stopped() {
            let queued = lock(&self.state).queued;
            let now = Instant::now();
            let hold_back = flow.hold_back(queued, self.sub.prefetch, now);
            if now >= next_service {
                timeout = self.service(client, consumer, flow.paused, &mut out);
                self.flush(&mut out);
                next_service = now + SERVICE_EVERY;
            }
            if now >= next_route {
                self.route(client, fetch);
                next_route = now + ROUTE_EVERY;
            }
            // Too little room for a pass worth its overhead: wait for the runtime to take
            // records (while paused, the loop polls for events instead).
            if hold_back {
                let mut s = lock(&self.state);
                if bound.saturating_sub(s.queued) < refill_room(bound) {
                    s.room_wanted = true;
                    drop(self.room.wait_timeout(s, FULL_RECHECK));
                }
                continue;
            }
            // Events first (rebalances, errors, commit results), without waiting: they
            // wait at most one pass, at most `POLL_SLICE`.
            for _ in 0..EVENTS_PER_PASS {
                if !fetch.events_waiting() {
                    break;
                }
                match consumer.poll(Duration::ZERO) {
                    None => {}
                    Some(Ok(m)) => self.on_record(client, consumer, m, &mut out, &mut pass),
                    Some(Err(e)) => {
                        tracing::warn!(topic = %self.clients[client].topic, error = %e, "kafka consumer error");
                    }
                }
            }
            // Then the records librdkafka holds, up to the room left, in one take that
            // may block (until records arrive or the next relay record is due).
            let room = bound.saturating_sub(queued).clamp(1, POLL_BATCH);
            fetch.take(timeout, room, &mut fetched);
            for m in fetched.drain(..) {
                if let Some(e) = m.error() {
                    tracing::warn!(topic = %self.clients[client].topic, error = %e, "kafka consumer error");
                    continue;
                }
                self.on_record(client, consumer, m, &mut out, &mut pass);
            }
            self.track_pass(&mut pass, &mut out);
            self.flush(&mut out);
        }
        if !self.crashed.load(Ordering::SeqCst) {
            // Graceful close: commit everything done, synchronously, before leaving.
            let tpl = {
                let s = lock(&self.state);
                self.positions(&s, client, |_| true)
            };
            if tpl.count() > 0
                && let Err(e) = consumer.commit(&tpl, CommitMode::Sync)
            {
                tracing::warn!(error = %e, "final commit failed; done records may be redelivered");
            }
        }
        drop((out, pass, fetched, purge));
        // Leave the group now (its revoke runs in `revoke`): deliveries still out may hold
        // the handle, and with it the consumer, for longer. Unsubscribing leaves the
        // group; closing here would too, but rdkafka's drop closes every group consumer
        // again, and a second close fails and logs an error (`Consumer already closed`).
        consumer.unsubscribe();
        let deadline = Instant::now() + self.inner.config.rebalance_drain + LEAVE_WAIT;
        while Instant::now() < deadline {
            // Serves the revoke; a record still arriving is dropped (uncommitted).
            drop(consumer.poll(CLOSE_POLL));
            if consumer.assignment().is_ok_and(|a| a.count() == 0) {
                break;
            }
        }
        // The last reference closes (nothing left to leave) and destroys the consumer,
        // its fetch queue first.
        drop(owned);
    }

    /// Route `client`'s assigned partitions to its fetch queue again (see
    /// [`ROUTE_EVERY`]).
    fn route(&self, client: usize, fetch: &FetchQueue) {
        let partitions: Vec<i32> = lock(&self.state)
            .parts
            .iter()
            .filter(|((c, _), part)| *c == client && !part.revoking)
            .map(|((_, p), _)| *p)
            .collect();
        for p in partitions {
            fetch.route(&self.clients[client].topic, p);
        }
    }

    /// Drop every undecoded record of `client`'s consumer still in the inbound: nobody
    /// will take them (they are uncommitted: the partition's next owner reads them
    /// again), and each holds the consumer, which goes with the last of them. Runs after
    /// `stop`: a receive waiting for a chunk holds the inbound lock, so an empty chunk
    /// wakes it and it returns on seeing `stop`, releasing the lock.
    fn purge_polled(&self, client: usize) {
        let _ = self.tx.send(Vec::new());
        let mut inbound = self.inbound.blocking_lock();
        let Inbound { rx, ready, kept } = &mut *inbound;
        while let Ok(chunk) = rx.try_recv() {
            ready.extend(chunk);
        }
        let other = |r: &Record| !matches!(r, Record::Polled(p) if p.info.client == client);
        let before = ready.len() + kept.len();
        ready.retain(other);
        kept.retain(other);
        let purged = before - ready.len() - kept.len();
        tracing::debug!(topic = %self.clients[client].topic, purged, "undecoded records dropped before the consumer closes");
    }

    /// Positions of `client`'s partitions that pass `keep`, as a list to commit.
    fn positions(
        &self,
        s: &State,
        client: usize,
        keep: impl Fn(i32) -> bool,
    ) -> TopicPartitionList {
        let topic = &self.clients[client].topic;
        let mut tpl = TopicPartitionList::new();
        for ((c, p), part) in &s.parts {
            if *c != client || !keep(*p) {
                continue;
            }
            if let Some(pos) = part.tracker.position() {
                let _ = tpl.add_partition_offset(topic, *p, Offset::Offset(pos));
            }
        }
        tpl
    }

    /// Commit what moved, hand out due relay records, pause/resume (relay heads not due
    /// yet; every partition while `flow_paused`). Returns how long the next poll may
    /// block.
    fn service(
        &self,
        client: usize,
        consumer: &BaseConsumer<Ctx>,
        flow_paused: bool,
        out: &mut Vec<Record>,
    ) -> Duration {
        let topic = self.clients[client].topic.as_str();
        let now = SystemTime::now();
        let mut due = Vec::new();
        let mut commit = TopicPartitionList::new();
        let mut rewind = Vec::new();
        {
            let mut s = lock(&self.state);
            let full = s.full(self.sub.prefetch);
            let mut dropped = 0;
            for ((c, p), part) in s.parts.iter_mut() {
                if *c != client {
                    continue;
                }
                if part.rewind {
                    // Blocking retry: forget what was read past the failed record and
                    // read it again after the retry (bounded memory while it waits).
                    part.rewind = false;
                    if let Some((first, _)) = part.waiting.front() {
                        rewind.push((*p, *first));
                    }
                    dropped += part.waiting.len();
                    part.waiting.clear();
                }
                if let Some(pos) = part.tracker.take_commit() {
                    let _ = commit.add_partition_offset(topic, *p, Offset::Offset(pos));
                }
                while !full && part.held.front().is_some_and(|h| h.due <= now) {
                    if let Some(h) = part.held.pop_front() {
                        due.push((*p, h));
                    }
                }
            }
            s.queued = s.queued.saturating_sub(dropped);
        }
        for (partition, offset) in rewind {
            // The partition is paused below while its retry is held.
            if let Err(e) = consumer.seek(topic, partition, Offset::Offset(offset), POLL_SLICE) {
                tracing::warn!(error = %e, partition, offset, "seeking back for a blocking retry failed");
            }
        }
        if commit.count() > 0
            && let Err(e) = consumer.commit(&commit, CommitMode::Async)
        {
            tracing::warn!(error = %e, "commit failed; done records may be redelivered");
        }
        for (partition, h) in due {
            if self.blocking(client) {
                lock(&self.state).queued += 1;
                out.push(Record::Ready(Box::new(h.delivery)));
            } else {
                self.hand_out(client, consumer, partition, h.offset, h.delivery, out);
            }
        }
        // Pause every partition while flow control says so, and relay partitions while
        // their head is not due.
        let mut pause = TopicPartitionList::new();
        let mut resume = TopicPartitionList::new();
        let mut next_due: Option<Duration> = None;
        {
            let mut s = lock(&self.state);
            for ((c, p), part) in s.parts.iter_mut() {
                if *c != client {
                    continue;
                }
                if let Some(h) = part.held.front() {
                    let wait = h.due.duration_since(now).unwrap_or_default();
                    next_due = Some(next_due.map_or(wait, |n| n.min(wait)));
                }
                let want = flow_paused || !part.held.is_empty();
                if want != part.paused {
                    part.paused = want;
                    let list = if want { &mut pause } else { &mut resume };
                    list.add_partition(topic, *p);
                }
            }
        }
        if pause.count() > 0
            && let Err(e) = consumer.pause(&pause)
        {
            tracing::warn!(error = %e, "pausing partitions failed");
        }
        if resume.count() > 0
            && let Err(e) = consumer.resume(&resume)
        {
            tracing::warn!(error = %e, "resuming partitions failed");
        }
        next_due.map_or(POLL_SLICE, |d| d.min(POLL_SLICE))
    }

    fn on_record(
        &self,
        client: usize,
        consumer: &BaseConsumer<Ctx>,
        mut m: impl KafkaRecord,
        out: &mut Vec<Record>,
        pass: &mut Pass,
    ) {
        let (partition, offset) = (m.partition(), m.offset());
        let role = self.clients[client].role;
        // Fast path: a source partition past its first record, not in blocking
        // mode — tracked with the rest of the pass under one lock, decoded by the
        // receive loop.
        let fast = if matches!(role, Role::Relay(_)) || self.blocking(client) {
            None
        } else {
            pass.generation(self, client, partition)
        };
        if let Some(generation) = fast {
            let info = TokenInfo {
                client,
                partition,
                offset,
                generation,
            };
            match m.into_fetched() {
                Ok(message) => {
                    let owner = pass.owner.clone();
                    return pass.pending.push(Polled {
                        message,
                        info,
                        owner,
                    });
                }
                Err(back) => m = back,
            }
        }
        self.decode_now(client, consumer, m, out, pass);
    }

    /// [`Shared::on_record`]'s slow path: decoded on the poll thread, in order behind
    /// what the pass holds so far.
    fn decode_now(
        &self,
        client: usize,
        consumer: &BaseConsumer<Ctx>,
        m: impl KafkaRecord,
        out: &mut Vec<Record>,
        pass: &mut Pass,
    ) {
        let (partition, offset) = (m.partition(), m.offset());
        let role = self.clients[client].role;
        self.track_pass(pass, out);
        pass.stale();
        let generation = match lock(&self.state).parts.get(&(client, partition)) {
            Some(p) if !p.revoking => p.generation,
            _ => return,
        };
        let info = TokenInfo {
            client,
            partition,
            offset,
            generation,
        };
        let (delivery, due) = self.delivery(&m, info);
        if let Role::Relay(delay) = role {
            let due = due.unwrap_or_else(|| {
                let ts = m.timestamp_ms().unwrap_or(0).max(0);
                UNIX_EPOCH + Duration::from_millis(u64::try_from(ts).unwrap_or(0)) + delay
            });
            let mut s = lock(&self.state);
            if let Some(part) = s.parts.get_mut(&(client, partition))
                && (due > SystemTime::now() || !part.held.is_empty())
            {
                part.held.push_back(Held {
                    due,
                    offset,
                    delivery,
                });
                if !part.paused {
                    // Stop fetching behind a record that is not due yet.
                    part.paused = true;
                    let mut tpl = TopicPartitionList::new();
                    tpl.add_partition(&self.clients[client].topic, partition);
                    if let Err(e) = consumer.pause(&tpl) {
                        tracing::warn!(error = %e, "pausing a relay partition failed");
                    }
                }
                return;
            }
        }
        self.hand_out(client, consumer, partition, offset, delivery, out);
    }

    /// The delivery for a record of `info.client`'s consumer, and its due-time header
    /// (set on relay records).
    fn delivery(&self, m: &impl KafkaRecord, info: TokenInfo) -> (Delivery, Option<SystemTime>) {
        let client = &self.clients[info.client];
        let decoded = decode(m, &client.topic);
        let origin = match client.role {
            Role::Source => self.origin(info),
            Role::Relay(_) => Origin {
                partition: decoded.source_partition,
                offset: decoded.source_offset,
                ..self.origin(info)
            },
        };
        let attempt = headers::attempt(decoded.message.headers());
        let delivery = Delivery::new(decoded.message, attempt, origin, info.token(self.owner));
        (delivery, decoded.due)
    }

    /// A record as the runtime gets it: a fast-path record (source, see
    /// [`Shared::on_record`]) with its message decoded on demand.
    fn delivery_of(&self, record: Record) -> Delivery {
        match record {
            Record::Ready(d) => *d,
            Record::Polled(p) => {
                let message = LazyRecord::new(p.message, p.owner);
                Delivery::raw(
                    Box::new(message),
                    self.origin(p.info),
                    p.info.token(self.owner),
                )
            }
        }
    }

    /// Where a record of `info.client` came from: its topic (a relay's reports its
    /// source topic), partition and offset (a relay overrides these from the record's
    /// headers).
    fn origin(&self, info: TokenInfo) -> Origin {
        Origin {
            destination: self.clients[info.client].origin.clone(),
            partition: Some(info.partition),
            offset: Some(info.offset),
            ..Origin::default()
        }
    }

    /// Count the head record (crash-loop guard), then push the delivery to the stream.
    fn hand_out(
        &self,
        client: usize,
        consumer: &BaseConsumer<Ctx>,
        partition: i32,
        offset: i64,
        delivery: Delivery,
        out: &mut Vec<Record>,
    ) {
        let mut s = lock(&self.state);
        let Some(part) = s.parts.get_mut(&(client, partition)) else {
            return;
        };
        if part.counted {
            // Every record after the partition's first: one lock, no counter.
            let tracked = self.track(
                &mut s,
                client,
                partition,
                offset,
                Record::Ready(Box::new(delivery)),
            );
            drop(s);
            out.extend(tracked);
            return;
        }
        part.counted = true;
        let count = part.head.is_none_or(|h| h == offset).then(|| {
            let before = part
                .head_count
                .filter(|(o, _)| *o == offset)
                .map_or(0, |(_, n)| n);
            before.saturating_add(1)
        });
        drop(s);
        if let Some(n) = count {
            let topic = &self.clients[client].topic;
            let mut tpl = TopicPartitionList::new();
            let mut e = tpl.add_partition(topic, partition);
            let set = e.set_offset(Offset::Offset(offset));
            e.set_metadata(format!("{COUNTER_PREFIX}:{offset}:{n}"));
            if set.is_ok()
                && let Err(err) = consumer.commit(&tpl, CommitMode::Sync)
            {
                tracing::warn!(error = %err, "storing the delivery counter failed");
            }
            if n > self.sub.delivery_limit {
                match self.dead_letter_max_deliveries(&delivery) {
                    Ok(()) => {
                        tracing::warn!(topic = %topic, partition, offset, deliveries = n - 1,
                            id = %delivery.id(), "delivery limit reached; moved to the dead-letter topic");
                        let mut s = lock(&self.state);
                        if let Some(part) = s.parts.get_mut(&(client, partition)) {
                            part.tracker.handed_out(offset);
                            part.tracker.complete(offset);
                        }
                        return;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "delivery limit reached but the DLQ refuses; handing the record out");
                    }
                }
            }
        }
        let tracked = self.track(
            &mut lock(&self.state),
            client,
            partition,
            offset,
            Record::Ready(Box::new(delivery)),
        );
        out.extend(tracked);
    }

    /// Track the record's offset and count it as buffered; returns it if it goes to the
    /// stream now (in blocking mode it may wait behind the partition's record that is
    /// out). The caller sends it after releasing the state lock: a send may wake a
    /// worker, and the workers settle under the same lock.
    fn track(
        &self,
        s: &mut State,
        client: usize,
        partition: i32,
        offset: i64,
        record: Record,
    ) -> Option<Record> {
        let blocking = self.blocking(client);
        let part = s.parts.get_mut(&(client, partition))?;
        if part.revoking {
            return None;
        }
        if blocking && (part.out || !part.waiting.is_empty()) {
            // One record per partition at a time: this one waits for the one out.
            // (Blocking mode takes the slow path: this is decoded already.)
            part.waiting.push_back((offset, self.delivery_of(record)));
            s.queued += 1;
            return None;
        }
        if !part.tracker.handed_out(offset) {
            return None;
        }
        part.out = blocking;
        s.queued += 1;
        Some(record)
    }

    /// [`Shared::track`] the pass's fast-path records under one lock and move them to
    /// `out`; a record whose partition was reassigned since it was polled is dropped — it
    /// is uncommitted, and its next owner reads it again.
    fn track_pass(&self, pass: &mut Pass, out: &mut Vec<Record>) {
        if pass.pending.is_empty() {
            return;
        }
        let mut s = lock(&self.state);
        for p in pass.pending.drain(..) {
            let info = p.info;
            let current = s
                .parts
                .get(&(info.client, info.partition))
                .is_some_and(|part| part.generation == info.generation);
            if current {
                let record = Record::Polled(p);
                out.extend(self.track(&mut s, info.client, info.partition, info.offset, record));
            }
        }
    }

    /// Push tracked records to the stream (one chunk); `out` is left empty.
    fn flush(&self, out: &mut Vec<Record>) {
        if !out.is_empty() {
            let chunk = std::mem::replace(out, Vec::with_capacity(out.capacity()));
            self.send(chunk);
        }
    }

    fn send(&self, chunk: Vec<Record>) {
        if self.tx.send(chunk).is_err() {
            tracing::debug!("receiver gone; records left uncommitted");
        }
    }

    fn dead_letter_max_deliveries(&self, d: &Delivery) -> Result<(), BrokerError> {
        let mut dead = d.message().clone();
        DeadLetter {
            reason: DeadLetterReason::MaxDeliveries,
            error_class: None,
            error: None,
            attempts: d.attempt(),
            first_failure_at: None,
            dead_lettered_at: Clock::new().now(),
            consumer: self.sub.consumer.clone(),
            origin: d.origin().clone(),
        }
        .write(dead.headers_mut());
        let topic = self.sub.dead_letter_name();
        self.runtime
            .block_on(route_produce(&self.inner, &topic, &dead, &[]))
    }

    fn assign(&self, client: usize, consumer: &BaseConsumer<Ctx>, tpl: &TopicPartitionList) {
        let committed = match consumer.committed_offsets(tpl.clone(), Duration::from_secs(10)) {
            Ok(c) => Some(c),
            Err(e) => {
                tracing::warn!(error = %e, "reading committed offsets failed; delivery counter starts at 0");
                None
            }
        };
        let mut s = lock(&self.state);
        for e in tpl.elements() {
            let mut head = None;
            let mut head_count = None;
            if let Some(c) = committed
                .as_ref()
                .and_then(|c| c.find_partition(e.topic(), e.partition()))
                && let Offset::Offset(o) = c.offset()
            {
                head = Some(o);
                head_count = parse_counter(c.metadata());
            }
            let generation = s.next_generation;
            s.next_generation += 1;
            s.parts.insert(
                (client, e.partition()),
                Part::new(generation, head, head_count),
            );
        }
        self.rebalances.fetch_add(1, Ordering::Release);
        tracing::debug!(topic = %self.clients[client].topic, partitions = tpl.count(), "partitions assigned");
    }

    fn revoke(
        &self,
        client: usize,
        consumer: &BaseConsumer<Ctx>,
        tpl: &TopicPartitionList,
        lost: bool,
    ) {
        let revoked: Vec<i32> = tpl.elements().iter().map(|e| e.partition()).collect();
        {
            let mut s = lock(&self.state);
            for p in &revoked {
                if let Some(part) = s.parts.get_mut(&(client, *p)) {
                    part.revoking = true;
                }
            }
        }
        self.rebalances.fetch_add(1, Ordering::Release);
        let crashed = self.crashed.load(Ordering::SeqCst);
        if !lost && !crashed {
            // Let in-flight records of the revoked partitions settle, then commit.
            let deadline = Instant::now() + self.inner.config.rebalance_drain;
            loop {
                let busy: usize = {
                    let s = lock(&self.state);
                    revoked
                        .iter()
                        .filter_map(|p| s.parts.get(&(client, *p)))
                        .map(|p| p.busy)
                        .sum()
                };
                if busy == 0 || Instant::now() >= deadline {
                    if busy > 0 {
                        tracing::warn!(
                            busy,
                            "revoke: records still in flight; the new owner will redeliver them"
                        );
                    }
                    break;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            let commit = {
                let s = lock(&self.state);
                self.positions(&s, client, |p| revoked.contains(&p))
            };
            if commit.count() > 0
                && let Err(e) = consumer.commit(&commit, CommitMode::Sync)
            {
                tracing::warn!(error = %e, "commit on revoke failed; done records may be redelivered");
            }
        }
        let mut s = lock(&self.state);
        for p in &revoked {
            s.parts.remove(&(client, *p));
        }
        self.rebalances.fetch_add(1, Ordering::Release);
        tracing::debug!(topic = %self.clients[client].topic, partitions = revoked.len(), lost, "partitions revoked");
    }

    /// Settle: the record is done (acked, retried or dead-lettered).
    fn finish(&self, d: &Delivery) {
        self.finish_locked(&mut lock(&self.state), d);
    }

    /// [`Shared::finish`] under a lock the caller holds (one lock for a batch).
    fn finish_locked(&self, s: &mut State, d: &Delivery) {
        let Some(TokenInfo {
            client,
            partition,
            offset,
            generation,
        }) = TokenInfo::of(d)
        else {
            return;
        };
        match s.parts.get_mut(&(client, partition)) {
            Some(part) if part.generation == generation => {
                part.busy = part.busy.saturating_sub(1);
                part.tracker.complete(offset);
                if part.out {
                    // Blocking mode: the partition's next record, in order.
                    part.out = false;
                    let mut skipped = 0;
                    while let Some((next, d)) = part.waiting.pop_front() {
                        if part.tracker.handed_out(next) {
                            part.out = true;
                            self.send(vec![Record::Ready(Box::new(d))]);
                            break;
                        }
                        skipped += 1; // already seen (cannot happen in offset order)
                    }
                    s.queued = s.queued.saturating_sub(skipped);
                }
            }
            _ => tracing::debug!(
                partition,
                offset,
                "settled after its partition was revoked; the new owner may deliver it again"
            ),
        }
    }
}

impl Shared {
    /// Blocking mode: hold the record (its partition paused, what was read past it
    /// dropped and read again later) and hand it out again after the policy's delay.
    /// The offset stays unfinished, so nothing past it is committed meanwhile.
    fn retry_in_place(
        &self,
        delivery: &Delivery,
        info: TokenInfo,
        retry: RetryRequest,
    ) -> Result<(), BrokerError> {
        let attempt = headers::attempt(retry.message.headers());
        let again = Delivery::new(
            retry.message,
            attempt,
            delivery.origin().clone(),
            info.token(self.owner),
        );
        let mut s = lock(&self.state);
        if let Some(part) = s.parts.get_mut(&(info.client, info.partition))
            && part.generation == info.generation
        {
            part.busy = part.busy.saturating_sub(1);
            part.held.push_back(Held {
                due: SystemTime::now() + retry.delay,
                offset: info.offset,
                delivery: again,
            });
            part.rewind = true;
        }
        // Otherwise revoked meanwhile: uncommitted, the new owner delivers it.
        Ok(())
    }
}

fn parse_counter(metadata: &str) -> Option<(i64, u32)> {
    let mut it = metadata
        .strip_prefix(COUNTER_PREFIX)?
        .strip_prefix(':')?
        .split(':');
    let offset = it.next()?.parse().ok()?;
    let n = it.next()?.parse().ok()?;
    Some((offset, n))
}

/// Header values and keys as text: borrowed when valid UTF-8 (the validating fast path),
/// with replacement characters otherwise.
fn text(bytes: &[u8]) -> std::borrow::Cow<'_, str> {
    match std::str::from_utf8(bytes) {
        Ok(s) => std::borrow::Cow::Borrowed(s),
        Err(_) => String::from_utf8_lossy(bytes),
    }
}

pub(crate) struct Decoded {
    pub(crate) message: Message,
    due: Option<SystemTime>,
    source_partition: Option<i32>,
    source_offset: Option<i64>,
}

/// `m` of `topic`, as reliq sees it.
pub(crate) fn decode(m: &impl KafkaRecord, topic: &str) -> Decoded {
    let mut id = None;
    let mut due = None;
    let mut source_partition = None;
    let mut source_offset = None;
    let mut hs = Headers::new();
    m.headers(|name, value| {
        // Borrowed: only what is kept is copied (the id once, into its `Arc<str>`).
        let value = value.map(text).unwrap_or_default();
        match name {
            headers::MESSAGE_ID => id = Some(MessageId::from(&*value)),
            DUE_AT_HEADER => {
                due = value
                    .parse::<u64>()
                    .ok()
                    .map(|ms| UNIX_EPOCH + Duration::from_millis(ms));
            }
            SOURCE_PARTITION_HEADER => source_partition = value.parse().ok(),
            SOURCE_OFFSET_HEADER => source_offset = value.parse().ok(),
            k => hs.insert(k, value),
        }
    });
    let id = id.filter(|i| !i.as_str().is_empty()).unwrap_or_else(|| {
        MessageId::from(format!("kafka-{topic}-{}-{}", m.partition(), m.offset()))
    });
    let key = m.key().map(|k| text(k).into_owned());
    let payload = Bytes::copy_from_slice(m.payload().unwrap_or_default());
    Decoded {
        message: Message::from_parts(id, key, payload, hs),
        due,
        source_partition,
        source_offset,
    }
}

/// Produce a retry / DLQ copy: the topic must exist (never auto-created), then wait for
/// the delivery report.
async fn route_produce(
    inner: &Inner,
    topic: &str,
    message: &Message,
    extra: &[(&str, String)],
) -> Result<(), BrokerError> {
    if !inner.topic_exists(topic).await.map_err(BrokerError::from)? {
        return Err(BrokerError::Unroutable(topic.to_owned()));
    }
    inner.produce(true, topic, message, extra).await.map(drop)
}

fn source_headers(d: &Delivery) -> Vec<(&'static str, String)> {
    let mut extra = Vec::new();
    if let Some(p) = d.origin().partition {
        extra.push((SOURCE_PARTITION_HEADER, p.to_string()));
    }
    if let Some(o) = d.origin().offset {
        extra.push((SOURCE_OFFSET_HEADER, o.to_string()));
    }
    extra
}

#[async_trait]
impl Receiver for KafkaReceiver {
    async fn receive(&self) -> Result<Delivery, BrokerError> {
        let mut one = Vec::with_capacity(1);
        self.receive_batch(1, &mut one).await?;
        one.pop().ok_or(BrokerError::Closed)
    }

    async fn receive_batch(&self, max: usize, into: &mut Vec<Delivery>) -> Result<(), BrokerError> {
        let shared = &*self.shared;
        let max = max.max(1);
        loop {
            if shared.is_stopped() {
                return Err(BrokerError::Closed);
            }
            let mut inbound = shared.inbound.lock().await;
            if inbound.ready.is_empty() {
                match inbound.rx.recv().await {
                    Some(chunk) => inbound.ready.extend(chunk),
                    // Every sender is gone.
                    None => return Err(BrokerError::Closed),
                }
            }
            // More chunks that are already there, without waiting.
            while inbound.ready.len() < max {
                match inbound.rx.try_recv() {
                    Ok(chunk) => inbound.ready.extend(chunk),
                    Err(_) => break,
                }
            }
            let Inbound { ready, kept, .. } = &mut *inbound;
            let taken = ready.len().min(max);
            if taken == 0 {
                // An empty chunk: a poll thread's wake-up on stop.
                continue;
            }
            // One lock for the batch: leave the buffer, count as busy on its partition —
            // or drop a record whose partition was revoked meanwhile (the new owner
            // reads it from the commit).
            {
                let mut s = lock(&shared.state);
                s.queued = s.queued.saturating_sub(taken);
                let bound = buffer_bound(shared.sub.prefetch);
                if s.room_wanted && bound.saturating_sub(s.queued) >= refill_room(bound) {
                    s.room_wanted = false;
                    shared.room.notify_all();
                }
                for record in ready.drain(..taken) {
                    let current = record.info().is_some_and(|info| {
                        match s.parts.get_mut(&(info.client, info.partition)) {
                            Some(part) if part.generation == info.generation && !part.revoking => {
                                part.busy += 1;
                                true
                            }
                            _ => false,
                        }
                    });
                    if current {
                        kept.push(record);
                    }
                }
            }
            // Outside the state lock (the poll threads and settlements take it): the
            // records become deliveries, their messages decoded when first read.
            let kept_any = !kept.is_empty();
            into.extend(kept.drain(..).map(|r| shared.delivery_of(r)));
            if kept_any {
                return Ok(());
            }
        }
    }

    async fn ack(&self, delivery: &Delivery) -> Result<(), BrokerError> {
        delivery.token().check(self.shared.owner)?;
        self.shared.finish(delivery);
        Ok(())
    }

    /// One lock for the batch; the offsets are committed with the poll thread's next
    /// service, like single acks.
    async fn ack_batch(&self, deliveries: &[Delivery]) -> Vec<(usize, BrokerError)> {
        let mut failed = Vec::new();
        let mut s = lock(&self.shared.state);
        for (i, d) in deliveries.iter().enumerate() {
            match d.token().check(self.shared.owner) {
                Ok(_) => self.shared.finish_locked(&mut s, d),
                Err(e) => failed.push((i, e)),
            }
        }
        failed
    }

    async fn retry(&self, delivery: &Delivery, retry: RetryRequest) -> Result<(), BrokerError> {
        let shared = &self.shared;
        delivery.token().check(shared.owner)?;
        if let Some(info) = TokenInfo::of(delivery)
            && shared.blocking(info.client)
        {
            return shared.retry_in_place(delivery, info, retry);
        }
        let tiers = &shared.sub.retry_tiers;
        let delay = tiers
            .get(retry.tier)
            .or(tiers.last())
            .ok_or(BrokerError::Unsupported {
                backend: "kafka",
                what: "retry without retry tiers (no retry topic declared)",
            })?;
        let topic = shared.sub.retry_name(*delay);
        route_produce(
            &shared.inner,
            &topic,
            &retry.message,
            &source_headers(delivery),
        )
        .await?;
        shared.finish(delivery);
        Ok(())
    }

    async fn dead_letter(&self, delivery: &Delivery, dead: Message) -> Result<(), BrokerError> {
        let shared = &self.shared;
        delivery.token().check(shared.owner)?;
        let topic = shared.sub.dead_letter_name();
        route_produce(&shared.inner, &topic, &dead, &[]).await?;
        shared.finish(delivery);
        Ok(())
    }

    async fn release(&self, delivery: &Delivery, delay: Duration) -> Result<(), BrokerError> {
        delivery.token().check(self.shared.owner)?;
        let Some(info) = TokenInfo::of(delivery) else {
            return Err(BrokerError::ForeignDelivery);
        };
        {
            let mut s = lock(&self.shared.state);
            match s.parts.get_mut(&(info.client, info.partition)) {
                Some(part) if part.generation == info.generation => {
                    part.busy = part.busy.saturating_sub(1);
                    s.queued += 1;
                }
                // Revoked meanwhile: uncommitted, the new owner delivers it.
                _ => return Ok(()),
            }
        }
        // The offset stays unfinished (nothing is committed past it); hand the same
        // record out again after the delay.
        let tx = self.shared.tx.clone();
        let again = delivery.clone();
        if delay.is_zero() {
            let _ = tx.send(vec![Record::Ready(Box::new(again))]);
        } else {
            tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                let _ = tx.send(vec![Record::Ready(Box::new(again))]);
            });
        }
        Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_buffer_holds_records_back_then_pauses_until_a_quarter_is_left() {
        let mut flow = Flow::default();
        let t0 = Instant::now();
        let high = buffer_bound(8); // 32
        let refill = refill_room(high); // 8
        assert!(
            !flow.hold_back(high - refill, 8, t0),
            "a refill's room: poll"
        );
        assert!(
            flow.hold_back(high - refill + 1, 8, t0),
            "less than a refill left: hold back, no pause"
        );
        assert!(flow.hold_back(high, 8, t0 + FLOW_PAUSE_AFTER / 2));
        assert!(!flow.paused);
        // Room again before the pause: poll at once, and the clock restarts.
        assert!(!flow.hold_back(high - refill, 8, t0 + FLOW_PAUSE_AFTER / 2));
        assert!(flow.hold_back(high - 1, 8, t0 + FLOW_PAUSE_AFTER));
        assert!(!flow.paused);
        // Held back for longer — also short of full, where a stuck runtime may leave
        // it: pause and poll (events only) ...
        assert!(!flow.hold_back(high - 1, 8, t0 + FLOW_PAUSE_AFTER * 2));
        assert!(flow.paused);
        // ... until the runtime has drained it to a quarter.
        assert!(!flow.hold_back(high / 2, 8, t0 + FLOW_PAUSE_AFTER * 3));
        assert!(flow.paused);
        assert!(!flow.hold_back(high / 4, 8, t0 + FLOW_PAUSE_AFTER * 3));
        assert!(!flow.paused);
    }

    #[test]
    fn the_token_packs_client_partition_offset_and_generation() {
        let info = TokenInfo {
            client: 255,
            partition: i32::MAX,
            offset: 9_000_000_000,
            generation: GENERATION_MASK,
        };
        let owner = ReceiverId::next();
        let d = Delivery::new(Message::new("x"), 1, Origin::default(), info.token(owner));
        assert_eq!(TokenInfo::of(&d), Some(info));
        assert_eq!(d.token().receiver(), owner);
        let wrapped = TokenInfo {
            generation: GENERATION_MASK + 5,
            ..info
        };
        let d = Delivery::new(
            Message::new("x"),
            1,
            Origin::default(),
            wrapped.token(owner),
        );
        assert_eq!(TokenInfo::of(&d).map(|i| i.generation), Some(4));
        let foreign = Delivery::new(
            Message::new("x"),
            1,
            Origin::default(),
            DeliveryToken::new(owner, 7),
        );
        assert_eq!(TokenInfo::of(&foreign), None, "not a Kafka delivery");
    }

    #[test]
    fn counter_metadata_round_trips() {
        assert_eq!(parse_counter("reliq-deliveries:42:3"), Some((42, 3)));
        assert_eq!(parse_counter(""), None);
        assert_eq!(parse_counter("other:1:2"), None);
        assert_eq!(parse_counter("reliq-deliveries:x:2"), None);
    }
}
