//! The poll thread, one per Kafka consumer: each pass serves the consumer's events
//! (rebalances run in them), takes the records librdkafka holds, tracks them and sends
//! them to the runtime as one chunk; at most every [`SERVICE_EVERY`] it also commits,
//! hands out due relay records and pauses or resumes partitions.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use reliq_core::{
    Delivery, Origin,
    seam::{headers, lock},
};

use super::fetch::POLL_BATCH;
use super::fetch::{FetchQueue, KafkaRecord};
use super::flow::{FULL_RECHECK, Flow, RelayHold, buffer_bound, refill_room};
use super::shared::{ConsumerHandle, Ctx, Held, Polled, Record, Role, Shared, State};
use super::token::TokenInfo;
use crate::codec::decode;

/// Longest a poll blocks, so settlements (commits, resumes) are applied promptly.
const POLL_SLICE: Duration = Duration::from_millis(20);
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

/// One poll thread's view for its current pass: the generations of its partitions that
/// take the fast path, and the records of that path waiting to be tracked. The view is
/// refreshed whenever a rebalance ran (rebalance callbacks run inside `poll`, on this
/// thread, so a record is always tagged with the generation it was polled under).
pub(super) struct Pass {
    /// [`Shared::rebalances`] when `fast` was read; `u64::MAX` = read again.
    seen: u64,
    /// (partition, generation) of partitions assigned, not revoking, past their first
    /// record.
    fast: Vec<(i32, u64)>,
    pending: Vec<Polled>,
    /// The poll thread's consumer, for the records it hands out.
    owner: Arc<ConsumerHandle>,
    /// A relay held back at its bound for long ([`RelayHold::pausing`]): a partition
    /// reaching the bound is paused at once.
    relay_pausing: bool,
}

impl Pass {
    fn new(owner: Arc<ConsumerHandle>) -> Self {
        Self {
            seen: u64::MAX,
            fast: Vec::new(),
            pending: Vec::with_capacity(POLL_BATCH),
            owner,
            relay_pausing: false,
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

impl Shared {
    pub(super) fn poll_loop(self: Arc<Self>, client: usize, owned: Arc<ConsumerHandle>) {
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
        let relay = matches!(self.clients[client].role, Role::Relay(_));
        let mut relay_hold = RelayHold::default();
        self.alive(client);
        while !self.is_stopped() {
            self.pass_begins(client, consumer);
            let queued = lock(&self.state).queued;
            let now = Instant::now();
            let hold_back = flow.hold_back(queued, self.sub.prefetch, now);
            if now >= next_service {
                timeout = self.service(client, consumer, flow.paused, relay_hold.pausing, &mut out);
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
            // A relay holding its bound takes nothing until its heads fall due and the
            // service hands them out (see `RelayHold`).
            if relay && relay_hold.hold_back(self.relay_over(client, relay_hold.holding()), now) {
                std::thread::sleep(next_service.saturating_duration_since(now));
                continue;
            }
            pass.relay_pausing = relay_hold.pausing;
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

    /// Whether relay `client` holds its bound of records in a partition; with `already`
    /// (it did), whether one is still above half of it.
    fn relay_over(&self, client: usize, already: bool) -> bool {
        lock(&self.state)
            .parts
            .iter()
            .any(|((c, _), part)| *c == client && part.over_hold(already))
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

    /// Commit what moved, hand out due relay records, pause/resume (every partition
    /// while `flow_paused`; a relay's partitions at their bound while `relay_pausing`).
    /// Returns how long the next poll may block.
    fn service(
        &self,
        client: usize,
        consumer: &BaseConsumer<Ctx>,
        flow_paused: bool,
        relay_pausing: bool,
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
                while !full && let Some(h) = part.take_due(now) {
                    due.push((*p, h));
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
        // Pause every partition while flow control says so, a relay partition while it
        // holds its bound of records not due yet and holding back has lasted, and a
        // blocking-mode partition while its failed record waits for its retry.
        let mut pause = TopicPartitionList::new();
        let mut resume = TopicPartitionList::new();
        let mut next_due: Option<Duration> = None;
        let relay = matches!(self.clients[client].role, Role::Relay(_));
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
                let want = flow_paused
                    || if relay {
                        relay_pausing && part.relay_full()
                    } else {
                        !part.held.is_empty()
                    };
                if want != part.paused {
                    part.paused = want;
                    let list = if want { &mut pause } else { &mut resume };
                    list.add_partition(topic, *p);
                }
            }
        }
        // A pause or resume that failed is asked for again on the next pass: the state
        // says what librdkafka was told, and a partition left paused by a failed resume
        // would hold its records for good.
        for (list, paused, what) in [(&pause, true, "pausing"), (&resume, false, "resuming")] {
            if list.count() == 0 {
                continue;
            }
            let result = if paused {
                consumer.pause(list)
            } else {
                consumer.resume(list)
            };
            if let Err(e) = result {
                tracing::warn!(error = %e, "{what} partitions failed; trying again");
                let mut s = lock(&self.state);
                for element in list.elements() {
                    if let Some(part) = s.parts.get_mut(&(client, element.partition())) {
                        part.paused = !paused;
                    }
                }
            }
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
                part.hold(Held {
                    due,
                    offset,
                    delivery,
                });
                if pass.relay_pausing && !part.paused && part.relay_full() {
                    // Stop fetching: the partition holds its bound of records not due.
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

    /// Where a record of `info.client` came from: its topic (a relay's reports its
    /// source topic), partition and offset (a relay overrides these from the record's
    /// headers).
    pub(super) fn origin(&self, info: TokenInfo) -> Origin {
        Origin {
            destination: self.clients[info.client].origin.clone(),
            partition: Some(info.partition),
            offset: Some(info.offset),
            ..Origin::default()
        }
    }

    /// Track the record's offset and count it as buffered; returns it if it goes to the
    /// stream now (in blocking mode it may wait behind the partition's record that is
    /// out). The caller sends it after releasing the state lock: a send may wake a
    /// worker, and the workers settle under the same lock.
    pub(super) fn track(
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

    pub(super) fn send(&self, chunk: Vec<Record>) {
        if self.tx.send(chunk).is_err() {
            tracing::debug!("receiver gone; records left uncommitted");
        }
    }
}
