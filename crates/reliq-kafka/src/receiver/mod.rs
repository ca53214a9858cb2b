//! The receiving side: one poll thread per Kafka consumer (the source's group, one relay
//! per retry tier), all feeding one stream of deliveries, with
//! per-partition offset tracking, pause-based flow control and the crash-loop counter.
//!
//! - `poll`: the poll thread and its passes, and its periodic service (commits, due
//!   relay records, pauses);
//! - `flow`: the bound of the buffer ahead of the runtime, and flow control;
//! - `rebalance`: assignments and revocations;
//! - `counter`: the crash-loop counter (delivery limit);
//! - `shared`: the state they share, and a poll thread's consumer, kept alive by the
//!   records it handed out;
//! - `receive`: the runtime's end of the stream;
//! - `settle`: ack, retry, dead-letter, release;
//! - `token`: which record a delivery is.

mod counter;
mod fetch;
mod flow;
mod frozen;
mod poll;
mod rebalance;
mod receive;
mod settle;
mod shared;
mod token;
mod tracker;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::Duration;

use async_trait::async_trait;
use rdkafka::consumer::{BaseConsumer, Consumer};
use reliq_core::{
    BrokerError, Delivery, Message, Subscription,
    seam::{Receiver, ReceiverId, RetryRequest, lock},
};
use tokio::sync::mpsc;

use self::shared::{Client, ClientConsumer, ConsumerHandle, Ctx, Inbound, Role, Shared, State};
use self::token::MAX_CLIENTS;
use crate::client::Inner;
use crate::error::KafkaError;
use crate::names::relay_group;
use crate::options::RetryMode;
use crate::stale_tiers::stale_tiers;

/// How long `subscribe` waits for the source consumer's first partition assignment.
const ASSIGN_WAIT: Duration = Duration::from_secs(10);

/// How long a subscribe keeps asking for the old retry tiers through a lost connection
/// or a metadata request that timed out (a node down or electing: chaos round W's
/// consumer, restarted during a node loss, exited on one such timeout).
const STALE_TIERS_WAIT: Duration = Duration::from_secs(60);

/// [`stale_tiers`], asked again after connection errors and timeouts for up to
/// [`STALE_TIERS_WAIT`].
async fn stale_tiers_through_outage(
    inner: &Arc<Inner>,
    sub: &Subscription,
    current: &[String],
) -> Result<Vec<crate::stale_tiers::StaleTier>, BrokerError> {
    reliq_core::through_outage(
        &format!("listing the old retry tiers of `{}`", sub.consumer),
        reliq_core::OutageWait::up_to(STALE_TIERS_WAIT),
        BrokerError::is_unreachable,
        || stale_tiers(inner, sub, current),
    )
    .await
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
            for stale in stale_tiers_through_outage(&inner, sub, &current).await? {
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
        // librdkafka's `session.timeout.ms` as configured (reliq's default or the URL's).
        let session_timeout = clients
            .first()
            .and_then(|c| {
                inner
                    .config
                    .consumer(&c.group, sub.prefetch)
                    .get("session.timeout.ms")
                    .and_then(|ms| ms.parse::<u64>().ok())
            })
            .map_or(Duration::from_secs(45), Duration::from_millis);
        let clients_count = clients.len();
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
            session_timeout,
            alive_at: (0..clients_count).map(|_| AtomicU64::new(0)).collect(),
            epoch: std::time::Instant::now(),
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
