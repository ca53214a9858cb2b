//! A receiver: one member of a consumer group, reading the group's queue.

use std::cmp::Reverse;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use reliq_core::{
    BrokerError, Clock, DeadLetter, DeadLetterReason, Delivery, Message, Origin, Subscription,
    seam::{DeliveryPool, DeliveryToken, Receiver, ReceiverId, RetryRequest, headers},
};
use tokio::time::Instant;

use crate::queue::{Delayed, Entry, Queue, QueueState, Switches, Unacked};

/// One member of a consumer group: hands out the group's messages, at most `prefetch`
/// unsettled at a time, each leased for `lease`.
pub(crate) struct MemoryReceiver {
    queue: Arc<Queue>,
    id: u64,
    owner: ReceiverId,
    prefetch: u32,
    lease: Duration,
    consumer: String,
    clock: Clock,
    /// Recycles the deliveries' allocations (see [`DeliveryPool`]).
    pool: DeliveryPool,
    #[cfg_attr(not(feature = "test-util"), allow(dead_code))]
    switches: Switches,
}

/// What [`MemoryReceiver::take_ready`] found.
enum Taken {
    /// At least one delivery.
    Some,
    /// None ready; the instant something becomes due, if anything will.
    NoneUntil(Option<Instant>),
}

impl MemoryReceiver {
    /// Receiver number `id` of `queue`, with `sub`'s prefetch and lease.
    pub(crate) fn new(queue: Arc<Queue>, id: u64, sub: &Subscription, switches: Switches) -> Self {
        let prefetch = sub.prefetch.max(1) as usize;
        // Room for twice what this receiver may hold: a hash table whose settled entries
        // (tombstones) fill it past half grows — allocates — instead of rehashing in
        // place, which a steady stream of deliveries would otherwise hit now and then.
        queue.lock().unacked.reserve(2 * prefetch);
        Self {
            queue,
            id,
            owner: ReceiverId::next(),
            prefetch: sub.prefetch.max(1),
            lease: sub.lease,
            consumer: sub.consumer.clone(),
            clock: Clock::new(),
            // Twice the prefetch: a settled delivery's last clone may drop after the
            // next one is handed out.
            pool: DeliveryPool::new(2 * prefetch),
            switches,
        }
    }

    /// Put `dead` on `dlq`, unless a test broke dead-lettering for this consumer.
    fn push_dead(&self, dlq: &Queue, dead: Message) -> Result<(), BrokerError> {
        #[cfg(feature = "test-util")]
        if self.switches.dead_letter_broken(&self.consumer) {
            return Err(BrokerError::rejected(format!(
                "dead-letter queue `{}` is unavailable",
                dlq.name
            )));
        }
        dlq.push_dead(dead);
        Ok(())
    }

    /// The queue's tag of `d`, if this receiver handed it out.
    fn tag(&self, d: &Delivery) -> Result<u64, BrokerError> {
        Ok(d.token().check(self.owner)?.tag())
    }

    fn take(&self, s: &mut QueueState, tag: u64) -> Result<Unacked, BrokerError> {
        let u = s.unacked.remove(&tag).ok_or_else(|| {
            BrokerError::NotHeld(format!(
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

    /// Append up to `max` (at least one) ready deliveries to `into`, under one lock.
    fn take_ready(&self, max: usize, into: &mut Vec<Delivery>) -> Taken {
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
            Taken::Some
        } else {
            Taken::NoneUntil(next_due)
        }
    }

    /// Acknowledge `deliveries` under one lock, with one wake-up; the failures by index.
    fn ack_now(&self, deliveries: &[Delivery]) -> Vec<(usize, BrokerError)> {
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
                match self.push_dead(dlq, dead) {
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
            let delivery = self.pool.delivery(
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
            match self.take_ready(max, into) {
                Taken::Some => return Ok(()),
                Taken::NoneUntil(Some(due)) => {
                    tokio::select! {
                        _ = &mut notified => {}
                        _ = tokio::time::sleep_until(due) => {}
                    }
                }
                Taken::NoneUntil(None) => notified.await,
            }
        }
    }

    fn try_receive_batch(&self, max: usize, into: &mut Vec<Delivery>) -> bool {
        matches!(self.take_ready(max, into), Taken::Some)
    }

    async fn ack(&self, delivery: &Delivery) -> Result<(), BrokerError> {
        self.take(&mut self.queue.lock(), self.tag(delivery)?)?;
        self.queue.notify.notify_waiters();
        Ok(())
    }

    async fn ack_batch(&self, deliveries: &[Delivery]) -> Vec<(usize, BrokerError)> {
        self.ack_now(deliveries)
    }

    fn try_ack_batch(&self, deliveries: &[Delivery]) -> Option<Vec<(usize, BrokerError)>> {
        Some(self.ack_now(deliveries))
    }

    async fn retry(&self, delivery: &Delivery, retry: RetryRequest) -> Result<(), BrokerError> {
        #[cfg(feature = "test-util")]
        if self.switches.retry_broken(&self.consumer) {
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
                return Err(BrokerError::NotHeld(
                    "delivery is unknown or already settled (its lease ended?)".into(),
                ));
            }
        }
        // Confirmed copy first, then settle the source.
        self.push_dead(dlq, dead)?;
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
    use reliq_core::{Broker, Destination};

    use super::*;
    use crate::broker::MemoryBroker;

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
}
