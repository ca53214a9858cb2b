//! # reliq-nats
//!
//! The NATS JetStream backend of reliq: a thin mapping of reliq's seam onto JetStream.
//!
//! | reliq primitive | JetStream |
//! |---|---|
//! | publish (confirmed) | publish to the source stream's subject, wait for the `PubAck`; `Nats-Msg-Id` = message id (the server deduplicates a producer's retry) |
//! | subscribe | stream `<source>` (subjects `<source>` and `<source>.>`), durable pull consumer `<consumer>`: explicit ack, `ack_wait` = lease, `max_ack_pending` = prefetch + retry headroom (never unlimited, see [`NatsOptions::retry_headroom`]), `max_deliver` = delivery limit |
//! | receive (bounded) | demand-driven pulls of at most `prefetch − held` messages; in-progress acks every `lease / 2` keep long handlers leased |
//! | ack | `+ACK` (double-acked, i.e. confirmed by the server, by default) |
//! | retry after d | `NakWithDelay(d)`: the server redelivers the original after `d`; never a plain `nak()` |
//! | dead-letter | publish to the DLQ stream `DLQ_<stream>_<consumer>` (subject `dlq.<stream>.<consumer>`), wait for the `PubAck`, then `+TERM` |
//! | attempt | the delivery count in the message metadata |
//! | crash loop | `max_deliver`; an **advisory relay** turns `MAX_DELIVERIES` advisories into DLQ entries (reason `max-deliveries`), and `MSG_TERMINATED` advisories of terminations by other clients (reliq's own `+TERM reliq` are skipped) into entries with reason `permanent`, idempotently (`Nats-Msg-Id`) |
//!
//! Capabilities (documented limitations, see [`reliq_core::Capabilities`]):
//! `attempts_count_every_delivery` (the attempt is the server's delivery count, so a release
//! or a crash also uses an attempt), `deduplicates_publishes` (a second publish of an id
//! inside the stream's duplicate window is dropped by the server), no per-consumer input
//! (`send_to_consumer` is unsupported: a replay goes to the original subject, seen by every
//! consumer of that subject — the inbox absorbs it where it was already handled).
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use reliq_core::{Broker, Destination, Message};
//! let broker: Arc<dyn Broker> = Arc::new(reliq_nats::NatsBroker::connect("nats://127.0.0.1:4222").await?);
//! broker.publish(&Destination::new("orders").with_route("created"), Message::new("{}")).await?;
//! # Ok(()) }
//! ```

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use async_nats::jetstream::{self, AckKind, consumer::pull, stream};
use async_trait::async_trait;
use futures::{FutureExt, StreamExt};
use reliq_core::headers::{self, DeadLetter, DeadLetterReason, Origin};
use reliq_core::{
    Broker, BrokerError, Capabilities, Delivery, DeliveryToken, Destination, Headers, Message,
    MessageId, Receiver, ReceiverId, RetryRequest, Subscription,
};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Header carrying the message key (NATS has no key field).
pub const KEY_HEADER: &str = "reliq-key";
/// The server-side deduplication header.
const MSG_ID: &str = "Nats-Msg-Id";
/// The ack reliq sends after dead-lettering; its reason marks the termination as reliq's.
const TERM_BY_RELIQ: &[u8] = b"+TERM reliq";

/// What to do when a durable consumer already exists with a different configuration
/// (for example an unlimited `max_deliver` left by another tool).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum ExistingConsumer {
    /// Fail at startup, naming the differing settings (the default).
    #[default]
    Error,
    /// Log a warning and update the consumer to reliq's configuration.
    Update,
}

/// Settings of a NATS connection.
#[derive(Clone, Debug)]
pub struct NatsOptions {
    /// How long to wait for a `PubAck`.
    pub publish_timeout: Duration,
    /// Confirm acks with the server (double ack). Slower, but an ack that is lost on the
    /// way cannot silently turn into a redelivery.
    pub confirm_acks: bool,
    /// Policy for an existing consumer with a different configuration.
    pub existing_consumer: ExistingConsumer,
    /// Room on the server for retries waiting out their delay. JetStream counts a message
    /// naked with a delay against `max_ack_pending` until it is redelivered, so the
    /// consumer's `max_ack_pending` is `prefetch + retry_headroom`: with no headroom, a
    /// burst of delayed retries would stall the consumer until they come due. What this
    /// process holds stays bounded by `prefetch` (demand-driven pulls).
    pub retry_headroom: u32,
    /// Fault injection for tests (see [`Faults`]).
    pub faults: Option<Arc<Faults>>,
}

impl Default for NatsOptions {
    fn default() -> Self {
        Self {
            publish_timeout: Duration::from_secs(10),
            confirm_acks: true,
            existing_consumer: ExistingConsumer::Error,
            retry_headroom: 1000,
            faults: None,
        }
    }
}

/// Test fault switches (shared by every backend).
pub use reliq_core::faults::Faults;

/// A connection to NATS JetStream. Cheap to clone.
#[derive(Clone)]
pub struct NatsBroker {
    inner: Arc<Inner>,
}

struct Inner {
    client: async_nats::Client,
    js: jetstream::Context,
    options: NatsOptions,
    relays: Mutex<HashMap<(String, String), JoinHandle<()>>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        for (_, relay) in self
            .relays
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain()
        {
            relay.abort();
        }
    }
}

/// The JetStream stream name for a source: NATS stream names may not contain `.`, `*`,
/// `>`, spaces or path separators.
pub fn stream_name(source: &str) -> String {
    source
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// The subject a destination publishes to: `<topic>` or `<topic>.<route>`.
pub fn subject(destination: &Destination) -> String {
    match &destination.route {
        Some(route) if !route.is_empty() => format!("{}.{}", destination.topic, route),
        _ => destination.topic.clone(),
    }
}

fn consumer_name(consumer: &str) -> String {
    stream_name(consumer)
}

/// The DLQ stream of a subscription: `DLQ_<stream>_<consumer>`.
pub fn dead_letter_stream(sub: &Subscription) -> String {
    format!(
        "DLQ_{}_{}",
        stream_name(&sub.source),
        consumer_name(&sub.consumer)
    )
}

/// The DLQ subject of a subscription: `dlq.<stream>.<consumer>`.
pub fn dead_letter_subject(sub: &Subscription) -> String {
    format!(
        "dlq.{}.{}",
        stream_name(&sub.source),
        consumer_name(&sub.consumer)
    )
}

fn filter_subject(sub: &Subscription) -> String {
    match &sub.filter {
        None => String::new(),
        Some(f) if f == "#" => String::new(),
        Some(f) => {
            let nats: Vec<&str> = f
                .split('.')
                .map(|w| if w == "#" { ">" } else { w })
                .collect();
            format!("{}.{}", sub.source, nats.join("."))
        }
    }
}

fn other(e: impl std::error::Error + Send + Sync + 'static) -> BrokerError {
    BrokerError::Other(Box::new(e))
}

fn connection(e: impl std::fmt::Display) -> BrokerError {
    BrokerError::connection(e.to_string())
}

impl NatsBroker {
    /// Connect with default options. URL: `nats://[user:password@]host:port[?token=…]`, or
    /// `tls://…` to require TLS. Credentials are never logged.
    pub async fn connect(url: &str) -> Result<Self, BrokerError> {
        Self::connect_with(url, NatsOptions::default()).await
    }

    /// Connect with options.
    pub async fn connect_with(url: &str, options: NatsOptions) -> Result<Self, BrokerError> {
        let (address, query) = url.split_once('?').unwrap_or((url, ""));
        let mut connect = async_nats::ConnectOptions::new()
            .name("reliq")
            .connection_timeout(Duration::from_secs(10));
        for (k, v) in query.split('&').filter_map(|kv| kv.split_once('=')) {
            match k {
                "token" => connect = connect.token(v.to_owned()),
                "name" => connect = connect.name(v),
                other => {
                    return Err(BrokerError::Config {
                        field: format!("url query `{other}`"),
                        reason: "unknown NATS URL option (known: token, name)".into(),
                    });
                }
            }
        }
        let (scheme, rest) = address
            .split_once("://")
            .ok_or_else(|| BrokerError::Config {
                field: "url".into(),
                reason: "expected nats://host:port or tls://host:port".into(),
            })?;
        let address = match scheme {
            "nats" => address.to_owned(),
            "tls" => {
                connect = connect.require_tls(true);
                format!("tls://{rest}")
            }
            other => {
                return Err(BrokerError::Config {
                    field: "url scheme".into(),
                    reason: format!("`{other}` is not nats or tls"),
                });
            }
        };
        let client = connect
            .connect(address.as_str())
            .await
            .map_err(|e| BrokerError::connection(format!("NATS at {}: {e}", redact(&address))))?;
        let js = jetstream::new(client.clone());
        Ok(Self {
            inner: Arc::new(Inner {
                client,
                js,
                options,
                relays: Mutex::new(HashMap::new()),
            }),
        })
    }

    /// Declare the source stream (idempotent): subjects `<source>` and `<source>.>`.
    pub async fn declare_source(&self, source: &str) -> Result<(), BrokerError> {
        self.inner
            .js
            .get_or_create_stream(stream::Config {
                name: stream_name(source),
                subjects: vec![source.to_owned(), format!("{source}.>")],
                allow_direct: true,
                ..Default::default()
            })
            .await
            .map_err(other)?;
        Ok(())
    }

    /// Declare the subscription's DLQ stream (idempotent). A dead letter stays until an
    /// operator tool (replay) acknowledges it, which deletes it from the stream.
    pub async fn declare_dead_letters(&self, sub: &Subscription) -> Result<(), BrokerError> {
        self.inner
            .js
            .get_or_create_stream(stream::Config {
                name: dead_letter_stream(sub),
                subjects: vec![dead_letter_subject(sub)],
                allow_direct: true,
                ..Default::default()
            })
            .await
            .map_err(other)?;
        Ok(())
    }

    /// Delete the subscription's DLQ stream (for fault-injection tests: the DLQ becomes
    /// unavailable; [`NatsBroker::declare_dead_letters`] restores it).
    pub async fn delete_dead_letters(&self, sub: &Subscription) -> Result<(), BrokerError> {
        self.inner
            .js
            .delete_stream(dead_letter_stream(sub))
            .await
            .map_err(other)?;
        Ok(())
    }

    /// Unacknowledged deliveries of the subscription's consumer, from the server.
    pub async fn ack_pending(&self, sub: &Subscription) -> Result<usize, BrokerError> {
        let stream = self
            .inner
            .js
            .get_stream(stream_name(&sub.source))
            .await
            .map_err(other)?;
        let info = stream
            .consumer_info(consumer_name(&sub.consumer))
            .await
            .map_err(other)?;
        Ok(info.num_ack_pending)
    }

    async fn publish_raw(
        &self,
        subject: String,
        headers: async_nats::HeaderMap,
        payload: bytes::Bytes,
    ) -> Result<(), BrokerError> {
        let timeout = self.inner.options.publish_timeout;
        let ack = tokio::time::timeout(timeout, async {
            let future = self
                .inner
                .js
                .publish_with_headers(subject.clone(), headers, payload)
                .await?;
            future.await
        })
        .await
        .map_err(|_| BrokerError::Timeout(timeout))?;
        match ack {
            Ok(_) => Ok(()),
            Err(e) => Err(match e.kind() {
                jetstream::context::PublishErrorKind::StreamNotFound => {
                    BrokerError::Unroutable(subject)
                }
                jetstream::context::PublishErrorKind::TimedOut => BrokerError::Timeout(timeout),
                jetstream::context::PublishErrorKind::BrokenPipe => connection(e),
                _ => BrokerError::rejected(e.to_string()),
            }),
        }
    }

    async fn consumer_config(
        &self,
        sub: &Subscription,
    ) -> Result<jetstream::consumer::Consumer<pull::Config>, BrokerError> {
        let stream = self
            .inner
            .js
            .get_stream(stream_name(&sub.source))
            .await
            .map_err(other)?;
        let wanted = pull::Config {
            durable_name: Some(consumer_name(&sub.consumer)),
            ack_policy: jetstream::consumer::AckPolicy::Explicit,
            ack_wait: sub.lease,
            max_deliver: i64::from(sub.delivery_limit),
            max_ack_pending: i64::from(sub.prefetch) + i64::from(self.inner.options.retry_headroom),
            filter_subject: filter_subject(sub),
            ..Default::default()
        };
        let name = consumer_name(&sub.consumer);
        match stream.consumer_info(&name).await {
            Ok(existing) => {
                let c = &existing.config;
                let mut differs = Vec::new();
                if c.max_deliver != wanted.max_deliver {
                    differs.push(format!(
                        "max_deliver {} ≠ {}",
                        c.max_deliver, wanted.max_deliver
                    ));
                }
                if c.max_ack_pending != wanted.max_ack_pending {
                    differs.push(format!(
                        "max_ack_pending {} ≠ {}",
                        c.max_ack_pending, wanted.max_ack_pending
                    ));
                }
                if c.ack_wait != wanted.ack_wait {
                    differs.push(format!("ack_wait {:?} ≠ {:?}", c.ack_wait, wanted.ack_wait));
                }
                if c.filter_subject != wanted.filter_subject {
                    differs.push(format!(
                        "filter_subject `{}` ≠ `{}`",
                        c.filter_subject, wanted.filter_subject
                    ));
                }
                if !differs.is_empty() {
                    match self.inner.options.existing_consumer {
                        ExistingConsumer::Error => {
                            return Err(BrokerError::Config {
                                field: format!("consumer `{name}`"),
                                reason: format!(
                                    "exists with a different configuration: {}",
                                    differs.join(", ")
                                ),
                            });
                        }
                        ExistingConsumer::Update => {
                            tracing::warn!(consumer = %name, differences = %differs.join(", "),
                                "existing consumer differs; updating it");
                            return stream.update_consumer(wanted).await.map_err(other);
                        }
                    }
                }
                stream.get_consumer(&name).await.map_err(BrokerError::Other)
            }
            Err(_) => stream.create_consumer(wanted).await.map_err(other),
        }
    }

    fn ensure_relay(&self, sub: &Subscription) {
        let key = (stream_name(&sub.source), consumer_name(&sub.consumer));
        let mut relays = self.inner.relays.lock().unwrap_or_else(|p| p.into_inner());
        if relays.get(&key).is_some_and(|h| !h.is_finished()) {
            return;
        }
        let relay = AdvisoryRelay {
            broker: self.clone(),
            sub: sub.clone(),
        };
        relays.insert(key, tokio::spawn(relay.run()));
    }

    fn pull_receiver(
        &self,
        consumer: jetstream::consumer::Consumer<pull::Config>,
        sub: &Subscription,
    ) -> NatsReceiver {
        NatsReceiver {
            owner: ReceiverId::next(),
            broker: self.clone(),
            sub: sub.clone(),
            consumer,
            batch: tokio::sync::Mutex::new(None),
            outstanding: Arc::new(AtomicU32::new(0)),
            closed: CancellationToken::new(),
        }
    }
}

fn redact(address: &str) -> String {
    match address.split_once("://") {
        Some((scheme, rest)) => match rest.rsplit_once('@') {
            Some((_, host)) => format!("{scheme}://***@{host}"),
            None => address.to_owned(),
        },
        None => address.to_owned(),
    }
}

/// reliq headers → NATS headers (+ `Nats-Msg-Id` and the key header).
fn to_nats_headers(message: &Message) -> async_nats::HeaderMap {
    let mut h = async_nats::HeaderMap::new();
    for (name, value) in message.headers().iter() {
        h.insert(name, value);
    }
    h.insert(headers::MESSAGE_ID, message.id().as_str());
    if let Some(key) = message.key() {
        h.insert(KEY_HEADER, key);
    }
    // A replayed copy must not be dropped as a duplicate of the original publish, nor of
    // another replay of the same id: the replay count and time make each replay distinct.
    let h_ = message.headers();
    let msg_id = match (h_.get(headers::REPLAY_COUNT), h_.get(headers::REPLAYED_AT)) {
        (Some(n), Some(at)) => format!("{}:replay:{n}:{at}", message.id()),
        (Some(n), None) => format!("{}:replay:{n}", message.id()),
        _ => message.id().to_string(),
    };
    h.insert(MSG_ID, msg_id);
    h
}

/// NATS headers + payload → a reliq message (`fallback_id` when no id header is present,
/// e.g. a message published by a non-reliq producer).
fn from_nats(
    nats_headers: Option<&async_nats::HeaderMap>,
    payload: bytes::Bytes,
    fallback_id: String,
) -> Message {
    let mut hs = Headers::new();
    let mut id = None;
    let mut key = None;
    if let Some(nh) = nats_headers {
        for (name, values) in nh.iter() {
            let name = name.to_string();
            let Some(value) = values.first() else {
                continue;
            };
            let value = value.as_str().to_owned();
            match name.as_str() {
                headers::MESSAGE_ID => id = Some(value),
                KEY_HEADER => key = Some(value),
                MSG_ID => {
                    if id.is_none() {
                        id = Some(
                            value
                                .split(":replay:")
                                .next()
                                .unwrap_or_default()
                                .to_owned(),
                        );
                    }
                }
                _ => hs.insert(name, value),
            }
        }
    }
    let id = id.filter(|s| !s.is_empty()).unwrap_or(fallback_id);
    Message::from_parts(MessageId::from(id), key, payload, hs)
}

fn route_of(subject: &str, source: &str) -> Option<String> {
    subject
        .strip_prefix(source)
        .and_then(|r| r.strip_prefix('.'))
        .map(str::to_owned)
}

#[async_trait]
impl Broker for NatsBroker {
    fn kind(&self) -> &'static str {
        "nats"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            rejects_unroutable: true,
            exact_retry_delay: true,
            delivery_limit: true,
            consumer_redelivery: false,
            attempts_count_every_delivery: true,
            deduplicates_publishes: true,
        }
    }

    async fn publish(
        &self,
        destination: &Destination,
        message: Message,
    ) -> Result<(), BrokerError> {
        let headers = to_nats_headers(&message);
        let (_, _, payload, _) = message.into_parts();
        self.publish_raw(subject(destination), headers, payload)
            .await
    }

    async fn subscribe(
        &self,
        subscription: &Subscription,
    ) -> Result<Box<dyn Receiver>, BrokerError> {
        self.declare_source(&subscription.source).await?;
        self.declare_dead_letters(subscription).await?;
        let consumer = self.consumer_config(subscription).await?;
        self.ensure_relay(subscription);
        Ok(Box::new(self.pull_receiver(consumer, subscription)))
    }

    async fn dead_letters(
        &self,
        subscription: &Subscription,
    ) -> Result<Box<dyn reliq_core::DeadLetters>, BrokerError> {
        Ok(Box::new(reliq_core::dead_letters::ReceiverScan::new(
            std::sync::Arc::new(self.clone()),
            subscription.clone(),
        )))
    }

    async fn dead_letter_receiver(
        &self,
        subscription: &Subscription,
    ) -> Result<Box<dyn Receiver>, BrokerError> {
        self.declare_dead_letters(subscription).await?;
        let stream = self
            .inner
            .js
            .get_stream(dead_letter_stream(subscription))
            .await
            .map_err(other)?;
        Ok(Box::new(DeadLetterReader {
            owner: ReceiverId::next(),
            stream,
            next: AtomicU64::new(1),
            cursor: tokio::sync::Mutex::new(()),
            closed: CancellationToken::new(),
        }))
    }
}

/// The settlement handle kept in each delivery's token.
struct NatsToken {
    acker: Arc<jetstream::message::Acker>,
    /// The ack subject, for a `+TERM` that carries a reason.
    reply: Option<async_nats::Subject>,
    /// Cancelled once settled: stops the in-progress keep-alive.
    settled: CancellationToken,
    stream_sequence: u64,
}

/// Receives from a durable pull consumer with demand-driven batches: each pull asks for
/// at most `prefetch − outstanding` messages, so the deliveries this receiver holds never
/// exceed the prefetch bound. Delayed retries (naked with a delay) wait on the server and
/// do not count against it.
struct NatsReceiver {
    /// Stamped on every delivery's token; settling checks it.
    owner: ReceiverId,
    broker: NatsBroker,
    sub: Subscription,
    consumer: jetstream::consumer::Consumer<pull::Config>,
    batch: tokio::sync::Mutex<Option<pull::Batch>>,
    /// Handed out and not yet settled.
    outstanding: Arc<AtomicU32>,
    closed: CancellationToken,
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
        result.map_err(connection)?;
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
            client.request(reply, body).await.map_err(connection)?;
        } else {
            client.publish(reply, body).await.map_err(connection)?;
            client.flush().await.map_err(connection)?;
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
        let info = msg
            .info()
            .map_err(|e| BrokerError::rejected(e.to_string()))?;
        let attempt = u32::try_from(info.delivered.max(1)).unwrap_or(u32::MAX);
        let seq = info.stream_sequence;
        let stream = info.stream.to_owned();
        let published: SystemTime = info.published.into();
        let reply = msg.message.reply.clone();
        let (message, acker) = msg.split();
        let acker = Arc::new(acker);
        let fallback = format!("{stream}:{seq}");
        let reliq_message = from_nats(message.headers.as_ref(), message.payload, fallback);
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
            route: route_of(message.subject.as_str(), &self.sub.source),
            sequence: Some(seq),
            ..Origin::default()
        };
        let token = DeliveryToken::new(self.owner, seq).with_extra(NatsToken {
            acker,
            reply,
            settled,
            stream_sequence: seq,
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
                    .map_err(connection)?;
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
                    return Err(connection(e));
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
        self.settle(delivery, AckKind::Nak(Some(retry.delay))).await
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

/// Reads a DLQ stream like a log: a cursor over stream sequences. `ack` deletes the dead
/// letter from the stream; `release` leaves it where it is (the cursor moves on), so a
/// dry run or a filtered replay never disturbs what it does not take.
struct DeadLetterReader {
    owner: ReceiverId,
    stream: jetstream::stream::Stream,
    next: AtomicU64,
    cursor: tokio::sync::Mutex<()>,
    closed: CancellationToken,
}

#[async_trait]
impl Receiver for DeadLetterReader {
    async fn receive(&self) -> Result<Delivery, BrokerError> {
        let _cursor = self.cursor.lock().await;
        loop {
            if self.closed.is_cancelled() {
                return Err(BrokerError::Closed);
            }
            let state = self.stream.get_info().await.map_err(other)?.state;
            let seq = self.next.load(Ordering::Relaxed).max(state.first_sequence);
            if state.messages == 0 || seq > state.last_sequence {
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(200)) => continue,
                    _ = self.closed.cancelled() => return Err(BrokerError::Closed),
                }
            }
            self.next.store(seq + 1, Ordering::Relaxed);
            let raw = match self.stream.get_raw_message(seq).await {
                Ok(raw) => raw,
                // Deleted (already replayed): skip.
                Err(_) => continue,
            };
            let message = from_nats(
                Some(&raw.headers),
                raw.payload.clone(),
                format!("dlq:{seq}"),
            );
            let attempt = headers::attempt(message.headers());
            let origin = Origin {
                destination: raw.subject.as_str().into(),
                sequence: Some(seq),
                ..Origin::default()
            };
            return Ok(Delivery::with_published_at(
                message,
                attempt,
                origin,
                DeliveryToken::new(self.owner, seq),
                raw.time.into(),
            ));
        }
    }

    async fn ack(&self, delivery: &Delivery) -> Result<(), BrokerError> {
        self.stream
            .delete_message(delivery.token().check(self.owner)?.tag())
            .await
            .map_err(other)?;
        Ok(())
    }

    async fn retry(&self, _: &Delivery, _: RetryRequest) -> Result<(), BrokerError> {
        Err(BrokerError::Unsupported {
            backend: "nats",
            what: "retrying a dead letter (replay it instead)",
        })
    }

    async fn dead_letter(&self, _: &Delivery, _: Message) -> Result<(), BrokerError> {
        Err(BrokerError::Unsupported {
            backend: "nats",
            what: "dead-lettering a dead letter",
        })
    }

    async fn release(&self, _: &Delivery, _: Duration) -> Result<(), BrokerError> {
        Ok(())
    }

    async fn close(&self) -> Result<(), BrokerError> {
        self.closed.cancel();
        Ok(())
    }
}

/// Turns `MAX_DELIVERIES` advisories of one consumer into DLQ entries.
struct AdvisoryRelay {
    broker: NatsBroker,
    sub: Subscription,
}

/// The advisories the relay handles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Advisory {
    /// `MAX_DELIVERIES`: the server will not deliver the message again.
    MaxDeliveries,
    /// `MSG_TERMINATED`: a client terminated it (`+TERM`); reliq's own carry reason `reliq`.
    Terminated,
}

#[derive(serde::Deserialize)]
struct ConsumerAdvisory {
    stream_seq: u64,
    #[serde(default)]
    deliveries: u64,
    #[serde(default)]
    reason: String,
}

impl AdvisoryRelay {
    async fn run(self) {
        let stream = stream_name(&self.sub.source);
        let consumer = consumer_name(&self.sub.consumer);
        let client = &self.broker.inner.client;
        let max_subject = format!("$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{stream}.{consumer}");
        let term_subject =
            format!("$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.{stream}.{consumer}");
        let (mut max_deliveries, mut terminated) = match tokio::try_join!(
            client.subscribe(max_subject.clone()),
            client.subscribe(term_subject)
        ) {
            Ok(subs) => subs,
            Err(e) => {
                tracing::error!(%max_subject, error = %e, "cannot subscribe to consumer advisories");
                return;
            }
        };
        loop {
            let (msg, kind) = tokio::select! {
                Some(m) = max_deliveries.next() => (m, Advisory::MaxDeliveries),
                Some(m) = terminated.next() => (m, Advisory::Terminated),
                else => return,
            };
            let advisory: ConsumerAdvisory = match serde_json::from_slice(&msg.payload) {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(error = %e, "unreadable consumer advisory");
                    continue;
                }
            };
            if kind == Advisory::Terminated && advisory.reason.starts_with("reliq") {
                // reliq terminated it after dead-lettering it itself.
                continue;
            }
            let mut wait = Duration::from_millis(100);
            // Never give up on a message the broker will not deliver again.
            while let Err(e) = self.relay(&advisory, kind).await {
                tracing::warn!(seq = advisory.stream_seq, error = %e, retry_in = ?wait,
                    "relaying a message the consumer gave up on to the DLQ failed");
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(Duration::from_secs(10));
            }
        }
    }

    async fn relay(&self, advisory: &ConsumerAdvisory, kind: Advisory) -> Result<(), BrokerError> {
        let stream = self
            .broker
            .inner
            .js
            .get_stream(stream_name(&self.sub.source))
            .await
            .map_err(other)?;
        let raw = match stream.get_raw_message(advisory.stream_seq).await {
            Ok(raw) => raw,
            Err(e) => {
                tracing::error!(seq = advisory.stream_seq, error = %e,
                    "max-deliveries message is gone from the stream; nothing to dead-letter");
                return Ok(());
            }
        };
        let mut message = from_nats(
            Some(&raw.headers),
            raw.payload.clone(),
            format!("{}:{}", stream_name(&self.sub.source), advisory.stream_seq),
        );
        let (reason, error, id_prefix) = match kind {
            Advisory::MaxDeliveries => (DeadLetterReason::MaxDeliveries, None, "maxdel"),
            // Terminated by a client outside reliq: parked so it is not lost.
            Advisory::Terminated => (
                DeadLetterReason::Permanent,
                Some(format!(
                    "terminated outside reliq (reason `{}`)",
                    advisory.reason
                )),
                "term",
            ),
        };
        DeadLetter {
            reason,
            error_class: None,
            error,
            attempts: u32::try_from(advisory.deliveries).unwrap_or(u32::MAX),
            first_failure_at: None,
            dead_lettered_at: SystemTime::now(),
            consumer: self.sub.consumer.clone(),
            origin: Origin {
                destination: self.sub.source.as_str().into(),
                route: route_of(raw.subject.as_str(), &self.sub.source),
                sequence: Some(advisory.stream_seq),
                ..Origin::default()
            },
        }
        .write(message.headers_mut());
        let mut h = to_nats_headers(&message);
        h.insert(
            MSG_ID,
            format!(
                "{id_prefix}:{}:{}",
                stream_name(&self.sub.source),
                advisory.stream_seq
            ),
        );
        let (_, _, payload, _) = message.into_parts();
        self.broker
            .publish_raw(dead_letter_subject(&self.sub), h, payload)
            .await?;
        tracing::warn!(seq = advisory.stream_seq, consumer = %self.sub.consumer, %reason,
            "the consumer gave up on a message; moved to the DLQ");
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_valid_for_nats() {
        assert_eq!(stream_name("orders.eu west"), "orders_eu_west");
        let sub = Subscription::new("inventory", "orders").with_filter("created.#");
        assert_eq!(filter_subject(&sub), "orders.created.>");
        assert_eq!(dead_letter_subject(&sub), "dlq.orders.inventory");
        assert_eq!(
            subject(&Destination::new("orders").with_route("created")),
            "orders.created"
        );
        assert_eq!(redact("nats://u:secret@h:4222"), "nats://***@h:4222");
    }

    #[test]
    fn headers_round_trip_with_id_and_key() {
        let m = Message::new("x").with_key("k").with_header("tenant", "a");
        let h = to_nats_headers(&m);
        let back = from_nats(Some(&h), "x".into(), "fallback".into());
        assert_eq!(back.id(), m.id());
        assert_eq!(back.key(), Some("k"));
        assert_eq!(back.headers().get("tenant"), Some("a"));
        assert!(back.headers().get(MSG_ID).is_none());
    }
}
