//! # reliq-rabbit
//!
//! The RabbitMQ backend of reliq, on [lapin]. It is a thin, documented mapping of the
//! [`Broker`]/[`Receiver`] seam onto native RabbitMQ mechanisms; the consumer runtime
//! (classification, the retry decision, the dead-letter record) stays in `reliq-core`.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use std::time::Duration;
//! use reliq_core::{BoxError, Broker, Consumer, Delivery, Destination, Message, RetryPolicy};
//! use reliq_rabbit::RabbitBroker;
//!
//! let broker = Arc::new(RabbitBroker::connect("amqp://guest:guest@127.0.0.1:5672/%2f").await?);
//! let consumer = Consumer::builder(broker.clone(), "inventory")
//!     .subscribe("orders", Some("order.*".to_string()))
//!     .retry(RetryPolicy::tiers([Duration::from_secs(5), Duration::from_secs(30)]))
//!     .start(|d: Delivery| async move {
//!         let _text = d.text()?;
//!         Ok::<(), BoxError>(())
//!     })
//!     .await?;
//! broker
//!     .publish(&Destination::new("orders").with_route("order.created"), Message::new("hi"))
//!     .await?;
//! consumer.shutdown().await;
//! # Ok(()) }
//! ```
//!
//! ## The mapping
//!
//! | seam | RabbitMQ |
//! |---|---|
//! | topology | per consumer, from the [`Subscription`]: topic exchange `source` (durable); quorum queue `<source>.<consumer>` bound with the filter (or `#`); one TTL queue per retry tier ([`Subscription::retry_name`]) dead-lettering through the default exchange to *this consumer's queue only*; parking queue [`Subscription::dead_letter_name`]. See [`topology`] and [`plan`]. |
//! | `publish` | publisher confirms + `mandatory`, persistent; `basic.return` → [`BrokerError::Unroutable`], nack → [`BrokerError::Rejected`], no confirm in time → [`BrokerError::Timeout`]; a missing exchange (channel close 404) → `Unroutable`, and the channel is reopened |
//! | `receive` | one channel per receiver, `basic.qos(prefetch)`, `basic.consume` with manual ack |
//! | `ack` | `basic.ack` |
//! | `retry` | publish the copy (confirmed, mandatory) to the tier's TTL queue via the default exchange, *then* `basic.ack` |
//! | `dead_letter` | publish the copy (confirmed, mandatory) to the parking queue, *then* `basic.ack` |
//! | `release` | `basic.nack(requeue=true)`, after the requested delay (the delivery stays unacked meanwhile) |
//! | drop / `close` | the channel is closed: RabbitMQ requeues every unacked delivery |
//! | attempt | the `reliq-attempt` header (never `x-death`) |
//! | delivery limit | quorum `x-delivery-limit` = [`Subscription::delivery_limit`]; the broker dead-letters (at-least-once) to the parking queue; [`Broker::dead_letters`] turns its `x-death` into a reliq [`DeadLetter`](reliq_core::DeadLetter) record with reason `max-deliveries` |
//! | `send_to_consumer` (replay) | publish to the default exchange with routing key = the consumer's queue |
//!
//! Message mapping: id → AMQP `message_id` (the `reliq-id` header for ids over 255
//! bytes); key → the
//! `reliq-key` header ([`convert::KEY_HEADER`]); every header → an AMQP long string.
//!
//! Queue settings (`delivery-limit`, `dead-letter-exchange` = `""`,
//! `dead-letter-routing-key`, `dead-letter-strategy=at-least-once`,
//! `overflow=reject-publish`, `message-ttl` on the tiers) live in **policies** when a
//! management API URL is configured ([`QueueSettings`]): one policy `reliq-<queue>` per
//! queue, put before the queue is declared (and only when it changed — every policy change
//! makes RabbitMQ re-match all queues of the vhost), `apply-to` = `queues` before 3.12 and
//! `quorum_queues` from 3.12 on; before that, reliq checks that no other policy with an
//! equal or higher priority matches the queue (an operator's broader policy would
//! otherwise silently replace reliq's and drop the delivery limit). Without a management URL they are queue arguments, which cannot be
//! changed on an existing queue: redeclaring it with another delivery limit fails with
//! [`BrokerError::Config`] (PRECONDITION_FAILED). [`plan`] prints both forms, for
//! operators who manage policies themselves.
//!
//! **Broker setting for operators**: a tier hands an expired message back to its source
//! queue through the broker's at-least-once dead-letter worker, which re-sends a forward
//! whose confirm never came only after `dead_letter_worker_publisher_confirm_timeout`
//! (default 180 s). After a broker restart the first forward can find the source queue
//! not yet up, so every retry that was waiting in a tier then stalls for 3 minutes
//! (measured here). Set it lower in `advanced.config`, e.g.
//! `[{rabbit, [{dead_letter_worker_publisher_confirm_timeout, 5000}]}].` (what
//! `scripts/brokers` does); a forward re-sent too early is a duplicate, which the
//! runtime's inbox absorbs like any redelivery.
//!
//! RabbitMQ 4.3's quorum-queue delayed retry is not used yet: the brokers reliq is tested
//! against here (3.10) do not have it, so retries always go through TTL tiers.
//!
//! ## Capabilities
//!
//! - `rejects_unroutable: true` — `mandatory` + returns, and a missing exchange is an error.
//! - `exact_retry_delay: false` — a retry waits for its tier's TTL: the policy's jitter is
//!   not applied (each tier is one queue with one TTL, so nothing blocks at the head).
//! - `delivery_limit: true` for quorum queues, `false` for classic queues (classic queues
//!   have no delivery limit, and their dead-lettering is at-most-once).
//! - `consumer_redelivery: true` — replay goes to one consumer's queue.
//!
//! Leases: RabbitMQ has no per-delivery lease; an unacked delivery stays with its channel
//! until it is settled, the channel closes or the broker's `consumer_timeout` (30 min by
//! default) fires. [`Subscription::lease`] is not used.
//!
//! ## Reconnecting
//!
//! A lost connection or channel is reopened with bounded exponential backoff and jitter
//! ([`Reconnect`]); the receiver re-declares its topology and consumes again. Deliveries
//! that were unacked on the lost channel come back from the broker (settling them on the
//! old channel fails with [`BrokerError::Connection`], and the runtime moves on). After
//! [`Reconnect::max_failures`] consecutive failures the operation returns a
//! `BrokerError::Connection` naming the last error.
//!
//! [lapin]: https://docs.rs/lapin
#![cfg_attr(test, allow(clippy::unwrap_used))]

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use async_trait::async_trait;
use futures::{FutureExt, StreamExt};
use lapin::Confirmation;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, ExchangeDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::{Channel, Connection, ConnectionProperties, ExchangeKind};
use reliq_core::headers::{self, Origin};
use reliq_core::{
    Broker, BrokerError, Capabilities, Delivery, DeliveryToken, Destination, Message, Receiver,
    ReceiverId, RetryRequest, Subscription,
};
use tokio::sync::Mutex;

pub mod convert;
pub mod management;
pub mod topology;

pub use management::Management;
pub use management::Policy;
pub use topology::{Names, plan};

/// The queue type reliq declares.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum QueueType {
    /// Quorum queues (default): replicated, delivery limit, at-least-once dead-lettering.
    #[default]
    Quorum,
    /// Classic queues (opt-in): no delivery limit, at-most-once dead-lettering.
    Classic,
}

impl QueueType {
    /// The `x-queue-type` value.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Quorum => "quorum",
            Self::Classic => "classic",
        }
    }
}

/// How lost connections and channels are reopened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reconnect {
    /// Consecutive failures after which an operation gives up with an error.
    pub max_failures: u32,
    /// The first backoff delay.
    pub initial: Duration,
    /// The largest backoff delay.
    pub max: Duration,
}

impl Default for Reconnect {
    /// 10 failures, 100 ms doubling up to 5 s (with jitter).
    fn default() -> Self {
        Self {
            max_failures: 10,
            initial: Duration::from_millis(100),
            max: Duration::from_secs(5),
        }
    }
}

impl Reconnect {
    /// The delay before attempt `failures + 1`: exponential, capped, with jitter (50–100 %).
    pub fn delay(&self, failures: u32) -> Duration {
        let exp = failures.saturating_sub(1).min(20);
        let base = self.initial.saturating_mul(1 << exp).min(self.max);
        base.mul_f64(0.5 + fastrand::f64() / 2.0)
    }
}

/// Where reliq puts the settings of the queues it declares (delivery limit, retry TTL,
/// dead-letter target and strategy, overflow, expiry).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum QueueSettings {
    /// Policies when [`RabbitOptions::management_url`] is set, queue arguments otherwise.
    /// Decided by configuration, never by whether the API happens to answer: a queue
    /// declared with arguments during an outage would keep them for life.
    #[default]
    Auto,
    /// `x-` queue arguments. They cannot be changed on an existing queue: declaring it
    /// again with another delivery limit fails with [`BrokerError::Config`].
    Arguments,
    /// One policy per queue (`reliq-<queue>`, pattern `^<queue>$`), put through the
    /// management API before the queue is declared; the queue carries only its type, so
    /// the settings can change without recreating it. Needs
    /// [`RabbitOptions::management_url`]; an unreachable API fails [`RabbitBroker::connect_with`].
    /// Policies are not removed with their queues (delete them with
    /// [`Management::delete_policy`] when a consumer is retired), and every policy change
    /// makes RabbitMQ re-match all queues of the vhost: fine for long-lived consumers,
    /// not for thousands of short-lived ones (use `Arguments` there).
    Policies,
}

/// Settings of a [`RabbitBroker`].
#[derive(Clone, Debug)]
pub struct RabbitOptions {
    /// Queue type of every queue reliq declares (default quorum).
    pub queue_type: QueueType,
    /// How long `publish` (and the retry / dead-letter copies) wait for a confirm.
    pub confirm_timeout: Duration,
    /// Reconnect policy.
    pub reconnect: Reconnect,
    /// The management API (`http[s]://user:password@host:15672`): where reliq sets its
    /// policies (see [`QueueSettings`]) and probes the server version; optional.
    pub management_url: Option<String>,
    /// Queue settings as policies or as queue arguments.
    pub queue_settings: QueueSettings,
    /// Priority of reliq's policies (default 10). RabbitMQ applies only the
    /// highest-priority policy matching a queue; reliq checks after each declaration that
    /// no other policy with an equal or higher priority matches and fails naming it otherwise.
    pub policy_priority: i32,
    /// `x-expires` for every queue reliq declares: RabbitMQ deletes a queue unused for
    /// this long. Off by default; tests use it so nothing is left behind.
    pub queue_expiry: Option<Duration>,
    /// The client-side connection name shown by RabbitMQ (default `reliq`).
    pub connection_name: String,
}

impl Default for RabbitOptions {
    fn default() -> Self {
        Self {
            queue_type: QueueType::Quorum,
            confirm_timeout: Duration::from_secs(10),
            reconnect: Reconnect::default(),
            management_url: None,
            queue_settings: QueueSettings::Auto,
            policy_priority: 10,
            queue_expiry: None,
            connection_name: "reliq".to_owned(),
        }
    }
}

/// Errors of this crate (converted into [`BrokerError`] at the seam).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RabbitError {
    /// Declaring an exchange or queue failed.
    #[error("declaring `{object}` failed: {source}")]
    Declare {
        /// The exchange or queue.
        object: String,
        /// The client error.
        #[source]
        source: lapin::Error,
    },
    /// A client call failed.
    #[error("{operation} failed: {source}")]
    Client {
        /// What was attempted.
        operation: &'static str,
        /// The client error.
        #[source]
        source: lapin::Error,
    },
}

/// The AMQP reply code of a channel/connection error, if it is one.
fn reply_code(e: &lapin::Error) -> Option<u16> {
    match e.kind() {
        lapin::ErrorKind::ProtocolError(amqp) => Some(amqp.get_id()),
        _ => None,
    }
}

impl RabbitError {
    fn declare(object: &str, source: lapin::Error) -> BrokerError {
        let code = reply_code(&source);
        let e = RabbitError::Declare {
            object: object.to_owned(),
            source,
        };
        match code {
            Some(406) => BrokerError::Config {
                field: object.to_owned(),
                reason: format!(
                    "{e} (PRECONDITION_FAILED: it exists with other arguments; change it with a \
                     policy or delete and redeclare it)"
                ),
            },
            _ => e.into(),
        }
    }

    fn client(operation: &'static str, source: lapin::Error) -> BrokerError {
        RabbitError::Client { operation, source }.into()
    }
}

impl From<RabbitError> for BrokerError {
    fn from(e: RabbitError) -> Self {
        let source = match &e {
            RabbitError::Declare { source, .. } | RabbitError::Client { source, .. } => source,
        };
        if source.is_io_error()
            || source.is_amqp_hard_error()
            || matches!(
                source.kind(),
                lapin::ErrorKind::InvalidChannelState(..)
                    | lapin::ErrorKind::InvalidConnectionState(..)
                    | lapin::ErrorKind::MissingHeartbeatError
            )
        {
            BrokerError::connection(e.to_string())
        } else {
            BrokerError::Other(Box::new(e))
        }
    }
}

/// Where a publish goes, for error messages (formatted only when one is needed).
#[derive(Clone, Copy)]
enum Target<'a> {
    /// An exchange and routing key.
    Exchange(&'a str, &'a str),
    /// A queue through the default exchange, with its role.
    Queue(&'static str, &'a str),
}

impl std::fmt::Display for Target<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Exchange(exchange, route) => write!(f, "exchange `{exchange}` route `{route}`"),
            Self::Queue(role, queue) => write!(f, "{role} `{queue}`"),
        }
    }
}

struct Inner {
    url: String,
    opts: RabbitOptions,
    management: Option<Management>,
    store: topology::SettingsStore,
    conn: Mutex<Option<Arc<Connection>>>,
    /// The shared publishing channel (read on every publish: a plain lock, held only to
    /// clone the handle).
    publisher: StdMutex<Option<Channel>>,
    /// Serialises reopening the publishing channel.
    publisher_reopen: Mutex<()>,
    exchanges: StdMutex<HashSet<String>>,
}

impl Inner {
    async fn connect_once(&self) -> Result<Connection, lapin::Error> {
        Connection::connect(
            &self.url,
            ConnectionProperties::default()
                .with_connection_name(self.opts.connection_name.clone().into()),
        )
        .await
    }

    /// A live connection: the current one, or a new one (bounded backoff with jitter).
    async fn connection(&self) -> Result<Arc<Connection>, BrokerError> {
        let mut guard = self.conn.lock().await;
        if let Some(c) = guard.as_ref() {
            if c.status().connected() {
                return Ok(c.clone());
            }
            tracing::warn!("RabbitMQ connection lost; reconnecting");
        }
        *guard = None;
        let mut failures = 0u32;
        loop {
            match self.connect_once().await {
                Ok(c) => {
                    let c = Arc::new(c);
                    *guard = Some(c.clone());
                    if failures > 0 {
                        tracing::info!(failures, "reconnected to RabbitMQ");
                    }
                    return Ok(c);
                }
                Err(e) => {
                    failures += 1;
                    if failures >= self.opts.reconnect.max_failures.max(1) {
                        return Err(BrokerError::connection(format!(
                            "could not connect to RabbitMQ after {failures} attempts: {e}"
                        )));
                    }
                    let wait = self.opts.reconnect.delay(failures);
                    tracing::warn!(error = %e, failures, retry_in = ?wait, "connecting to RabbitMQ failed");
                    tokio::time::sleep(wait).await;
                }
            }
        }
    }

    /// A new channel on a live connection.
    async fn channel(&self) -> Result<Channel, BrokerError> {
        let conn = self.connection().await?;
        match conn.create_channel().await {
            Ok(ch) => Ok(ch),
            Err(first) => {
                tracing::warn!(error = %first, "opening a channel failed; retrying on a fresh connection");
                {
                    let mut guard = self.conn.lock().await;
                    if guard.as_ref().is_some_and(|c| Arc::ptr_eq(c, &conn)) {
                        *guard = None;
                    }
                }
                let conn = self.connection().await?;
                conn.create_channel()
                    .await
                    .map_err(|e| RabbitError::client("opening a channel", e))
            }
        }
    }

    /// The shared publishing channel (confirm mode), reopened when closed.
    async fn publisher(&self) -> Result<Channel, BrokerError> {
        if let Some(ch) = self.open_publisher() {
            return Ok(ch);
        }
        let _reopening = self.publisher_reopen.lock().await;
        if let Some(ch) = self.open_publisher() {
            return Ok(ch); // reopened by a concurrent publish meanwhile
        }
        let ch = self.channel().await?;
        ch.confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|e| RabbitError::client("confirm.select", e))?;
        *self.publisher.lock().unwrap_or_else(|p| p.into_inner()) = Some(ch.clone());
        Ok(ch)
    }

    /// The publishing channel, if it is open.
    fn open_publisher(&self) -> Option<Channel> {
        self.publisher
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .filter(|ch| ch.status().connected())
            .cloned()
    }

    /// Check (once per process) that `exchange` exists, on a throwaway channel: a publish
    /// to a missing exchange would close the shared publishing channel under every
    /// concurrent publish.
    async fn ensure_exchange(&self, exchange: &str) -> Result<(), BrokerError> {
        if exchange.is_empty()
            || self
                .exchanges
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .contains(exchange)
        {
            return Ok(());
        }
        let name = topology::short("exchange", exchange)?;
        let ch = self.channel().await?;
        let result = ch
            .exchange_declare(
                name,
                ExchangeKind::Topic,
                ExchangeDeclareOptions {
                    passive: true,
                    ..ExchangeDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await;
        match result {
            Ok(()) => {
                let _ = ch.close(200, "ok".into()).await;
                self.known_exchange(exchange);
                Ok(())
            }
            Err(e) if reply_code(&e) == Some(404) => Err(BrokerError::Unroutable(format!(
                "exchange `{exchange}` does not exist"
            ))),
            Err(e) => Err(RabbitError::client("checking the exchange", e)),
        }
    }

    fn known_exchange(&self, exchange: &str) {
        self.exchanges
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(exchange.to_owned());
    }

    fn forget_exchange(&self, exchange: &str) {
        self.exchanges
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(exchange);
    }

    /// Publish `message` to `exchange` with `routing_key`, mandatory and persistent, and
    /// wait for the confirm. `what` names the destination in errors.
    async fn publish_to(
        &self,
        exchange: &str,
        routing_key: &str,
        message: &Message,
        what: Target<'_>,
    ) -> Result<(), BrokerError> {
        self.ensure_exchange(exchange).await?;
        let props = convert::properties(message)?;
        let ex = topology::short("exchange", exchange)?;
        let rk = topology::short("routing key", routing_key)?;
        let ch = self.publisher().await?;
        let pending = ch
            .basic_publish(
                ex,
                rk,
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                message.payload(),
                props,
            )
            .await
            .map_err(|e| self.publish_failed(exchange, what, e))?;
        let timeout = self.opts.confirm_timeout;
        let confirmation = tokio::time::timeout(timeout, pending)
            .await
            .map_err(|_| BrokerError::Timeout(timeout))?
            .map_err(|e| self.publish_failed(exchange, what, e))?;
        match confirmation {
            Confirmation::Ack(None) => Ok(()),
            Confirmation::Ack(Some(returned)) => Err(BrokerError::Unroutable(format!(
                "{what} (basic.return {} {})",
                returned.reply_code, returned.reply_text
            ))),
            Confirmation::Nack(_) => Err(BrokerError::rejected(format!(
                "RabbitMQ nacked the publish to {what} (queue full with overflow=reject-publish, or an internal error)"
            ))),
            Confirmation::NotRequested => Err(BrokerError::rejected(
                "publisher confirms are not enabled on the channel",
            )),
        }
    }

    fn publish_failed(&self, exchange: &str, what: Target<'_>, e: lapin::Error) -> BrokerError {
        if reply_code(&e) == Some(404) {
            // The channel is closed by now; `publisher()` opens a new one next time.
            self.forget_exchange(exchange);
            return BrokerError::Unroutable(format!("{what}: {e}"));
        }
        RabbitError::client("basic.publish", e)
    }
}

/// Resolve [`RabbitOptions::queue_settings`] at connect time; policies need the server
/// version (for `apply-to`) and the vhost of `url`.
async fn settings_store(
    url: &str,
    options: &RabbitOptions,
    management: Option<&Management>,
) -> Result<topology::SettingsStore, BrokerError> {
    let api = match (options.queue_settings, management) {
        (QueueSettings::Arguments, _) | (QueueSettings::Auto, None) => {
            return Ok(topology::SettingsStore::Arguments);
        }
        (QueueSettings::Policies, None) => {
            return Err(BrokerError::Config {
                field: "management_url".into(),
                reason: "queue_settings = Policies needs the management API URL".into(),
            });
        }
        (_, Some(api)) => api,
    };
    let version = api
        .server_version()
        .await
        .map_err(|e| BrokerError::Config {
            field: "management_url".into(),
            reason: format!("the management API is needed to set reliq's policies: {e}"),
        })?;
    let vhost = url
        .parse::<lapin::uri::AMQPUri>()
        .map_err(|e| BrokerError::Config {
            field: "url".into(),
            reason: e,
        })?
        .vhost;
    Ok(topology::SettingsStore::Policies {
        api: api.clone(),
        vhost,
        apply_to: topology::apply_to(options.queue_type, Some(&version)),
        priority: options.policy_priority,
    })
}

/// A RabbitMQ connection implementing [`Broker`]. Cheap to clone (shared).
#[derive(Clone)]
pub struct RabbitBroker {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for RabbitBroker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The URL may hold a password: never print it.
        f.debug_struct("RabbitBroker")
            .field("options", &self.inner.opts.queue_type)
            .finish_non_exhaustive()
    }
}

impl RabbitBroker {
    /// Connect to `amqp://…` or `amqps://…` (TLS via rustls) with default options.
    pub async fn connect(url: &str) -> Result<Self, BrokerError> {
        Self::connect_with(url, RabbitOptions::default()).await
    }

    /// Connect with `options`.
    pub async fn connect_with(url: &str, options: RabbitOptions) -> Result<Self, BrokerError> {
        let scheme = url.split_once("://").map(|(s, _)| s.to_ascii_lowercase());
        if !matches!(scheme.as_deref(), Some("amqp" | "amqps")) {
            return Err(BrokerError::Config {
                field: "url".into(),
                reason: "expected amqp://… or amqps://…".into(),
            });
        }
        let management = options
            .management_url
            .as_deref()
            .map(Management::new)
            .transpose()?;
        let store = settings_store(url, &options, management.as_ref()).await?;
        let inner = Arc::new(Inner {
            url: url.to_owned(),
            opts: options,
            management,
            store,
            conn: Mutex::new(None),
            publisher: StdMutex::new(None),
            publisher_reopen: Mutex::new(()),
            exchanges: StdMutex::new(HashSet::new()),
        });
        // The first connection fails fast: a wrong URL is a configuration error.
        let conn = inner
            .connect_once()
            .await
            .map_err(|e| BrokerError::connection(format!("connecting to RabbitMQ failed: {e}")))?;
        *inner.conn.lock().await = Some(Arc::new(conn));
        Ok(Self { inner })
    }

    /// The options this broker was created with.
    pub fn options(&self) -> &RabbitOptions {
        &self.inner.opts
    }

    /// The management API client, when [`RabbitOptions::management_url`] is set.
    pub fn management(&self) -> Option<&Management> {
        self.inner.management.as_ref()
    }

    /// Declare `sub`'s whole topology (idempotent); [`Broker::subscribe`] does this too.
    pub async fn declare(&self, sub: &Subscription) -> Result<Names, BrokerError> {
        let ch = self.inner.channel().await?;
        let names = topology::declare_all(&ch, sub, &self.inner.opts, &self.inner.store).await?;
        self.inner.known_exchange(&names.exchange);
        let _ = ch.close(200, "ok".into()).await;
        Ok(names)
    }

    /// Declare the source exchange `exchange` (durable topic), so publishes to it are
    /// accepted before a consumer subscribed (they are still unroutable while no queue is
    /// bound).
    pub async fn declare_exchange(&self, exchange: &str) -> Result<(), BrokerError> {
        let ch = self.inner.channel().await?;
        topology::declare_exchange(&ch, exchange).await?;
        self.inner.known_exchange(exchange);
        let _ = ch.close(200, "ok".into()).await;
        Ok(())
    }

    /// Declare only `sub`'s parking queue (e.g. to restore a deleted one).
    pub async fn declare_dead_letter_queue(&self, sub: &Subscription) -> Result<(), BrokerError> {
        let ch = self.inner.channel().await?;
        topology::declare_parking(&ch, sub, &self.inner.opts, &self.inner.store).await?;
        let _ = ch.close(200, "ok".into()).await;
        Ok(())
    }

    /// Declare only `sub`'s retry (TTL) queues (e.g. to restore deleted ones).
    pub async fn declare_retry_queues(&self, sub: &Subscription) -> Result<(), BrokerError> {
        let ch = self.inner.channel().await?;
        topology::declare_retry(&ch, sub, &self.inner.opts, &self.inner.store).await?;
        let _ = ch.close(200, "ok".into()).await;
        Ok(())
    }

    /// The server version from the management API (`None` without one, or when it is
    /// unreachable).
    pub async fn server_version(&self) -> Option<String> {
        match self.management()?.server_version().await {
            Ok(v) => Some(v),
            Err(e) => {
                tracing::debug!(error = %e, "management API unreachable; server version unknown");
                None
            }
        }
    }

    /// What [`Broker::subscribe`] declares for `sub` and the equivalent policies (see
    /// [`plan`]), for the probed server version.
    pub async fn plan(&self, sub: &Subscription) -> String {
        let version = self.server_version().await;
        topology::plan(sub, &self.inner.opts, version.as_deref())
    }

    async fn receiver(
        &self,
        sub: &Subscription,
        role: Role,
    ) -> Result<Box<dyn Receiver>, BrokerError> {
        let names = Names::of(sub);
        let rx = RabbitReceiver {
            inner: self.inner.clone(),
            sub: sub.clone(),
            role,
            names,
            live: Mutex::new(None),
            settle: Arc::new(StdMutex::new(None)),
            owner: ReceiverId::next(),
            generation: AtomicU64::new(0),
            closed: AtomicBool::new(false),
        };
        let live = rx.open().await?;
        *rx.live.lock().await = Some(live);
        Ok(Box::new(rx))
    }
}

#[async_trait]
impl Broker for RabbitBroker {
    fn kind(&self) -> &'static str {
        "rabbit"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            rejects_unroutable: true,
            exact_retry_delay: false,
            delivery_limit: self.inner.opts.queue_type == QueueType::Quorum,
            consumer_redelivery: true,
            // The attempt travels in the `reliq-attempt` header of the retry copy.
            attempts_count_every_delivery: false,
            deduplicates_publishes: false,
        }
    }

    async fn publish(
        &self,
        destination: &Destination,
        message: Message,
    ) -> Result<(), BrokerError> {
        let route = destination.route.as_deref().unwrap_or("");
        self.inner
            .publish_to(
                &destination.topic,
                route,
                &message,
                Target::Exchange(&destination.topic, route),
            )
            .await
    }

    async fn subscribe(
        &self,
        subscription: &Subscription,
    ) -> Result<Box<dyn Receiver>, BrokerError> {
        self.receiver(subscription, Role::Consumer).await
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
        self.receiver(subscription, Role::Parking).await
    }

    async fn send_to_consumer(
        &self,
        subscription: &Subscription,
        message: Message,
    ) -> Result<(), BrokerError> {
        let queue = topology::queue_name(subscription);
        self.inner
            .publish_to("", &queue, &message, Target::Queue("queue", &queue))
            .await
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    /// Reads the consumer's queue.
    Consumer,
    /// Reads the consumer's parking queue.
    Parking,
}

struct Live {
    consumer: lapin::Consumer,
    generation: u64,
}

type SettleChannel = Arc<StdMutex<Option<(Channel, u64)>>>;

/// A receiver: one channel, `basic.qos(prefetch)`, `basic.consume` with manual ack.
struct RabbitReceiver {
    /// Stamped on every delivery's token; settling checks it.
    owner: ReceiverId,
    inner: Arc<Inner>,
    sub: Subscription,
    role: Role,
    names: Names,
    live: Mutex<Option<Live>>,
    /// The channel deliveries are settled on, with its generation (bumped on reopen).
    settle: SettleChannel,
    generation: AtomicU64,
    closed: AtomicBool,
}

impl RabbitReceiver {
    fn queue(&self) -> &str {
        match self.role {
            Role::Consumer => &self.names.queue,
            Role::Parking => &self.names.parking,
        }
    }

    /// Open a channel, declare the topology, set the prefetch, start consuming.
    async fn open(&self) -> Result<Live, BrokerError> {
        let ch = self.inner.channel().await?;
        match self.role {
            Role::Consumer => {
                topology::declare_all(&ch, &self.sub, &self.inner.opts, &self.inner.store).await?;
                self.inner.known_exchange(&self.names.exchange);
            }
            Role::Parking => {
                topology::declare_parking(&ch, &self.sub, &self.inner.opts, &self.inner.store)
                    .await?
            }
        }
        let prefetch = u16::try_from(self.sub.prefetch.max(1)).unwrap_or(u16::MAX);
        ch.basic_qos(prefetch, BasicQosOptions::default())
            .await
            .map_err(|e| RabbitError::client("basic.qos", e))?;
        let consumer = ch
            .basic_consume(
                topology::short("queue", self.queue())?,
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(|e| RabbitError::client("basic.consume", e))?;
        let generation = self.generation.fetch_add(1, Ordering::SeqCst) + 1;
        *self.settle.lock().unwrap_or_else(|p| p.into_inner()) = Some((ch, generation));
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
        let mut message = convert::message(&d.properties, &d.data);
        let origin = match self.role {
            Role::Parking => {
                message = convert::translate_broker_dead_letter(
                    message,
                    &d.properties,
                    &self.sub.consumer,
                    &self.sub.source,
                    &self.names.queue,
                );
                Origin {
                    destination: self.names.parking.as_str().into(),
                    ..Origin::default()
                }
            }
            Role::Consumer if d.exchange.as_str() == self.names.exchange => Origin {
                destination: self.names.exchange.as_str().into(),
                route: Some(d.routing_key.as_str().to_owned()).filter(|r| !r.is_empty()),
                ..Origin::default()
            },
            // Came back from a retry queue or a replay (default exchange): the copy
            // carries where it first came from.
            Role::Consumer => Origin {
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
            },
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
        let guard = self.settle.lock().unwrap_or_else(|p| p.into_inner());
        match guard.as_ref() {
            Some((ch, generation))
                if i64::try_from(*generation).ok() == Some(token.lane())
                    && ch.status().connected() =>
            {
                Ok(ch.clone())
            }
            _ => Err(BrokerError::connection(
                "the channel this delivery came on is closed; RabbitMQ delivers it again",
            )),
        }
    }

    async fn ack_on(&self, ch: &Channel, delivery: &Delivery) -> Result<(), BrokerError> {
        ch.basic_ack(delivery.token().tag(), BasicAckOptions::default())
            .await
            .map_err(|e| RabbitError::client("basic.ack", e))
    }

    fn copy_source_only(&self, what: &'static str) -> Result<(), BrokerError> {
        match self.role {
            Role::Consumer => Ok(()),
            Role::Parking => Err(BrokerError::Unsupported {
                backend: "rabbit",
                what,
            }),
        }
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
        self.copy_source_only("retry from a dead-letter queue")?;
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
        self.copy_source_only("dead-lettering from a dead-letter queue")?;
        let ch = self.channel_of(delivery)?;
        let parking = &self.names.parking;
        self.inner
            .publish_to("", parking, &dead, Target::Queue("parking queue", parking))
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
        let ch = self.settle.lock().unwrap_or_else(|p| p.into_inner()).take();
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
        let ch = self.settle.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let (Some((ch, _)), Ok(rt)) = (ch, tokio::runtime::Handle::try_current())
            && ch.status().connected()
        {
            rt.spawn(async move {
                let _ = ch.close(200, "reliq receiver dropped".into()).await;
            });
        }
    }
}
