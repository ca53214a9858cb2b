//! The receiver's shared state, which its poll threads, its runtime end and the consumer
//! contexts all hold: the consumers' clients and roles, the per-partition state, the
//! records on their way, and a poll thread's consumer ([`ConsumerHandle`]). The types
//! refer to each other (a record keeps its consumer, whose context points back at the
//! state), so they live here together; what they do is in the sibling modules.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, Weak};
use std::time::{Duration, SystemTime};

use rdkafka::consumer::{BaseConsumer, Consumer};
use reliq_core::{BrokerError, Delivery, Message, Subscription, seam::ReceiverId};
use tokio::sync::mpsc;

use super::fetch::{FetchQueue, Fetched, RecordOwner};
use super::token::{GENERATION_MASK, TokenInfo};
use super::tracker::OffsetTracker;
use crate::client::Inner;
use crate::codec::decode;
use crate::options::RetryMode;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Role {
    Source,
    Relay(Duration),
}

pub(super) struct Client {
    pub(super) topic: String,
    /// Where this client's records come from, as deliveries report it: the topic itself,
    /// or for a relay the source topic. Shared, not copied per record.
    pub(super) origin: Arc<str>,
    pub(super) group: String,
    pub(super) role: Role,
}

/// A record as librdkafka handed it out, not decoded yet. The poll thread — the serial
/// stage of the receive path — only tracks its offset; the receive loop makes it a
/// delivery whose message is decoded when first read
/// ([`LazyRecord`](self::fetch::LazyRecord)), on whichever thread reads it.
///
/// The message refers to its consumer's internals ([`Fetched`]); `owner` keeps that
/// consumer alive as long as the record (see [`ConsumerHandle`]).
pub(super) struct Polled {
    pub(super) message: Fetched,
    pub(super) info: TokenInfo,
    pub(super) owner: Arc<ConsumerHandle>,
}

/// What the poll threads hand to the receive loop.
pub(super) enum Record {
    /// Decoded on the poll thread: relay and blocking-mode records, a partition's first
    /// record (crash-loop counter), records handed out again after a release. Boxed:
    /// the rare case, and chunks of small records are cheaper to allocate and move.
    Ready(Box<Delivery>),
    /// The fast path: decoded by the receive loop.
    Polled(Polled),
}

impl Record {
    pub(super) fn info(&self) -> Option<TokenInfo> {
        match self {
            Record::Ready(d) => TokenInfo::of(d),
            Record::Polled(p) => Some(p.info),
        }
    }
}

pub(super) struct Held {
    pub(super) due: SystemTime,
    pub(super) offset: i64,
    pub(super) delivery: Delivery,
}

pub(super) struct Part {
    pub(super) generation: u64,
    pub(super) tracker: OffsetTracker,
    /// Handed to the runtime and not yet settled or released.
    pub(super) busy: usize,
    pub(super) revoking: bool,
    pub(super) paused: bool,
    /// Relay records waiting for their due time (head first); in blocking mode, the
    /// failed record waiting for its retry.
    pub(super) held: VecDeque<Held>,
    /// Payload bytes in `held`.
    pub(super) held_bytes: usize,
    /// Blocking mode: a record of this partition is with the runtime (or held for its
    /// retry); later records wait in `waiting`.
    pub(super) out: bool,
    /// Blocking mode: records read behind the one that is out, in offset order.
    pub(super) waiting: VecDeque<(i64, Delivery)>,
    /// Blocking mode: a retry was requested; the poll thread drops `waiting` and seeks
    /// back to its first offset.
    pub(super) rewind: bool,
    /// The committed position when the partition was assigned.
    pub(super) head: Option<i64>,
    /// The counter found in the commit metadata: (offset, deliveries).
    pub(super) head_count: Option<(i64, u32)>,
    pub(super) counted: bool,
}

impl Part {
    pub(super) fn new(generation: u64, head: Option<i64>, head_count: Option<(i64, u32)>) -> Self {
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
    pub(super) fn hold(&mut self, h: Held) {
        self.held_bytes += h.delivery.payload().len();
        self.held.push_back(h);
    }

    /// The head held record if it is due at `now`.
    pub(super) fn take_due(&mut self, now: SystemTime) -> Option<Held> {
        if self.held.front()?.due > now {
            return None;
        }
        let h = self.held.pop_front()?;
        self.held_bytes = self.held_bytes.saturating_sub(h.delivery.payload().len());
        Some(h)
    }

    /// A relay partition's fetch should be paused for what it holds (see [`RELAY_HOLD`]):
    /// at the bound, and until it is down to half.
    pub(super) fn relay_full(&self) -> bool {
        self.over_hold(self.paused)
    }

    /// What the partition holds is at [`RELAY_HOLD`] / [`RELAY_HOLD_BYTES`]; with
    /// `already` (over it before), above half of them.
    pub(super) fn over_hold(&self, already: bool) -> bool {
        let (records, bytes) = if already {
            (RELAY_HOLD / 2 + 1, RELAY_HOLD_BYTES / 2 + 1)
        } else {
            (RELAY_HOLD, RELAY_HOLD_BYTES)
        };
        self.held.len() >= records || self.held_bytes >= bytes
    }
}

#[derive(Default)]
pub(super) struct State {
    /// Per (client, partition). A fast hasher: the poll thread and the settlements look a
    /// partition up for every record, and the keys are not attacker-chosen.
    pub(super) parts: HashMap<(usize, i32), Part, foldhash::fast::RandomState>,
    /// Deliveries pushed to the stream and not yet taken by the runtime: the buffer
    /// ahead of the runtime, bounded by flow control.
    pub(super) queued: usize,
    pub(super) next_generation: u64,
    /// A poll thread waits on [`Shared::room`] for the buffer to drain.
    pub(super) room_wanted: bool,
}

pub(super) struct Shared {
    /// Stamped on every delivery's token; settling checks it.
    pub(super) owner: ReceiverId,
    pub(super) inner: Arc<Inner>,
    pub(super) sub: Subscription,
    pub(super) clients: Vec<Client>,
    pub(super) state: Mutex<State>,
    /// Signalled when the runtime takes records from a full buffer.
    pub(super) room: Condvar,
    /// Counts assignments and revocations (see [`Pass`](poll::Pass)).
    pub(super) rebalances: AtomicU64,
    /// To the runtime, in chunks: all a poll pass handed out, one send (and at most one
    /// wake-up) per pass.
    pub(super) tx: mpsc::UnboundedSender<Vec<Record>>,
    /// The runtime's end of `tx`. Here rather than in the receiver: a poll thread locks
    /// it to purge its undecoded records before it drops its consumer ([`Polled`]).
    pub(super) inbound: tokio::sync::Mutex<Inbound>,
    pub(super) stop: AtomicBool,
    pub(super) crashed: AtomicBool,
    pub(super) runtime: tokio::runtime::Handle,
    /// The consumers' group session (`session.timeout.ms`): a poll thread silent for
    /// longer was frozen, and its member may be a zombie (see `frozen`).
    pub(super) session_timeout: Duration,
    /// Per client: when its poll thread last ran, in ms since `epoch`.
    pub(super) alive_at: Vec<AtomicU64>,
    pub(super) epoch: std::time::Instant,
}

/// The runtime's end of the stream: chunks from the poll threads, and what is left of
/// the chunks last taken from.
pub(super) struct Inbound {
    pub(super) rx: mpsc::UnboundedReceiver<Vec<Record>>,
    pub(super) ready: VecDeque<Record>,
    /// The records one receive keeps, between the state lock and decoding (reused).
    pub(super) kept: Vec<Record>,
}

impl Shared {
    pub(super) fn is_stopped(&self) -> bool {
        self.stop.load(Ordering::SeqCst)
    }

    /// Whether `client` retries in place, one record per partition at a time.
    pub(super) fn blocking(&self, client: usize) -> bool {
        self.clients[client].role == Role::Source
            && self.inner.config.retry_mode == RetryMode::Blocking
    }
}

/// A poll thread's consumer context (its rebalance callbacks are in `rebalance`).
pub(super) struct Ctx {
    pub(super) shared: Weak<Shared>,
    pub(super) client: usize,
    /// The consumer's fetch queue, once made (it needs the consumer's handle).
    pub(super) fetch: OnceLock<Weak<FetchQueue>>,
    /// OAUTHBEARER tokens reliq makes (AWS MSK IAM), if any.
    pub(super) tokens: crate::oauth::TokenSource,
}

/// A poll thread's consumer and its fetch queue. The queue is declared first: it goes
/// before the consumer it refers to.
pub(super) struct ClientConsumer {
    pub(super) fetch: Arc<FetchQueue>,
    pub(super) consumer: BaseConsumer<Ctx>,
}

/// A poll thread's consumer, shared with every record it hands out.
///
/// librdkafka destroys a consumer only after all of its messages, and a delivery holds
/// its record until it is dropped (its message is decoded on demand,
/// [`LazyRecord`](super::fetch::LazyRecord)) — possibly after the receiver is gone, if a
/// handler keeps it. So the poll thread *closes* its consumer when it stops (final
/// commit, group leave: nothing waits for the deliveries), and the handle *destroys* it
/// with the last reference, the poll thread's or a record's.
pub(super) struct ConsumerHandle {
    /// `None` only while dropping.
    pub(super) client: Option<ClientConsumer>,
    /// The consumer's topic (for the fallback id of a record without one).
    pub(super) topic: String,
}

impl ConsumerHandle {
    pub(super) fn get(&self) -> &ClientConsumer {
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
    pub(super) fn new(consumer: BaseConsumer<Ctx>) -> Result<Self, BrokerError> {
        // SAFETY: the handle is the consumer's, which `Self` drops after the queue.
        #[allow(unsafe_code)]
        let fetch = unsafe { FetchQueue::new(consumer.client().native_ptr()) }
            .map(Arc::new)
            .ok_or_else(|| BrokerError::Other("librdkafka could not make a queue".into()))?;
        let _ = consumer.context().fetch.set(Arc::downgrade(&fetch));
        Ok(Self { fetch, consumer })
    }
}
