//! A receiver: one channel per receiver, `basic.qos(prefetch)`, `basic.consume` with
//! manual ack; retry and dead-letter copies go out on the broker's confirmed publishers
//! (dead letters on the dead-letter stream's own channel).

use reliq_core::{
    BrokerError, Delivery, Message, Origin, Subscription,
    seam::{DeliveryToken, Receiver, ReceiverId, RetryRequest, headers, lock},
};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use async_trait::async_trait;
use futures::{FutureExt, StreamExt};
use lapin::Channel;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions};
use lapin::types::FieldTable;
use tokio::sync::Mutex;

use crate::client::{Inner, Target};
use crate::dead_letters::declaring;
use crate::names::{Names, short};
use crate::{codec, error::RabbitError, topology};

struct Live {
    consumer: lapin::Consumer,
    generation: u64,
}

type SettleChannel = Arc<StdMutex<Option<(Channel, u64)>>>;

/// A receiver: one channel, `basic.qos(prefetch)`, `basic.consume` with manual ack.
pub(crate) struct RabbitReceiver {
    /// Stamped on every delivery's token; settling checks it.
    owner: ReceiverId,
    inner: Arc<Inner>,
    sub: Subscription,
    names: Names,
    /// Stops the landing-queue relay when dropped.
    relay: StdMutex<Option<crate::dead_letters::RelayStop>>,
    live: Mutex<Option<Live>>,
    /// The channel deliveries are settled on, with its generation (bumped on reopen).
    settle: SettleChannel,
    generation: AtomicU64,
    closed: AtomicBool,
}

/// How long starting a receiver retries its declarations through a lost connection: a
/// node restarted in a rolling restart, or one closing connections with 541 while it
/// recovers, can take longer than 30 s (a chaos round's restarted consumer gave up
/// after 30 s of both and exited).
const START_THROUGH_NODE_LOSS: Duration = Duration::from_secs(120);

impl RabbitReceiver {
    /// A receiver of `sub`'s queue, consuming, with the relay that moves what the broker
    /// dead-letters into the landing queue on to the dead-letter stream.
    pub(crate) async fn start(inner: Arc<Inner>, sub: &Subscription) -> Result<Self, BrokerError> {
        let rx = Self {
            relay: StdMutex::new(None),
            inner,
            sub: sub.clone(),
            names: Names::of(sub),
            live: Mutex::new(None),
            settle: Arc::new(StdMutex::new(None)),
            owner: ReceiverId::next(),
            generation: AtomicU64::new(0),
            closed: AtomicBool::new(false),
        };
        // A node lost while the topology is declared closes the connection under the
        // declare: wait for the reconnect (to another node of the URL) and declare again,
        // as a running receiver does, rather than fail the consumer's start.
        let live = reliq_core::through_outage(
            &format!("subscribing to queue `{}` (a node lost?)", rx.queue()),
            reliq_core::OutageWait::up_to(START_THROUGH_NODE_LOSS),
            |e| matches!(e, BrokerError::Connection { .. }),
            || rx.open(),
        )
        .await?;
        *rx.live.lock().await = Some(live);
        *lock(&rx.relay) = Some(crate::dead_letters::spawn_relay(
            rx.inner.clone(),
            sub.clone(),
        ));
        Ok(rx)
    }

    fn queue(&self) -> &str {
        &self.names.queue
    }

    /// Open a channel, declare the topology, set the prefetch, start consuming.
    async fn open(&self) -> Result<Live, BrokerError> {
        let ch = self.inner.channel().await?;
        declaring(
            &self.inner,
            &self.names,
            topology::declare_all(&ch, &self.sub, &self.inner.opts, &self.inner.store),
        )
        .await?;
        self.inner.known_exchange(&self.names.exchange);
        let prefetch = u16::try_from(self.sub.prefetch.max(1)).unwrap_or(u16::MAX);
        ch.basic_qos(prefetch, BasicQosOptions::default())
            .await
            .map_err(|e| RabbitError::client("basic.qos", e))?;
        let consumer = ch
            .basic_consume(
                short("queue", self.queue())?,
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(|e| RabbitError::client("basic.consume", e))?;
        let generation = self.generation.fetch_add(1, Ordering::SeqCst) + 1;
        *lock(&self.settle) = Some((ch, generation));
        tracing::debug!(queue = self.queue(), prefetch, generation, "consuming");
        Ok(Live {
            consumer,
            generation,
        })
    }

    /// The consumer's channel failed (`error`) or the broker cancelled the consumer
    /// (`None`): forget it, so the next `receive` opens a new one.
    fn consumer_lost(&self, live: &mut Option<Live>, error: Option<lapin::Error>) {
        if !self.closed.load(Ordering::SeqCst) {
            match error {
                Some(e) => {
                    tracing::warn!(queue = self.queue(), error = %e, "consumer channel lost; reopening");
                }
                None => {
                    tracing::warn!(
                        queue = self.queue(),
                        "consumer cancelled by the broker; resuming"
                    );
                }
            }
        }
        *live = None;
    }

    fn delivery(&self, d: lapin::message::Delivery, generation: u64) -> Delivery {
        let message = codec::message(&d.properties, &d.data);
        let origin = if d.exchange.as_str() == self.names.exchange {
            Origin {
                destination: self.names.exchange.as_str().into(),
                route: Some(d.routing_key.as_str().to_owned()).filter(|r| !r.is_empty()),
                ..Origin::default()
            }
        } else {
            // Came back from a retry queue or a replay (default exchange): the copy
            // carries where it first came from.
            Origin {
                destination: message
                    .headers()
                    .get(headers::ORIGINAL_DESTINATION)
                    .unwrap_or(&self.names.exchange)
                    .into(),
                route: message
                    .headers()
                    .get(headers::ORIGINAL_ROUTE)
                    .map(str::to_owned),
                ..Origin::default()
            }
        };
        let attempt = headers::attempt(message.headers());
        Delivery::new(
            message,
            attempt,
            origin,
            DeliveryToken::new(self.owner, d.delivery_tag)
                .with_lane(i64::try_from(generation).unwrap_or(i64::MAX)),
        )
    }

    /// The channel `delivery` came on, if it is still open.
    fn channel_of(&self, delivery: &Delivery) -> Result<Channel, BrokerError> {
        let token = delivery.token().check(self.owner)?;
        let guard = lock(&self.settle);
        match guard.as_ref() {
            Some((ch, generation))
                if i64::try_from(*generation).ok() == Some(token.lane())
                    && ch.status().connected() =>
            {
                Ok(ch.clone())
            }
            _ => Err(BrokerError::NotHeld(
                "the channel this delivery came on is closed; RabbitMQ delivers it again".into(),
            )),
        }
    }

    /// Bounded like a publish (`confirm_timeout`): an ack that cannot be written (a
    /// blocked or silently dead connection) fails, and the settle is tried again.
    async fn ack_on(&self, ch: &Channel, delivery: &Delivery) -> Result<(), BrokerError> {
        let bound = self.inner.opts.confirm_timeout;
        tokio::time::timeout(
            bound,
            ch.basic_ack(delivery.token().tag(), BasicAckOptions::default()),
        )
        .await
        .map_err(|_| BrokerError::Timeout(bound))?
        .map_err(|e| RabbitError::client("basic.ack", e))
    }
}

#[async_trait]
impl Receiver for RabbitReceiver {
    async fn receive(&self) -> Result<Delivery, BrokerError> {
        let mut live = self.live.lock().await;
        let mut failures = 0u32;
        loop {
            if self.closed.load(Ordering::SeqCst) {
                return Err(BrokerError::Closed);
            }
            let Some(l) = live.as_mut() else {
                match self.open().await {
                    Ok(l) => {
                        tracing::info!(
                            queue = self.queue(),
                            "consuming again after a channel loss"
                        );
                        *live = Some(l);
                    }
                    Err(e @ BrokerError::Config { .. }) => return Err(e),
                    Err(e) => {
                        failures += 1;
                        if failures >= self.inner.opts.reconnect.max_failures.max(1) {
                            return Err(BrokerError::connection(format!(
                                "gave up resuming the consumer of `{}` after {failures} attempts: {e}",
                                self.queue()
                            )));
                        }
                        let wait = self.inner.opts.reconnect.delay(failures);
                        tracing::warn!(error = %e, failures, retry_in = ?wait, "resuming the consumer failed");
                        tokio::time::sleep(wait).await;
                    }
                }
                continue;
            };
            match l.consumer.next().await {
                Some(Ok(d)) => return Ok(self.delivery(d, l.generation)),
                Some(Err(e)) => self.consumer_lost(&mut live, Some(e)),
                None => self.consumer_lost(&mut live, None),
            }
        }
    }

    /// One delivery (waiting), then whatever the channel already holds (up to the
    /// prefetch, never waiting): a batch handler gets what the broker pushed.
    async fn receive_batch(&self, max: usize, into: &mut Vec<Delivery>) -> Result<(), BrokerError> {
        into.push(self.receive().await?);
        let mut live = self.live.lock().await;
        for _ in 1..max {
            let Some(l) = live.as_mut() else { break };
            match l.consumer.next().now_or_never() {
                Some(Some(Ok(d))) => into.push(self.delivery(d, l.generation)),
                // Nothing buffered: the batch is what arrived.
                None => break,
                // Lost or cancelled: the next `receive` reopens, as it would have.
                Some(Some(Err(e))) => self.consumer_lost(&mut live, Some(e)),
                Some(None) => self.consumer_lost(&mut live, None),
            }
        }
        Ok(())
    }

    async fn ack(&self, delivery: &Delivery) -> Result<(), BrokerError> {
        let ch = self.channel_of(delivery)?;
        self.ack_on(&ch, delivery).await
    }

    async fn retry(&self, delivery: &Delivery, retry: RetryRequest) -> Result<(), BrokerError> {
        let ch = self.channel_of(delivery)?;
        let (_, queue) = self
            .names
            .retry
            .get(retry.tier)
            .or_else(|| self.names.retry.last())
            .ok_or_else(|| BrokerError::Config {
                field: "retry_tiers".into(),
                reason: "the subscription declared no retry tiers".into(),
            })?;
        let mut copy = retry.message;
        let origin = delivery.origin();
        let h = copy.headers_mut();
        h.insert(headers::ORIGINAL_DESTINATION, &*origin.destination);
        match &origin.route {
            Some(r) => h.insert(headers::ORIGINAL_ROUTE, r.clone()),
            None => drop(h.remove(headers::ORIGINAL_ROUTE)),
        }
        self.inner
            .publish_to("", queue, &copy, Target::Queue("retry queue", queue))
            .await?;
        self.ack_on(&ch, delivery).await
    }

    async fn dead_letter(&self, delivery: &Delivery, dead: Message) -> Result<(), BrokerError> {
        let ch = self.channel_of(delivery)?;
        let parking = &self.names.parking;
        self.inner
            .publish_to(
                "",
                parking,
                &dead,
                Target::Stream("dead-letter stream", parking),
            )
            .await?;
        self.ack_on(&ch, delivery).await
    }

    async fn release(&self, delivery: &Delivery, delay: Duration) -> Result<(), BrokerError> {
        let ch = self.channel_of(delivery)?;
        let tag = delivery.token().tag();
        let nack = BasicNackOptions {
            requeue: true,
            ..BasicNackOptions::default()
        };
        if delay.is_zero() {
            return ch
                .basic_nack(tag, nack)
                .await
                .map_err(|e| RabbitError::client("basic.nack", e));
        }
        // RabbitMQ cannot delay a requeue: keep the delivery unacked for `delay`, then
        // nack it. If the channel closes meanwhile, the broker requeues it anyway.
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            if ch.status().connected()
                && let Err(e) = ch.basic_nack(tag, nack).await
            {
                tracing::debug!(error = %e, "delayed release failed; the channel is gone");
            }
        });
        Ok(())
    }

    async fn close(&self) -> Result<(), BrokerError> {
        self.closed.store(true, Ordering::SeqCst);
        drop(lock(&self.relay).take());
        let ch = lock(&self.settle).take();
        if let Some((ch, _)) = ch
            && ch.status().connected()
        {
            ch.close(200, "reliq receiver closed".into())
                .await
                .map_err(|e| RabbitError::client("channel.close", e))?;
        }
        Ok(())
    }
}

impl Drop for RabbitReceiver {
    /// Closing the channel returns every unacked delivery to the queue.
    fn drop(&mut self) {
        self.closed.store(true, Ordering::SeqCst);
        let ch = lock(&self.settle).take();
        if let (Some((ch, _)), Ok(rt)) = (ch, tokio::runtime::Handle::try_current())
            && ch.status().connected()
        {
            rt.spawn(async move {
                let _ = ch.close(200, "reliq receiver dropped".into()).await;
            });
        }
    }
}
