//! The broker: topics, their consumer groups, and the test hooks.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use async_trait::async_trait;
use reliq_core::{
    Backlog, Broker, BrokerError, Capabilities, Channel, DeadLetters, Destination, LiveObject,
    LiveTopology, Message, ObjectKind, Plan, PlannedObject, Severity, Subscription, Traffic,
    Wanted,
    seam::{Receiver, lock},
};

use crate::dead_letters::MemoryDeadLetters;
use crate::queue::{Entry, FastHash, Queue, Switches};
use crate::receiver::MemoryReceiver;

/// The in-process broker. Cheap to clone (shared state).
#[derive(Clone, Default)]
pub struct MemoryBroker {
    inner: Arc<BrokerInner>,
}

impl std::fmt::Debug for MemoryBroker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryBroker").finish_non_exhaustive()
    }
}

#[derive(Default)]
struct BrokerInner {
    topics: Mutex<HashMap<String, Topic, FastHash>>,
    next_receiver: AtomicU64,
    switches: Switches,
}

#[derive(Default)]
struct Topic {
    groups: HashMap<String, Arc<Queue>, FastHash>,
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

    /// The fault switches this broker's receivers consult (feature `test-util`): make
    /// a consumer's retries or dead-lettering fail.
    #[cfg(feature = "test-util")]
    pub fn faults(&self) -> &reliq_core::seam::Faults {
        &self.inner.switches
    }

    /// Messages in `sub`'s queue: (ready + delayed, unsettled); none for a group that
    /// does not exist (feature `test-util`).
    #[cfg(feature = "test-util")]
    pub fn depth(&self, sub: &Subscription) -> (usize, usize) {
        self.existing_group(sub).map_or((0, 0), |g| g.depth())
    }

    /// Messages in `sub`'s dead-letter queue, ready or unsettled (feature `test-util`).
    #[cfg(feature = "test-util")]
    pub fn dead_letter_depth(&self, sub: &Subscription) -> usize {
        let group = self.existing_group(sub);
        group.and_then(|g| g.dlq.clone()).map_or(0, |d| {
            let (waiting, unsettled) = d.depth();
            waiting + unsettled
        })
    }

    /// Every topic, group queue (`<topic>.<group>`) and dead-letter queue, sorted (for
    /// tests that check an operation created nothing; feature `test-util`).
    #[cfg(feature = "test-util")]
    pub fn object_names(&self) -> Vec<String> {
        let mut names = Vec::new();
        for (topic, t) in self.topics().iter() {
            names.push(topic.clone());
            for queue in t.groups.values() {
                names.push(queue.name.clone());
                names.extend(queue.dlq.as_ref().map(|d| d.name.clone()));
            }
        }
        names.sort();
        names
    }

    fn topics(&self) -> MutexGuard<'_, HashMap<String, Topic, FastHash>> {
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
        let id = self.inner.next_receiver.fetch_add(1, Ordering::Relaxed);
        MemoryReceiver::new(queue, id, sub, self.inner.switches.clone())
    }
}

const FILTER: &str = "filter";
const DELIVERY_LIMIT: &str = "delivery limit";

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
            filters: true,
            retries_counted_apart: true,
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
        // Looked up, never made: a look at an unknown consumer's DLQ creates nothing.
        let group = self.existing_group(subscription).ok_or_else(|| {
            subscription
                .missing_dead_letters(format_args!("queue `{}`", subscription.dead_letter_name()))
        })?;
        let dlq = group.dlq.clone().ok_or(BrokerError::Unsupported {
            backend: "memory",
            what: "dead letters of a dead-letter queue",
        })?;
        Ok(Box::new(MemoryDeadLetters { dlq }))
    }

    /// The group's queue (its filter and delivery limit are fixed by the first
    /// subscription that made it) and its DLQ.
    async fn plan(&self, subscription: &Subscription) -> Result<Plan, BrokerError> {
        let queue = format!("{}.{}", subscription.source, subscription.consumer);
        Ok(Plan::new("memory", subscription)
            .with(
                PlannedObject::new(ObjectKind::Queue, queue, "consumer queue")
                    .with(
                        FILTER,
                        Wanted::equals(subscription.filter.clone().unwrap_or_else(|| "#".into())),
                        Severity::Breaking,
                        "the group receives other messages than its subscription asks for",
                    )
                    .with(
                        DELIVERY_LIMIT,
                        Wanted::equals(subscription.delivery_limit),
                        Severity::Breaking,
                        "a crash loop is dead-lettered at another count",
                    )
                    // Producers publish to the topic; its groups' queues hold it (retries
                    // wait in the queue too).
                    .carrying(Channel::new(Traffic::Source, &subscription.source)),
            )
            .with(
                PlannedObject::new(
                    ObjectKind::Queue,
                    subscription.dead_letter_name(),
                    "the DLQ",
                )
                .carrying(Channel::new(
                    Traffic::DeadLetters,
                    subscription.dead_letter_name(),
                )),
            ))
    }

    async fn inspect(
        &self,
        subscription: &Subscription,
        _plan: &Plan,
    ) -> Result<LiveTopology, BrokerError> {
        let mut live = LiveTopology::default();
        if let Some(queue) = self.existing_group(subscription) {
            let filter = queue.filter.clone().unwrap_or_else(|| "#".into());
            let mut object = LiveObject::default().with(FILTER, reliq_core::Found::own(filter));
            if let Some(limit) = queue.delivery_limit {
                object = object.with(DELIVERY_LIMIT, reliq_core::Found::own(limit));
            }
            live.push(ObjectKind::Queue, queue.name.clone(), object);
            if let Some(dlq) = &queue.dlq {
                live.push(ObjectKind::Queue, dlq.name.clone(), LiveObject::default());
            }
        }
        Ok(live)
    }

    /// In process: always reachable.
    async fn ping(&self) -> Result<(), BrokerError> {
        Ok(())
    }

    /// Ready messages, unsettled deliveries, and the delayed ones (retries, and the
    /// runtime's delayed releases after a failed settle) as retries in place.
    async fn backlog(&self, subscription: &Subscription) -> Result<Backlog, BrokerError> {
        let queue = self
            .existing_group(subscription)
            .ok_or_else(|| BrokerError::Unroutable(subscription.source.clone()))?;
        let now = tokio::time::Instant::now();
        let state = queue.lock();
        // Due entries move to ready only when a receiver looks: count them as waiting.
        let due = state.delayed.iter().filter(|d| d.0.due <= now).count();
        Ok(Backlog::waiting((state.ready.len() + due) as u64)
            .with_in_flight(Some(state.unacked.len() as u64))
            .with_retries((state.delayed.len() - due) as u64))
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

#[cfg(test)]
mod tests {
    use super::*;

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
