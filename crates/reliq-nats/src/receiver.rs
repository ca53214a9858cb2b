//! Receiving from a durable pull consumer and settling deliveries.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant, SystemTime};

use async_nats::StatusCode;
use async_nats::jetstream::{self, AckKind, consumer::pull};
use async_trait::async_trait;
use futures::{FutureExt, StreamExt};
use reliq_core::{
    BrokerError, Delivery, Message, Origin, Subscription,
    seam::{DeliveryToken, Receiver, ReceiverId, Renewed, RetryRequest, headers, keep_leased},
};
use tokio_util::sync::CancellationToken;

use crate::client::NatsBroker;
use crate::codec::{
    MSG_ID, ORIGIN_HEADER, SCHEDULE, SCHEDULE_TARGET, copy_origin, from_nats, route_of,
    to_nats_headers,
};
use crate::error::connection;
use crate::names::{retry_due_subject, retry_schedule_subject, stream_name};

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

/// Receives from a durable pull consumer with demand-driven pull requests: each asks for
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
    pub(crate) pulls: tokio::sync::Mutex<Pulls>,
    /// Handed out and not yet settled.
    pub(crate) outstanding: Arc<AtomicU32>,
    pub(crate) closed: CancellationToken,
}

/// How long the server keeps a pull request open when no message comes.
const PULL_EXPIRES: Duration = Duration::from_secs(5);
/// How long past its expiry a pull request is taken as ended when its end (a 408 status)
/// never arrives.
const PULL_END_GRACE: Duration = Duration::from_secs(5);
/// A message given back after close waits this much past the open request's expiry.
const GIVE_BACK_MARGIN: Duration = Duration::from_millis(250);

/// Every pull request of one receiver answers on one inbox, subscribed for the receiver's
/// whole life. A per-request subscription (async-nats' `Batch`) is dropped when its stream
/// ends or its future is cancelled, and a message the server sends for that request in
/// the meantime is lost to the client and waits out the lease (ack wait). Here nothing is
/// unsubscribed while a request can still deliver; `close` reads the inbox until the open
/// request ends and gives back what arrives — with a NAK delay that outlasts the request,
/// since the server redelivers a NAKed message at once to a waiting request, which is
/// still ours: given back without it, a message bounces between the server and the closed
/// receiver until its delivery limit dead-letters it.
pub(crate) struct Pulls {
    inbox: async_nats::Subject,
    /// `None` once closed.
    subscriber: Option<async_nats::Subscriber>,
    open: Option<OpenPull>,
}

/// The pull request the server may still be filling.
#[derive(Clone, Copy)]
struct OpenPull {
    /// Messages it may still bring.
    remaining: usize,
    /// When the server expires it.
    expires_at: Instant,
    /// When it is over at the latest (its end status may be lost).
    ends_by: Instant,
}

impl OpenPull {
    /// The NAK delay that keeps a given-back message from this request.
    fn outlasting_delay(&self) -> Duration {
        self.expires_at.saturating_duration_since(Instant::now()) + GIVE_BACK_MARGIN
    }
}

impl Pulls {
    pub(crate) async fn subscribe(client: &async_nats::Client) -> Result<Self, BrokerError> {
        let inbox = async_nats::Subject::from(client.new_inbox());
        let subscriber = client
            .subscribe(inbox.clone())
            .await
            .map_err(connection("subscribing the pull inbox"))?;
        Ok(Pulls {
            inbox,
            subscriber: Some(subscriber),
            open: None,
        })
    }

    /// The open request, unless it has run past its end.
    fn open(&mut self) -> Option<OpenPull> {
        if self.open.is_some_and(|o| Instant::now() >= o.ends_by) {
            self.open = None;
        }
        self.open
    }

    /// A message on the inbox as a delivery, or `None` for a status: a heartbeat, or the
    /// end of the open request (408 expired, 409 terminated, 404 none).
    fn classify(
        &mut self,
        message: async_nats::Message,
        context: &jetstream::Context,
    ) -> Option<jetstream::Message> {
        match message.status {
            None | Some(StatusCode::OK) => {
                if let Some(open) = self.open.as_mut() {
                    open.remaining = open.remaining.saturating_sub(1);
                    if open.remaining == 0 {
                        self.open = None;
                    }
                }
                Some(jetstream::Message {
                    message,
                    context: context.clone(),
                })
            }
            Some(StatusCode::IDLE_HEARTBEAT) => None,
            Some(status) => {
                if status != StatusCode::TIMEOUT && status != StatusCode::NOT_FOUND {
                    tracing::debug!(%status, description = ?message.description,
                        "pull request ended by the server");
                }
                self.open = None;
                None
            }
        }
    }
}

impl NatsReceiver {
    fn token<'d>(&self, d: &'d Delivery) -> Result<&'d NatsToken, BrokerError> {
        d.token().extra_of::<NatsToken>(self.owner)
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
    /// advisory watcher tell these from terminations by other clients.
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
        let progress = acker.clone();
        keep_leased(settled.clone(), self.sub.lease / 2, None, move || {
            let acker = progress.clone();
            async move {
                match acker.ack_with(AckKind::Progress).await {
                    Ok(()) => Renewed::Yes,
                    Err(_) => Renewed::Stop,
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

impl NatsReceiver {
    /// Ask for as many messages as the prefetch has room for, unless a request is open.
    async fn request_more(&self, pulls: &mut Pulls) -> Result<(), BrokerError> {
        if pulls.open().is_some() {
            return Ok(());
        }
        let held = self.outstanding.load(Ordering::Relaxed);
        let want = usize::try_from(self.sub.prefetch.saturating_sub(held).max(1)).unwrap_or(1);
        // Counted open before the request goes out: should this future be cancelled
        // after sending, the messages still land on the inbox and are read.
        let now = Instant::now();
        pulls.open = Some(OpenPull {
            remaining: want,
            expires_at: now + PULL_EXPIRES,
            ends_by: now + PULL_EXPIRES + PULL_END_GRACE,
        });
        let request = pull::BatchConfig {
            batch: want,
            expires: Some(PULL_EXPIRES),
            ..Default::default()
        };
        let sent = self
            .consumer
            .request_batch(request, pulls.inbox.clone())
            .await;
        sent.map_err(|e| {
            pulls.open = None;
            connection(format!("pulling from consumer `{}`", self.sub.consumer))(e)
        })
    }
}

#[async_trait]
impl Receiver for NatsReceiver {
    async fn receive(&self) -> Result<Delivery, BrokerError> {
        let mut guard = self.pulls.lock().await;
        let pulls = &mut *guard;
        loop {
            if self.closed.is_cancelled() {
                return Err(BrokerError::Closed);
            }
            self.request_more(pulls).await?;
            let ends_by = pulls.open.map_or_else(Instant::now, |o| o.ends_by);
            let Some(subscriber) = pulls.subscriber.as_mut() else {
                return Err(BrokerError::Closed);
            };
            let message = tokio::select! {
                _ = self.closed.cancelled() => return Err(BrokerError::Closed),
                // The request's end never came: the next pass asks again.
                _ = tokio::time::sleep_until(ends_by.into()) => continue,
                message = subscriber.next() => message,
            };
            let Some(message) = message else {
                return Err(BrokerError::connection(
                    "the NATS connection closed the pull inbox",
                ));
            };
            if let Some(msg) = pulls.classify(message, &self.broker.inner.js)
                && let Some(d) = self.take(msg)
            {
                return Ok(d);
            }
        }
    }

    /// One delivery (waiting), then what the inbox already holds (never waiting for
    /// more): a batch handler gets what one pull brought.
    async fn receive_batch(&self, max: usize, into: &mut Vec<Delivery>) -> Result<(), BrokerError> {
        into.push(self.receive().await?);
        let mut guard = self.pulls.lock().await;
        let pulls = &mut *guard;
        while into.len() < max {
            let Some(subscriber) = pulls.subscriber.as_mut() else {
                break;
            };
            let Some(Some(message)) = subscriber.next().now_or_never() else {
                break;
            };
            if let Some(msg) = pulls.classify(message, &self.broker.inner.js)
                && let Some(d) = self.take(msg)
            {
                into.push(d);
            }
        }
        Ok(())
    }

    async fn ack(&self, delivery: &Delivery) -> Result<(), BrokerError> {
        self.settle(delivery, AckKind::Ack).await
    }

    async fn retry(&self, delivery: &Delivery, retry: RetryRequest) -> Result<(), BrokerError> {
        #[cfg(feature = "test-util")]
        if let Some(faults) = &self.broker.inner.options.faults
            && faults.retry_broken(&self.sub.consumer)
        {
            return Err(BrokerError::connection(
                "retry route broken (fault injection)",
            ));
        }
        let t = self.token(delivery)?;
        let mut h = to_nats_headers(&retry.message);
        // In the server's clock, which fires it (`crate::clock`); never early: the
        // schedule's time has millisecond precision.
        let inner = &self.broker.inner;
        let server_now = inner
            .clock
            .now(&inner.js, &stream_name(&self.sub.source))
            .await?;
        let due = server_now + retry.delay + Duration::from_millis(1);
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
        // One entry per source message (see `publish_dead_letter`): keyed by the stream
        // message first consumed, so a redelivery of it *and* a retry copy of it
        // dead-letter to one entry. (Keyed by the delivered copy's sequence, a message
        // whose lease ran out while its dead letter was held — a stalled link — was
        // delivered again, retried and parked a second time from the copy.)
        let origin = self.token(delivery)?.origin.0;
        self.broker
            .publish_dead_letter(&self.sub, origin, dead)
            .await?;
        self.term_dead_lettered(delivery).await
    }

    async fn release(&self, delivery: &Delivery, delay: Duration) -> Result<(), BrokerError> {
        let mut delay = delay;
        if self.closed.is_cancelled()
            && let Some(open) = self.pulls.lock().await.open()
        {
            // Closed with a request open: it would take the message straight back.
            delay = delay.max(open.outlasting_delay());
        }
        let delay = (!delay.is_zero()).then_some(delay);
        self.settle(delivery, AckKind::Nak(delay)).await
    }

    async fn close(&self) -> Result<(), BrokerError> {
        self.closed.cancel();
        let mut pulls = self.pulls.lock().await;
        // `open` stays: a release after close reads it (see `release`).
        let (Some(mut subscriber), open) = (pulls.subscriber.take(), pulls.open()) else {
            return Ok(());
        };
        let context = self.broker.inner.js.clone();
        let mut rest = Pulls {
            inbox: pulls.inbox.clone(),
            subscriber: None,
            open,
        };
        // Give back what the inbox holds and what the open request still brings, until
        // it ends, without holding up the shutdown: a message left unread there would
        // wait out the lease.
        tokio::spawn(async move {
            let mut given_back = 0u32;
            loop {
                let message = match rest.open() {
                    Some(o) => tokio::select! {
                        _ = tokio::time::sleep_until(o.ends_by.into()) => break,
                        m = subscriber.next() => m,
                    },
                    None => match subscriber.next().now_or_never() {
                        Some(m) => m,
                        None => break,
                    },
                };
                let Some(message) = message else { break };
                if let Some(msg) = rest.classify(message, &context) {
                    let delay = rest.open().map(|o| o.outlasting_delay());
                    if msg.ack_with(AckKind::Nak(delay)).await.is_ok() {
                        given_back += 1;
                    }
                }
            }
            tracing::debug!(given_back, "pull inbox drained after close");
        });
        Ok(())
    }
}

impl Drop for NatsReceiver {
    fn drop(&mut self) {
        // Stop every keep-alive: unsettled deliveries come back after `ack_wait`.
        self.closed.cancel();
    }
}
