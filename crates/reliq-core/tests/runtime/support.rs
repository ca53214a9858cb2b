//! What the runtime tests share: waits in virtual time, draining a dead-letter queue, and
//! the [`Misbehaving`] wrapper backend that bends the `receive_batch` contract.

use std::sync::Arc;
use std::time::Duration;

use reliq_core::{DeadLetter, Delivery, Destination, Message, Subscription};
use reliq_memory::MemoryBroker;

pub fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

pub async fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + secs(600);
    while !cond() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

pub async fn dead_letters(
    broker: &MemoryBroker,
    consumer: &str,
    topic: &str,
) -> Vec<(reliq_core::Message, DeadLetter)> {
    use reliq_core::Broker;
    let dlq = broker
        .dead_letters(&Subscription::new(consumer, topic))
        .await
        .unwrap();
    let entries = reliq_conformance::browse_all(dlq.as_ref()).await.unwrap();
    let ids: Vec<_> = entries.iter().map(|e| e.id().clone()).collect();
    assert_eq!(dlq.remove(&ids).await.unwrap().len(), ids.len());
    entries
        .into_iter()
        .map(|e| {
            let r = e.record().unwrap();
            (e.message, r)
        })
        .collect()
}

/// How a [`Misbehaving`] backend's receivers bend the `receive_batch` contract.
#[derive(Clone, Copy)]
pub enum How {
    /// Ask the broker for three more than the runtime asked for (with a prefetch three
    /// higher, so it hands them out).
    Greedy,
    /// Take one delivery, then wait for more forever (a receive the stop cuts short).
    TakeOneThenHang,
    /// Receive as asked once, then panic in the next receive (a backend's bug).
    PanicAfterFirst,
}

/// The memory broker, with receivers that misbehave as `how` says.
pub struct Misbehaving {
    pub inner: Arc<MemoryBroker>,
    pub how: How,
}

impl Misbehaving {
    /// A fresh embedded broker, and the same broker behind receivers that misbehave as
    /// `how` says.
    pub fn over_memory(how: How) -> (Arc<MemoryBroker>, Arc<Self>) {
        let memory = Arc::new(MemoryBroker::new());
        let inner = memory.clone();
        (memory, Arc::new(Self { inner, how }))
    }
}

/// Declare `builder`'s queue on `memory`, publish `payloads` to its topic `topic`, then
/// start the consumer with a handler that succeeds.
pub async fn filled_and_started(
    memory: &MemoryBroker,
    builder: reliq_core::ConsumerBuilder,
    topic: &str,
    payloads: impl IntoIterator<Item = String>,
) -> (Subscription, reliq_core::ConsumerHandle) {
    use reliq_core::Broker;
    let sub = builder.subscription().unwrap();
    drop(memory.subscribe(&sub).await.unwrap());
    for p in payloads {
        memory
            .publish(&Destination::new(topic), Message::new(p))
            .await
            .unwrap();
    }
    let handle = builder
        .start(|_d: Delivery| async { Ok::<(), reliq_core::BoxError>(()) })
        .await
        .unwrap();
    (sub, handle)
}

struct MisbehavingReceiver {
    inner: Box<dyn reliq_core::seam::Receiver>,
    how: How,
    receives: std::sync::atomic::AtomicU32,
}

#[async_trait::async_trait]
impl reliq_core::Broker for Misbehaving {
    fn kind(&self) -> &'static str {
        "misbehaving"
    }
    fn capabilities(&self) -> reliq_core::Capabilities {
        self.inner.capabilities()
    }
    async fn ping(&self) -> Result<(), reliq_core::BrokerError> {
        self.inner.ping().await
    }
    async fn publish(&self, d: &Destination, m: Message) -> Result<(), reliq_core::BrokerError> {
        self.inner.publish(d, m).await
    }
    async fn subscribe(
        &self,
        s: &Subscription,
    ) -> Result<Box<dyn reliq_core::seam::Receiver>, reliq_core::BrokerError> {
        let mut s = s.clone();
        if let How::Greedy = self.how {
            // Room for the extra deliveries on the broker's side.
            s.prefetch += 3;
        }
        Ok(Box::new(MisbehavingReceiver {
            inner: self.inner.subscribe(&s).await?,
            how: self.how,
            receives: std::sync::atomic::AtomicU32::new(0),
        }))
    }
    async fn dead_letters(
        &self,
        s: &Subscription,
    ) -> Result<Box<dyn reliq_core::DeadLetters>, reliq_core::BrokerError> {
        self.inner.dead_letters(s).await
    }
    async fn backlog(
        &self,
        s: &Subscription,
    ) -> Result<reliq_core::Backlog, reliq_core::BrokerError> {
        self.inner.backlog(s).await
    }

    async fn plan(&self, s: &Subscription) -> Result<reliq_core::Plan, reliq_core::BrokerError> {
        self.inner.plan(s).await
    }

    async fn inspect(
        &self,
        s: &Subscription,
        plan: &reliq_core::Plan,
    ) -> Result<reliq_core::LiveTopology, reliq_core::BrokerError> {
        self.inner.inspect(s, plan).await
    }
}

#[async_trait::async_trait]
impl reliq_core::seam::Receiver for MisbehavingReceiver {
    async fn receive(&self) -> Result<Delivery, reliq_core::BrokerError> {
        self.inner.receive().await
    }
    async fn receive_batch(
        &self,
        max: usize,
        into: &mut Vec<Delivery>,
    ) -> Result<(), reliq_core::BrokerError> {
        match self.how {
            How::Greedy => self.inner.receive_batch(max + 3, into).await,
            How::TakeOneThenHang => {
                into.push(self.inner.receive().await?);
                std::future::pending::<()>().await;
                Ok(())
            }
            How::PanicAfterFirst => {
                let before = self
                    .receives
                    .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                assert_eq!(before, 0, "receive_batch: a backend's bug");
                self.inner.receive_batch(max, into).await
            }
        }
    }
    async fn ack(&self, d: &Delivery) -> Result<(), reliq_core::BrokerError> {
        self.inner.ack(d).await
    }
    async fn retry(
        &self,
        d: &Delivery,
        r: reliq_core::seam::RetryRequest,
    ) -> Result<(), reliq_core::BrokerError> {
        self.inner.retry(d, r).await
    }
    async fn dead_letter(&self, d: &Delivery, m: Message) -> Result<(), reliq_core::BrokerError> {
        self.inner.dead_letter(d, m).await
    }
    async fn release(&self, d: &Delivery, delay: Duration) -> Result<(), reliq_core::BrokerError> {
        self.inner.release(d, delay).await
    }
}
