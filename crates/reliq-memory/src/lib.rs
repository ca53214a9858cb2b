//! # reliq-memory
//!
//! The embedded, in-process broker: the default backend for tests and local runs. It is
//! not a router — it keeps the semantics a production broker has, so code tested on it
//! behaves the same on Kafka, RabbitMQ, NATS or SQS:
//!
//! - **topics with consumer groups**: every group gets every message published to the
//!   topic (filtered by route pattern); members of one group share the group's queue;
//! - **confirmed publish**: `publish` returns once the message is queued for every
//!   matching group; a topic nobody declared, or a route no group matches, is an error;
//! - **ack / release / leases**: an unsettled delivery comes back after its lease, or at
//!   once when its receiver is dropped (a crashed consumer);
//! - **durable delayed retry** on a timer (exact delay), a **per-consumer dead-letter
//!   queue**, and a **delivery limit** that moves a crash-looping message to the DLQ with
//!   reason `max-deliveries`;
//! - **bounded prefetch** per receiver.
//!
//! All timing uses tokio's clock, so it runs under `tokio::time::pause()`: a 5-minute
//! retry schedule is tested in milliseconds.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use reliq_core::{Broker, Destination, Message, Subscription};
//! let broker = Arc::new(reliq_memory::MemoryBroker::new());
//! let rx = broker.subscribe(&Subscription::new("billing", "orders")).await?;
//! broker.publish(&Destination::new("orders"), Message::new("hello")).await?;
//! let d = rx.receive().await?;
//! assert_eq!(d.payload(), b"hello");
//! rx.ack(&d).await?;
//! # Ok(()) }
//! ```

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use reliq_core::headers::{self, DeadLetter, DeadLetterReason, Origin};
use reliq_core::{
    Broker, BrokerError, Capabilities, Clock, Cursor, DeadLetterCount, DeadLetterEntry,
    DeadLetterPage, DeadLetters, Delivery, DeliveryToken, Destination, Message, MessageId,
    Receiver, ReceiverId, RetryRequest, Subscription,
};
use tokio::sync::Notify;
use tokio::time::Instant;

/// The in-process broker. Cheap to clone (shared state).
#[derive(Clone, Default)]
pub struct MemoryBroker {
    inner: Arc<BrokerInner>,
}

#[derive(Default)]
struct BrokerInner {
    topics: Mutex<HashMap<String, Topic>>,
    next_receiver: AtomicU64,
}

#[derive(Default)]
struct Topic {
    groups: HashMap<String, Arc<Queue>>,
}

impl MemoryBroker {
    /// An empty broker.
    pub fn new() -> Self {
        Self::default()
    }

    /// Declare a topic so it accepts publishes before any consumer exists (messages
    /// published to a topic with no matching group are still unroutable).
    pub fn declare_topic(&self, topic: &str) {
        self.topics().entry(topic.to_owned()).or_default();
    }

    /// Fault injection and inspection for tests.
    pub fn faults(&self) -> Faults {
        Faults {
            broker: self.clone(),
        }
    }

    fn topics(&self) -> MutexGuard<'_, HashMap<String, Topic>> {
        lock(&self.inner.topics)
    }

    /// The queue of `sub`'s group, declared if missing.
    fn group(&self, sub: &Subscription) -> Arc<Queue> {
        let mut topics = self.topics();
        let topic = topics.entry(sub.source.clone()).or_default();
        topic
            .groups
            .entry(sub.consumer.clone())
            .or_insert_with(|| {
                let dlq = Arc::new(Queue::new(
                    sub.dead_letter_name(),
                    sub.source.clone(),
                    None,
                    None,
                    None,
                ));
                Arc::new(Queue::new(
                    format!("{}.{}", sub.source, sub.consumer),
                    sub.source.clone(),
                    sub.filter.clone(),
                    Some(sub.delivery_limit),
                    Some(dlq),
                ))
            })
            .clone()
    }

    fn existing_group(&self, sub: &Subscription) -> Option<Arc<Queue>> {
        self.topics()
            .get(&sub.source)
            .and_then(|t| t.groups.get(&sub.consumer))
            .cloned()
    }

    fn receiver(&self, queue: Arc<Queue>, sub: &Subscription) -> MemoryReceiver {
        MemoryReceiver {
            queue,
            id: self.inner.next_receiver.fetch_add(1, Ordering::Relaxed),
            owner: ReceiverId::next(),
            prefetch: sub.prefetch.max(1),
            lease: sub.lease,
            consumer: sub.consumer.clone(),
            clock: Clock::new(),
        }
    }
}

#[async_trait]
impl Broker for MemoryBroker {
    fn kind(&self) -> &'static str {
        "memory"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            rejects_unroutable: true,
            exact_retry_delay: true,
            delivery_limit: true,
            consumer_redelivery: true,
            attempts_count_every_delivery: false,
            deduplicates_publishes: false,
        }
    }

    async fn publish(
        &self,
        destination: &Destination,
        message: Message,
    ) -> Result<(), BrokerError> {
        let queues: Vec<Arc<Queue>> = {
            let topics = self.topics();
            let topic = topics
                .get(&destination.topic)
                .ok_or_else(|| BrokerError::Unroutable(destination.to_string()))?;
            topic
                .groups
                .values()
                .filter(|q| q.accepts(destination.route.as_deref()))
                .cloned()
                .collect()
        };
        if queues.is_empty() {
            return Err(BrokerError::Unroutable(destination.to_string()));
        }
        let last = queues.len() - 1;
        let mut message = Some(message);
        for (i, q) in queues.iter().enumerate() {
            let m = if i == last {
                message.take()
            } else {
                message.clone()
            };
            if let Some(m) = m {
                q.push(Entry::new(m, destination.route.clone()));
            }
        }
        Ok(())
    }

    async fn subscribe(
        &self,
        subscription: &Subscription,
    ) -> Result<Box<dyn Receiver>, BrokerError> {
        let queue = self.group(subscription);
        Ok(Box::new(self.receiver(queue, subscription)))
    }

    async fn dead_letters(
        &self,
        subscription: &Subscription,
    ) -> Result<Box<dyn DeadLetters>, BrokerError> {
        let group = self.group(subscription);
        let dlq = group.dlq.clone().ok_or(BrokerError::Unsupported {
            backend: "memory",
            what: "dead letters of a dead-letter queue",
        })?;
        Ok(Box::new(MemoryDeadLetters { dlq }))
    }

    async fn send_to_consumer(
        &self,
        subscription: &Subscription,
        message: Message,
    ) -> Result<(), BrokerError> {
        let queue = self
            .existing_group(subscription)
            .ok_or_else(|| BrokerError::Unroutable(subscription.source.clone()))?;
        queue.push(Entry::new(message, None));
        Ok(())
    }
}

/// Test hooks: make routes fail, look at queue depths.
pub struct Faults {
    broker: MemoryBroker,
}

impl Faults {
    /// Make `sub`'s dead-letter queue refuse (or accept again) new messages.
    pub fn set_dead_letter_available(&self, sub: &Subscription, available: bool) {
        if let Some(dlq) = self.broker.group(sub).dlq.clone() {
            dlq.available.store(available, Ordering::SeqCst);
        }
    }

    /// Make `sub`'s retry route refuse (or accept again) retries.
    pub fn set_retry_available(&self, sub: &Subscription, available: bool) {
        self.broker
            .group(sub)
            .retry_available
            .store(available, Ordering::SeqCst);
    }

    /// Messages in `sub`'s queue: (ready + delayed, unsettled).
    pub fn depth(&self, sub: &Subscription) -> (usize, usize) {
        let q = self.broker.group(sub);
        let s = q.lock();
        (s.ready.len() + s.delayed.len(), s.unacked.len())
    }

    /// Messages in `sub`'s dead-letter queue (ready + unsettled).
    pub fn dead_letter_depth(&self, sub: &Subscription) -> usize {
        self.broker
            .group(sub)
            .dlq
            .as_ref()
            .map(|d| {
                let s = d.lock();
                s.ready.len() + s.unacked.len()
            })
            .unwrap_or(0)
    }
}

struct Entry {
    message: Message,
    route: Option<String>,
    deliveries: u32,
    /// Position in its queue, set when pushed (a dead-letter browse cursor).
    seq: u64,
}

impl Entry {
    fn new(message: Message, route: Option<String>) -> Self {
        Self {
            message,
            route,
            deliveries: 0,
            seq: 0,
        }
    }
}

struct Delayed {
    due: Instant,
    seq: u64,
    entry: Entry,
}

impl PartialEq for Delayed {
    fn eq(&self, other: &Self) -> bool {
        (self.due, self.seq) == (other.due, other.seq)
    }
}
impl Eq for Delayed {}
impl PartialOrd for Delayed {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Delayed {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.due, self.seq).cmp(&(other.due, other.seq))
    }
}

struct Unacked {
    delivery: Delivery,
    route: Option<String>,
    deliveries: u32,
    lease_until: Instant,
    receiver: u64,
}

#[derive(Default)]
struct QueueState {
    ready: VecDeque<Entry>,
    delayed: BinaryHeap<Reverse<Delayed>>,
    unacked: HashMap<u64, Unacked>,
    held: HashMap<u64, u32>,
    next_tag: u64,
    next_seq: u64,
    /// No unacked lease ends before this (it may be earlier than the true minimum after
    /// acks); leases are scanned only once it passes, not on every receive.
    next_lease_due: Option<Instant>,
}

struct Queue {
    name: String,
    /// The source topic, shared with every delivery's origin (not copied per delivery).
    topic: Arc<str>,
    filter: Option<String>,
    delivery_limit: Option<u32>,
    dlq: Option<Arc<Queue>>,
    state: Mutex<QueueState>,
    notify: Notify,
    available: AtomicBool,
    retry_available: AtomicBool,
}

impl Queue {
    fn new(
        name: String,
        topic: String,
        filter: Option<String>,
        delivery_limit: Option<u32>,
        dlq: Option<Arc<Queue>>,
    ) -> Self {
        Self {
            name,
            topic: topic.into(),
            filter,
            delivery_limit,
            dlq,
            state: Mutex::new(QueueState::default()),
            notify: Notify::new(),
            available: AtomicBool::new(true),
            retry_available: AtomicBool::new(true),
        }
    }

    fn lock(&self) -> MutexGuard<'_, QueueState> {
        lock(&self.state)
    }

    fn accepts(&self, route: Option<&str>) -> bool {
        match (&self.filter, route) {
            (None, _) => true,
            (Some(pattern), Some(route)) => route_matches(pattern, route),
            (Some(pattern), None) => pattern == "#",
        }
    }

    fn push(&self, mut entry: Entry) {
        {
            let mut s = self.lock();
            s.next_seq += 1;
            entry.seq = s.next_seq;
            s.ready.push_back(entry);
        }
        self.notify.notify_waiters();
    }

    /// Put a dead letter on this (dead-letter) queue, if it is available.
    fn push_dead(&self, message: Message) -> Result<(), BrokerError> {
        if !self.available.load(Ordering::SeqCst) {
            return Err(BrokerError::rejected(format!(
                "dead-letter queue `{}` is unavailable",
                self.name
            )));
        }
        self.push(Entry::new(message, None));
        Ok(())
    }
}

/// Matches AMQP-style topic patterns: words separated by `.`, `*` = one word, `#` = zero
/// or more words.
fn route_matches(pattern: &str, route: &str) -> bool {
    fn go(p: &[&str], r: &[&str]) -> bool {
        match (p.first(), r.first()) {
            (None, None) => true,
            (Some(&"#"), _) => go(&p[1..], r) || (!r.is_empty() && go(p, &r[1..])),
            (Some(&"*"), Some(_)) => go(&p[1..], &r[1..]),
            (Some(a), Some(b)) if a == b => go(&p[1..], &r[1..]),
            _ => false,
        }
    }
    let p: Vec<&str> = pattern.split('.').collect();
    let r: Vec<&str> = route.split('.').collect();
    go(&p, &r)
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every critical section here leaves the state consistent even if a panic
    // unwinds through it (single pushes/removes), so a poisoned lock is usable.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A consumer's dead-letter queue, read in place: entries stay in the queue in the order
/// they arrived; the cursor is the position of the last entry read.
struct MemoryDeadLetters {
    dlq: Arc<Queue>,
}

impl MemoryDeadLetters {
    fn entry(e: &Entry) -> DeadLetterEntry {
        DeadLetterEntry {
            message: e.message.clone(),
            position: format!("position {}", e.seq),
        }
    }
}

#[async_trait]
impl DeadLetters for MemoryDeadLetters {
    async fn browse(&self, from: &Cursor, max: usize) -> Result<DeadLetterPage, BrokerError> {
        let after: u64 = match from.as_str() {
            None => 0,
            Some(text) => text.parse().map_err(|_| BrokerError::Config {
                field: "cursor".into(),
                reason: format!("`{text}` is not a memory dead-letter cursor (a position)"),
            })?,
        };
        let s = self.dlq.lock();
        let mut entries = Vec::new();
        let mut last = after;
        let mut at_end = true;
        for e in s.ready.iter().filter(|e| e.seq > after) {
            if entries.len() == max {
                at_end = false;
                break;
            }
            entries.push(Self::entry(e));
            last = e.seq;
        }
        Ok(DeadLetterPage {
            entries,
            next: Cursor::from(last.to_string()),
            at_end,
        })
    }

    async fn get(&self, id: &MessageId) -> Result<Option<DeadLetterEntry>, BrokerError> {
        let s = self.dlq.lock();
        Ok(s.ready
            .iter()
            .find(|e| e.message.id() == id)
            .map(Self::entry))
    }

    async fn remove(&self, ids: &[MessageId]) -> Result<Vec<MessageId>, BrokerError> {
        let mut wanted = reliq_core::dead_letters::IdCounts::new(ids);
        let mut s = self.dlq.lock();
        let mut removed = Vec::new();
        s.ready.retain(|e| {
            let take = wanted.take(e.message.id());
            if take {
                removed.push(e.message.id().clone());
            }
            !take
        });
        Ok(removed)
    }

    async fn count(&self) -> Result<DeadLetterCount, BrokerError> {
        let s = self.dlq.lock();
        let mut count = DeadLetterCount {
            count: s.ready.len() as u64,
            oldest_dead_lettered_at: None,
        };
        for e in &s.ready {
            count.note(e.message.headers());
        }
        Ok(count)
    }
}

struct MemoryReceiver {
    queue: Arc<Queue>,
    id: u64,
    owner: ReceiverId,
    prefetch: u32,
    lease: Duration,
    consumer: String,
    clock: Clock,
}

impl MemoryReceiver {
    /// The queue's tag of `d`, if this receiver handed it out.
    fn tag(&self, d: &Delivery) -> Result<u64, BrokerError> {
        Ok(d.token().check(self.owner)?.tag())
    }

    fn take(&self, s: &mut QueueState, tag: u64) -> Result<Unacked, BrokerError> {
        let u = s.unacked.remove(&tag).ok_or_else(|| {
            BrokerError::rejected(format!(
                "delivery {tag} on `{}` is unknown or already settled (lease expired?)",
                self.queue.name
            ))
        })?;
        if let Some(h) = s.held.get_mut(&u.receiver) {
            *h = h.saturating_sub(1);
        }
        Ok(u)
    }

    /// Move due retries to ready and expired leases back to the head; return the next
    /// instant something becomes due.
    fn housekeeping(&self, s: &mut QueueState, now: Instant) -> Option<Instant> {
        while s.delayed.peek().is_some_and(|Reverse(d)| d.due <= now) {
            if let Some(Reverse(d)) = s.delayed.pop() {
                s.ready.push_back(d.entry);
            }
        }
        if s.next_lease_due.is_some_and(|due| due <= now) {
            self.expire_leases(s, now);
        }
        let next_delayed = s.delayed.peek().map(|Reverse(d)| d.due);
        match (next_delayed, s.next_lease_due) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Return deliveries whose lease ended to the head of the queue; recompute the next
    /// lease end.
    fn expire_leases(&self, s: &mut QueueState, now: Instant) {
        let mut expired: Vec<u64> = s
            .unacked
            .iter()
            .filter(|(_, u)| u.lease_until <= now)
            .map(|(t, _)| *t)
            .collect();
        expired.sort_unstable();
        for tag in expired.into_iter().rev() {
            if let Some(u) = s.unacked.remove(&tag) {
                if let Some(h) = s.held.get_mut(&u.receiver) {
                    *h = h.saturating_sub(1);
                }
                tracing::debug!(queue = %self.queue.name, tag, "lease expired; redelivering");
                s.ready.push_front(Entry {
                    message: u.delivery.message().clone(),
                    route: u.route,
                    deliveries: u.deliveries,
                    seq: 0,
                });
            }
        }
        s.next_lease_due = s.unacked.values().map(|u| u.lease_until).min();
    }

    fn try_deliver(&self, s: &mut QueueState, now: Instant) -> Option<Delivery> {
        if s.held.get(&self.id).copied().unwrap_or(0) >= self.prefetch {
            return None;
        }
        while let Some(mut entry) = s.ready.pop_front() {
            entry.deliveries += 1;
            if let (Some(limit), Some(dlq)) = (self.queue.delivery_limit, &self.queue.dlq)
                && entry.deliveries > limit
            {
                // The crash-loop safety net: the message was handed out `limit` times
                // and never settled.
                let mut dead = entry.message.clone();
                DeadLetter {
                    reason: DeadLetterReason::MaxDeliveries,
                    error_class: None,
                    error: None,
                    attempts: headers::attempt(entry.message.headers()),
                    first_failure_at: None,
                    dead_lettered_at: self.clock.now(),
                    consumer: self.consumer.clone(),
                    origin: Origin {
                        destination: self.queue.topic.clone(),
                        route: entry.route.clone(),
                        ..Origin::default()
                    },
                }
                .write(dead.headers_mut());
                match dlq.push_dead(dead) {
                    Ok(()) => {
                        tracing::warn!(queue = %self.queue.name, id = %entry.message.id(),
                            deliveries = limit, "delivery limit reached; moved to the dead-letter queue");
                        continue;
                    }
                    Err(e) => {
                        // Like a quorum queue with at-least-once dead-lettering: keep it.
                        tracing::warn!(error = %e, "delivery limit reached but the DLQ refuses; holding the message");
                        entry.deliveries -= 1;
                        s.ready.push_front(entry);
                        return None;
                    }
                }
            }
            let tag = s.next_tag;
            s.next_tag += 1;
            let attempt = headers::attempt(entry.message.headers());
            let delivery = Delivery::new(
                entry.message,
                attempt,
                Origin {
                    destination: self.queue.topic.clone(),
                    route: entry.route.clone(),
                    ..Origin::default()
                },
                DeliveryToken::new(self.owner, tag),
            );
            let lease_until = now + self.lease;
            if s.next_lease_due.is_none_or(|due| lease_until < due) {
                s.next_lease_due = Some(lease_until);
            }
            s.unacked.insert(
                tag,
                Unacked {
                    delivery: delivery.clone(),
                    route: entry.route,
                    deliveries: entry.deliveries,
                    lease_until,
                    receiver: self.id,
                },
            );
            *s.held.entry(self.id).or_insert(0) += 1;
            return Some(delivery);
        }
        None
    }
}

#[async_trait]
impl Receiver for MemoryReceiver {
    async fn receive(&self) -> Result<Delivery, BrokerError> {
        let mut one = Vec::with_capacity(1);
        self.receive_batch(1, &mut one).await?;
        one.pop().ok_or(BrokerError::Closed)
    }

    async fn receive_batch(&self, max: usize, into: &mut Vec<Delivery>) -> Result<(), BrokerError> {
        loop {
            let notified = self.queue.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let next_due = {
                let mut s = self.queue.lock();
                let now = Instant::now();
                let next_due = self.housekeeping(&mut s, now);
                let before = into.len();
                while into.len() - before < max.max(1) {
                    match self.try_deliver(&mut s, now) {
                        Some(d) => into.push(d),
                        None => break,
                    }
                }
                if into.len() > before {
                    return Ok(());
                }
                next_due
            };
            match next_due {
                Some(due) => {
                    tokio::select! {
                        _ = &mut notified => {}
                        _ = tokio::time::sleep_until(due) => {}
                    }
                }
                None => notified.await,
            }
        }
    }

    async fn ack(&self, delivery: &Delivery) -> Result<(), BrokerError> {
        self.take(&mut self.queue.lock(), self.tag(delivery)?)?;
        self.queue.notify.notify_waiters();
        Ok(())
    }

    /// One lock and one wake-up for the whole batch.
    async fn ack_batch(&self, deliveries: &[Delivery]) -> Vec<(usize, BrokerError)> {
        let failed: Vec<(usize, BrokerError)> = {
            let mut s = self.queue.lock();
            (deliveries.iter().enumerate())
                .filter_map(|(i, d)| {
                    let taken = self.tag(d).and_then(|tag| self.take(&mut s, tag));
                    taken.err().map(|e| (i, e))
                })
                .collect()
        };
        self.queue.notify.notify_waiters();
        failed
    }

    async fn retry(&self, delivery: &Delivery, retry: RetryRequest) -> Result<(), BrokerError> {
        if !self.queue.retry_available.load(Ordering::SeqCst) {
            return Err(BrokerError::rejected(format!(
                "retry route of `{}` is unavailable",
                self.queue.name
            )));
        }
        {
            let mut s = self.queue.lock();
            let u = self.take(&mut s, self.tag(delivery)?)?;
            let seq = s.next_seq;
            s.next_seq += 1;
            s.delayed.push(Reverse(Delayed {
                due: Instant::now() + retry.delay,
                seq,
                entry: Entry::new(retry.message, u.route),
            }));
        }
        self.queue.notify.notify_waiters();
        Ok(())
    }

    async fn dead_letter(&self, delivery: &Delivery, dead: Message) -> Result<(), BrokerError> {
        let dlq = self.queue.dlq.as_ref().ok_or(BrokerError::Unsupported {
            backend: "memory",
            what: "dead-lettering from a dead-letter queue",
        })?;
        {
            let s = self.queue.lock();
            if !s.unacked.contains_key(&self.tag(delivery)?) {
                return Err(BrokerError::rejected(
                    "delivery is unknown or already settled",
                ));
            }
        }
        // Confirmed copy first, then settle the source.
        dlq.push_dead(dead)?;
        self.take(&mut self.queue.lock(), self.tag(delivery)?)?;
        self.queue.notify.notify_waiters();
        Ok(())
    }

    async fn release(&self, delivery: &Delivery, delay: Duration) -> Result<(), BrokerError> {
        {
            let mut s = self.queue.lock();
            let u = self.take(&mut s, self.tag(delivery)?)?;
            let entry = Entry {
                message: u.delivery.message().clone(),
                route: u.route,
                deliveries: u.deliveries,
                seq: 0,
            };
            if delay.is_zero() {
                s.ready.push_front(entry);
            } else {
                let seq = s.next_seq;
                s.next_seq += 1;
                s.delayed.push(Reverse(Delayed {
                    due: Instant::now() + delay,
                    seq,
                    entry,
                }));
            }
        }
        self.queue.notify.notify_waiters();
        Ok(())
    }
}

impl Drop for MemoryReceiver {
    /// A dropped receiver is a dead consumer: its unsettled deliveries go back to the
    /// head of the queue at once (their delivery counts kept).
    fn drop(&mut self) {
        let mut s = self.queue.lock();
        let mut mine: Vec<u64> = s
            .unacked
            .iter()
            .filter(|(_, u)| u.receiver == self.id)
            .map(|(t, _)| *t)
            .collect();
        mine.sort_unstable();
        for tag in mine.into_iter().rev() {
            if let Some(u) = s.unacked.remove(&tag) {
                s.ready.push_front(Entry {
                    message: u.delivery.message().clone(),
                    route: u.route,
                    deliveries: u.deliveries,
                    seq: 0,
                });
            }
        }
        s.held.remove(&self.id);
        drop(s);
        self.queue.notify.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topic_patterns() {
        assert!(route_matches("order.*", "order.created"));
        assert!(!route_matches("order.*", "order.created.eu"));
        assert!(route_matches("order.#", "order.created.eu"));
        assert!(route_matches("#", "anything.at.all"));
        assert!(route_matches("order.created", "order.created"));
        assert!(!route_matches("order.created", "order.deleted"));
    }

    #[tokio::test(start_paused = true)]
    async fn lease_expiry_redelivers() {
        let broker = MemoryBroker::new();
        let mut sub = Subscription::new("g", "t");
        sub.lease = Duration::from_secs(10);
        let rx = broker.subscribe(&sub).await.unwrap();
        broker
            .publish(&Destination::new("t"), Message::new("x"))
            .await
            .unwrap();
        let first = rx.receive().await.unwrap();
        let t0 = Instant::now();
        let again = rx.receive().await.unwrap();
        assert!(t0.elapsed() >= Duration::from_secs(10));
        assert_eq!(first.id(), again.id());
        assert!(
            rx.ack(&first).await.is_err(),
            "the expired lease cannot be acked"
        );
        rx.ack(&again).await.unwrap();
    }

    #[tokio::test]
    async fn unroutable_publish_fails() {
        let broker = MemoryBroker::new();
        let err = broker
            .publish(&Destination::new("nope"), Message::new("x"))
            .await
            .unwrap_err();
        assert!(matches!(err, BrokerError::Unroutable(_)));
    }
}
