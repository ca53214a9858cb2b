//! Receiving from a durable pull consumer and settling deliveries.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, SystemTime};

use async_nats::jetstream::{self, AckKind, consumer::pull};
use async_trait::async_trait;
use futures::{FutureExt, StreamExt};
use reliq_core::headers::{self, Origin};
use reliq_core::{
    BrokerError, Delivery, DeliveryToken, Message, Receiver, ReceiverId, RetryRequest, Subscription,
};
use tokio_util::sync::CancellationToken;

use crate::NatsBroker;
use crate::codec::{
    MSG_ID, ORIGIN_HEADER, SCHEDULE, SCHEDULE_TARGET, copy_origin, from_nats, route_of,
    to_nats_headers,
};
use crate::error::connection;
use crate::names::{dead_letter_subject, retry_due_subject, retry_schedule_subject, stream_name};

/// The ack reliq sends after dead-lettering; its reason marks the termination as reliq's.
const TERM_BY_RELIQ: &[u8] = b"+TERM reliq";

/// The settlement handle kept in each delivery's token.
struct NatsToken {
    acker: Arc<jetstream::message::Acker>,
    /// The ack subject, for a `+TERM` that carries a reason.
    reply: Option<async_nats::Subject>,
    /// Cancelled once settled: stops the in-progress keep-alive.
    settled: CancellationToken,
    /// This delivery's stream message (a retry copy has its own).
    stream_sequence: u64,
    /// The server's delivery count of that stream message.
    delivered: i64,
    /// Stream sequence and subject of the message first consumed (before any retry).
    origin: (u64, String),
}

/// Receives from a durable pull consumer with demand-driven batches: each pull asks for
/// at most `prefetch − outstanding` messages, so the deliveries this receiver holds never
/// exceed the prefetch bound. A retry is scheduled on the server (a `Nats-Schedule` message
/// in the source stream) and the delivery acked, so waiting retries never count against
/// the consumer's `max_ack_pending`; the copy comes due on this consumer's own subject.
pub(crate) struct NatsReceiver {
    /// Stamped on every delivery's token; settling checks it.
    pub(crate) owner: ReceiverId,
    pub(crate) broker: NatsBroker,
    pub(crate) sub: Subscription,
    pub(crate) consumer: jetstream::consumer::Consumer<pull::Config>,
    pub(crate) batch: tokio::sync::Mutex<Option<pull::Batch>>,
    /// Handed out and not yet settled.
    pub(crate) outstanding: Arc<AtomicU32>,
    pub(crate) closed: CancellationToken,
}

impl NatsReceiver {
    fn token<'d>(&self, d: &'d Delivery) -> Result<&'d NatsToken, BrokerError> {
        d.token()
            .check(self.owner)?
            .extra::<NatsToken>()
            .ok_or(BrokerError::ForeignDelivery)
    }

    async fn settle(&self, d: &Delivery, kind: AckKind) -> Result<(), BrokerError> {
        let t = self.token(d)?;
        let result = if self.broker.inner.options.confirm_acks {
            t.acker.double_ack_with(kind).await
        } else {
            t.acker.ack_with(kind).await
        };
        result.map_err(connection(format!(
            "settling ({kind:?}) the message at stream sequence {}",
            t.stream_sequence
        )))?;
        self.settled(t);
        Ok(())
    }

    fn settled(&self, t: &NatsToken) {
        if !t.settled.is_cancelled() {
            t.settled.cancel();
            self.outstanding.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// `+TERM reliq`: terminated by reliq after dead-lettering. The reason lets the
    /// advisory relay tell these from terminations by other clients.
    async fn term_dead_lettered(&self, d: &Delivery) -> Result<(), BrokerError> {
        let t = self.token(d)?;
        let Some(reply) = t.reply.clone() else {
            return self.settle(d, AckKind::Term).await;
        };
        let client = &self.broker.inner.client;
        let body = bytes::Bytes::from_static(TERM_BY_RELIQ);
        if self.broker.inner.options.confirm_acks {
            client
                .request(reply, body)
                .await
                .map_err(connection("terminating a dead-lettered delivery"))?;
        } else {
            client
                .publish(reply, body)
                .await
                .map_err(connection("terminating a dead-lettered delivery"))?;
            client
                .flush()
                .await
                .map_err(connection("flushing a termination"))?;
        }
        self.settled(t);
        Ok(())
    }

    /// A pulled message as a delivery, counted as outstanding; `None` for a status
    /// message or one without JetStream metadata (not a delivery).
    fn take(&self, msg: jetstream::Message) -> Option<Delivery> {
        match self.convert(msg) {
            Ok(d) => {
                self.outstanding.fetch_add(1, Ordering::Relaxed);
                Some(d)
            }
            Err(e) => {
                tracing::debug!(error = %e, "skipping a non-delivery message");
                None
            }
        }
    }

    fn convert(&self, msg: jetstream::Message) -> Result<Delivery, BrokerError> {
        let info = msg.info().map_err(|e| {
            let reason = format!("a pulled message without JetStream metadata: {e}");
            BrokerError::rejected(reason).caused_by(e)
        })?;
        let delivered = info.delivered.max(1);
        let seq = info.stream_sequence;
        let stream = info.stream.to_owned();
        let published: SystemTime = info.published.into();
        let reply = msg.message.reply.clone();
        let (message, acker) = msg.split();
        let acker = Arc::new(acker);
        let fallback = format!("{stream}:{seq}");
        let copied = copy_origin(message.headers.as_ref());
        let reliq_message = from_nats(message.headers.as_ref(), message.payload, fallback);
        // The attempt is the server's delivery count: a retry copy starts where the
        // retried delivery left off (its attempt header) and counts its own redeliveries.
        let attempt = match copied {
            Some(_) => i64::from(headers::attempt(reliq_message.headers())) + delivered - 1,
            None => delivered,
        };
        let attempt = u32::try_from(attempt).unwrap_or(u32::MAX);
        let origin_of_copy = copied.unwrap_or_else(|| (seq, message.subject.to_string()));
        let settled = self.closed.child_token();
        // Keep long handlers leased: +WPI every half lease until settled or closed.
        let keepalive = (acker.clone(), settled.clone(), self.sub.lease / 2);
        tokio::spawn(async move {
            let (acker, settled, every) = keepalive;
            let every = every.max(Duration::from_millis(100));
            loop {
                tokio::select! {
                    _ = settled.cancelled() => break,
                    _ = tokio::time::sleep(every) => {
                        if acker.ack_with(AckKind::Progress).await.is_err() {
                            break;
                        }
                    }
                }
            }
        });
        let origin = Origin {
            destination: self.sub.source.as_str().into(),
            route: route_of(&origin_of_copy.1, &self.sub.source),
            sequence: Some(origin_of_copy.0),
            ..Origin::default()
        };
        let token = DeliveryToken::new(self.owner, seq).with_extra(NatsToken {
            acker,
            reply,
            settled,
            stream_sequence: seq,
            delivered,
            origin: origin_of_copy,
        });
        Ok(Delivery::with_published_at(
            reliq_message,
            attempt,
            origin,
            token,
            published,
        ))
    }
}

#[async_trait]
impl Receiver for NatsReceiver {
    async fn receive(&self) -> Result<Delivery, BrokerError> {
        let mut batch = self.batch.lock().await;
        loop {
            if self.closed.is_cancelled() {
                return Err(BrokerError::Closed);
            }
            if batch.is_none() {
                let held = self.outstanding.load(Ordering::Relaxed);
                let want = self.sub.prefetch.saturating_sub(held).max(1);
                let pull = self
                    .consumer
                    .batch()
                    .max_messages(usize::try_from(want).unwrap_or(1))
                    .expires(Duration::from_secs(5))
                    .messages()
                    .await
                    .map_err(connection(format!(
                        "pulling from consumer `{}`",
                        self.sub.consumer
                    )))?;
                *batch = Some(pull);
            }
            let Some(pull) = batch.as_mut() else { continue };
            match pull.next().await {
                Some(Ok(msg)) => {
                    if let Some(d) = self.take(msg) {
                        return Ok(d);
                    }
                }
                // The pull request is complete or expired: ask again.
                None => *batch = None,
                Some(Err(e)) => {
                    *batch = None;
                    return Err(connection(format!(
                        "pulling from consumer `{}`",
                        self.sub.consumer
                    ))(e));
                }
            }
        }
    }

    /// One delivery (waiting), then what the current pull already brought (never
    /// starting a new pull without waiting for it): a batch handler gets the pull.
    async fn receive_batch(&self, max: usize, into: &mut Vec<Delivery>) -> Result<(), BrokerError> {
        into.push(self.receive().await?);
        let mut batch = self.batch.lock().await;
        let mut taken = 1;
        while taken < max {
            let Some(pull) = batch.as_mut() else { break };
            match pull.next().now_or_never() {
                Some(Some(Ok(msg))) => {
                    if let Some(d) = self.take(msg) {
                        into.push(d);
                        taken += 1;
                    }
                }
                None => break,
                // The pull is complete, expired or failed: the next `receive` pulls again.
                Some(None) => *batch = None,
                Some(Some(Err(e))) => {
                    tracing::warn!(error = %e, "pull failed; pulling again");
                    *batch = None;
                }
            }
        }
        Ok(())
    }

    async fn ack(&self, delivery: &Delivery) -> Result<(), BrokerError> {
        self.settle(delivery, AckKind::Ack).await
    }

    async fn retry(&self, delivery: &Delivery, retry: RetryRequest) -> Result<(), BrokerError> {
        if let Some(faults) = &self.broker.inner.options.faults
            && faults.retry_broken(&self.sub.consumer)
        {
            return Err(BrokerError::connection(
                "retry route broken (fault injection)",
            ));
        }
        let t = self.token(delivery)?;
        let mut h = to_nats_headers(&retry.message);
        // Never early: the schedule's time has millisecond precision.
        let due = SystemTime::now() + retry.delay + Duration::from_millis(1);
        h.insert(SCHEDULE, format!("@at {}", headers::format_time(due)));
        h.insert(SCHEDULE_TARGET, retry_due_subject(&self.sub));
        h.insert(ORIGIN_HEADER, format!("{} {}", t.origin.0, t.origin.1));
        // A producer retry of this publish is dropped; scheduling this delivery's retry
        // again (after a lost ack) replaces the schedule (one per subject).
        h.insert(
            MSG_ID,
            format!(
                "retry:{}:{}:{}",
                stream_name(&self.sub.source),
                t.stream_sequence,
                t.delivered
            ),
        );
        let (_, _, payload, _) = retry.message.into_parts();
        self.broker
            .publish_raw(
                retry_schedule_subject(&self.sub, t.stream_sequence),
                h,
                payload,
            )
            .await?;
        // Confirmed: the retry is stored; only now may the delivery go.
        self.settle(delivery, AckKind::Ack).await
    }

    async fn dead_letter(&self, delivery: &Delivery, dead: Message) -> Result<(), BrokerError> {
        let seq = self.token(delivery)?.stream_sequence;
        let mut h = to_nats_headers(&dead);
        // Idempotent: a redelivery of the same stream message dead-letters to one entry.
        h.insert(
            MSG_ID,
            format!("dl:{}:{seq}", stream_name(&self.sub.source)),
        );
        let (_, _, payload, _) = dead.into_parts();
        self.broker
            .publish_raw(dead_letter_subject(&self.sub), h, payload)
            .await?;
        self.term_dead_lettered(delivery).await
    }

    async fn release(&self, delivery: &Delivery, delay: Duration) -> Result<(), BrokerError> {
        let delay = (!delay.is_zero()).then_some(delay);
        self.settle(delivery, AckKind::Nak(delay)).await
    }

    async fn close(&self) -> Result<(), BrokerError> {
        self.closed.cancel();
        if let Some(mut pull) = self.batch.lock().await.take() {
            // Messages already pulled but never handed out go back at once.
            while let Some(Some(Ok(msg))) = pull.next().now_or_never() {
                let _ = msg.ack_with(AckKind::Nak(None)).await;
            }
        }
        Ok(())
    }
}

impl Drop for NatsReceiver {
    fn drop(&mut self) {
        // Stop every keep-alive: unsettled deliveries come back after `ack_wait`.
        self.closed.cancel();
    }
}
