//! The connection: [`RabbitBroker`] and its shared state ([`Inner`]) — the AMQP
//! connection, the publishing channels (confirms + mandatory: one shared, and one of its
//! own for each stream reliq appends to), the exchanges known to exist and where queue
//! settings live. The [`Broker`](reliq_core::Broker) implementation is in `broker.rs`.

use reliq_core::{BrokerError, Message, Subscription, seam::lock};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use lapin::Confirmation;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions};
use lapin::types::FieldTable;
use lapin::{Channel, Connection, ConnectionProperties, ExchangeKind};
#[cfg(doc)]
use reliq_core::Broker;
use tokio::sync::Mutex;

use crate::error::{refused_connection, reply_code};
use crate::management::Management;
use crate::names::short;
use crate::options::Nodes;
use crate::{codec, error::RabbitError, options::QueueSettings, options::RabbitOptions, topology};

/// Where a publish goes, for error messages (formatted only when one is needed).
#[derive(Clone, Copy)]
pub(crate) enum Target<'a> {
    /// An exchange and routing key.
    Exchange(&'a str, &'a str),
    /// A queue through the default exchange, with its role.
    Queue(&'static str, &'a str),
    /// A stream through the default exchange, with its role: published on a channel of
    /// the stream's own ([`Inner::publish_to`] says why).
    Stream(&'static str, &'a str),
}

impl std::fmt::Display for Target<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Exchange(exchange, route) => write!(f, "exchange `{exchange}` route `{route}`"),
            Self::Queue(role, queue) | Self::Stream(role, queue) => {
                write!(f, "{role} `{queue}`")
            }
        }
    }
}

/// Longest one node may take to accept a connection (TCP, AMQP handshake).
const NODE_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

pub(crate) struct Inner {
    /// The first node's URL (its vhost is every node's).
    pub(crate) url: String,
    /// Every node's single-host URL ([`Nodes`]): a connection is made to one of them.
    nodes: Vec<String>,
    /// The node tried first: the one the last connection reached.
    preferred: AtomicUsize,
    pub(crate) opts: RabbitOptions,
    /// [`RabbitOptions::tls`] read at connect time: every connection attempt presents it.
    tls: lapin::tcp::OwnedTLSConfig,
    pub(crate) management: Option<Management>,
    pub(crate) store: topology::SettingsStore,
    pub(crate) conn: Mutex<Option<Arc<Connection>>>,
    /// The publishing channels (read on every publish: a plain lock, held only to clone
    /// the handle): the shared one, and one per stream reliq appends to.
    pub(crate) publishers: StdMutex<Publishers>,
    /// Serialises reopening a publishing channel.
    pub(crate) publisher_reopen: Mutex<()>,
    pub(crate) exchanges: StdMutex<HashSet<String>>,
}

/// The open publishing channels, each in confirm mode.
#[derive(Default)]
pub(crate) struct Publishers {
    /// Every publish that is not a stream append.
    shared: Option<Arc<Channel>>,
    /// A channel of its own per stream, by stream name: every publish on it goes to that
    /// stream, so the channel's publish sequence and its stream writer's sequence agree.
    streams: HashMap<String, Arc<Channel>>,
}

/// Which publishing channel a publish goes out on.
#[derive(Clone, Copy)]
enum Lane<'a> {
    Shared,
    Stream(&'a str),
}

impl<'a> Lane<'a> {
    fn of(what: Target<'a>) -> Self {
        match what {
            Target::Stream(_, stream) => Lane::Stream(stream),
            Target::Exchange(..) | Target::Queue(..) => Lane::Shared,
        }
    }
}

impl Publishers {
    fn slot(&self, lane: Lane<'_>) -> Option<&Arc<Channel>> {
        match lane {
            Lane::Shared => self.shared.as_ref(),
            Lane::Stream(stream) => self.streams.get(stream),
        }
    }

    fn set(&mut self, lane: Lane<'_>, ch: Arc<Channel>) {
        match lane {
            Lane::Shared => self.shared = Some(ch),
            Lane::Stream(stream) => drop(self.streams.insert(stream.to_owned(), ch)),
        }
    }

    /// Forget `lane`'s channel if it is still `ch` (not one a concurrent publish opened
    /// since); the caller closes it.
    fn take_if(&mut self, lane: Lane<'_>, ch: &Arc<Channel>) -> Option<Arc<Channel>> {
        let same = |c: &Arc<Channel>| Arc::ptr_eq(c, ch);
        match lane {
            Lane::Shared => self.shared.take_if(|c| same(c)),
            Lane::Stream(stream) => match self.streams.get(stream) {
                Some(c) if same(c) => self.streams.remove(stream),
                _ => None,
            },
        }
    }
}

impl Inner {
    /// The virtual host of the URL (`/` when it names none, or cannot be parsed).
    pub(crate) fn vhost(&self) -> String {
        self.url
            .parse::<lapin::uri::AMQPUri>()
            .map(|u| u.vhost)
            .unwrap_or_else(|_| "/".to_owned())
    }

    /// One connection attempt per node, from the preferred one on, until one succeeds
    /// (the error is the last node's). A cluster's clients move to a live node this way
    /// when theirs is lost: the receivers re-declare and resume on the new connection.
    async fn connect_once(&self) -> Result<Connection, BrokerError> {
        let n = self.node_count();
        let start = self.preferred_node();
        let mut last = BrokerError::connection("no node in the URL");
        for k in (0..n).map(|i| (start + i) % n) {
            match self.connect_node(k).await {
                Ok(c) => {
                    if k != start {
                        tracing::info!(node = k, "connected to another RabbitMQ node of the URL");
                    }
                    self.preferred.store(k, Ordering::Relaxed);
                    return Ok(c);
                }
                Err(e) => last = e,
            }
            if n > 1 {
                tracing::warn!(node = k, error = %last, "connecting to a RabbitMQ node failed; trying the next");
            }
        }
        Err(last)
    }

    /// How many nodes the URL names (at least one).
    pub(crate) fn node_count(&self) -> usize {
        self.nodes.len().max(1)
    }

    /// The node the shared connection was made to (or is tried first).
    pub(crate) fn preferred_node(&self) -> usize {
        self.preferred.load(Ordering::Relaxed) % self.node_count()
    }

    /// One connection attempt to node `k` of the URL (bounded: a node that accepts TCP
    /// but never answers must not hold the caller; the others may be up). Not the shared
    /// connection: a caller that needs a particular node (a stream read that the shared
    /// connection's node cannot serve) owns what this returns, and closes it.
    pub(crate) async fn connect_node(&self, k: usize) -> Result<Connection, BrokerError> {
        let url = self
            .nodes
            .get(k)
            .ok_or_else(|| BrokerError::connection(format!("no node {k} in the URL")))?;
        let props = ConnectionProperties::default()
            .with_connection_name(self.opts.connection_name.clone().into());
        let connecting = lapin::DefaultConnectionBuilder::new()
            .map_err(|e| RabbitError::client("starting the AMQP client", e))?
            .with_uri_str(url.clone())
            .with_properties(props)
            .with_tls_config(self.tls.clone());
        match tokio::time::timeout(NODE_CONNECT_TIMEOUT, connecting.connect()).await {
            Ok(Ok(c)) => Ok(c),
            Ok(Err(e)) => Err(refused_connection(e)),
            Err(_) => Err(BrokerError::connection(format!(
                "no answer within {NODE_CONNECT_TIMEOUT:?}"
            ))),
        }
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
                // A refused sign-in or certificate does not heal by waiting.
                Err(e @ (BrokerError::Unauthorized { .. } | BrokerError::Config { .. })) => {
                    return Err(e);
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

    /// A channel opened and closed: the broker answered both (the `ping` of the seam).
    pub(crate) async fn ping(&self) -> Result<(), BrokerError> {
        let ch = self.channel().await?;
        ch.close(200, "reliq ping".into())
            .await
            .map_err(|e| RabbitError::client("closing a channel", e))
    }

    /// A new channel on a live connection.
    pub(crate) async fn channel(&self) -> Result<Channel, BrokerError> {
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

    /// The publishing channel of `lane` (confirm mode), reopened when closed.
    async fn publisher(&self, lane: Lane<'_>) -> Result<Arc<Channel>, BrokerError> {
        if let Some(ch) = self.open_publisher(lane) {
            return Ok(ch);
        }
        let _reopening = self.publisher_reopen.lock().await;
        if let Some(ch) = self.open_publisher(lane) {
            return Ok(ch); // reopened by a concurrent publish meanwhile
        }
        let ch = self.channel().await?;
        ch.confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|e| RabbitError::client("confirm.select", e))?;
        let ch = Arc::new(ch);
        lock(&self.publishers).set(lane, ch.clone());
        Ok(ch)
    }

    /// The publishing channel of `lane`, if it is open.
    fn open_publisher(&self, lane: Lane<'_>) -> Option<Arc<Channel>> {
        lock(&self.publishers)
            .slot(lane)
            .filter(|ch| ch.status().connected())
            .cloned()
    }

    /// Close `lane`'s channel `ch` (unless a concurrent publish replaced it already): the
    /// next publish opens a fresh one.
    async fn retire_publisher(&self, lane: Lane<'_>, ch: &Arc<Channel>) {
        let retired = lock(&self.publishers).take_if(lane, ch);
        let Some(ch) = retired else { return };
        if let Err(e) = ch
            .close(200, "reliq: a fresh channel for this stream".into())
            .await
        {
            tracing::debug!(error = %e, "closing a stream's publishing channel");
        }
    }

    /// Check (once per process) that `exchange` exists, on a throwaway channel: a publish
    /// to a missing exchange would close the shared publishing channel under every
    /// concurrent publish.
    async fn ensure_exchange(&self, exchange: &str) -> Result<(), BrokerError> {
        if exchange.is_empty() || lock(&self.exchanges).contains(exchange) {
            return Ok(());
        }
        let name = short("exchange", exchange)?;
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

    pub(crate) fn known_exchange(&self, exchange: &str) {
        lock(&self.exchanges).insert(exchange.to_owned());
    }

    fn forget_exchange(&self, exchange: &str) {
        lock(&self.exchanges).remove(exchange);
    }

    /// Publish `message` to `exchange` with `routing_key`, mandatory and persistent, and
    /// wait for the confirm. `what` names the destination in errors.
    ///
    /// A stream append ([`Target::Stream`]) goes out on a channel of the stream's own,
    /// which is closed after any outcome but a plain confirm. RabbitMQ before 4.0.0
    /// (fixed by rabbitmq-server#12236) loses confirmed stream publishes on a channel
    /// that also publishes elsewhere: when the stream's leader changes, the channel
    /// re-sends its unconfirmed appends numbered with the channel's publish sequence
    /// instead of its stream writer's; that sequence runs ahead once the channel has
    /// published to another queue, so the new leader then takes every later append of
    /// the channel for a duplicate, drops it and confirms it. (Chaos round S lost 200
    /// confirmed dead letters so, on a channel shared with retry copies.) On a channel
    /// that only appends to one stream the two sequences are equal, and a fresh channel
    /// after a return, nack, error or timeout keeps them so.
    pub(crate) async fn publish_to(
        &self,
        exchange: &str,
        routing_key: &str,
        message: &Message,
        what: Target<'_>,
    ) -> Result<(), BrokerError> {
        // Every wait here is bounded, so a settle that sends a copy fails (and is held and
        // tried again) rather than hanging on a connection that never moves again — one
        // the broker blocked, or whose link drops packets without a reset. Finding a
        // channel may reconnect across the nodes (each within NODE_CONNECT_TIMEOUT);
        // sending and confirming get `confirm_timeout` each.
        let confirm = self.opts.confirm_timeout;
        let lane = Lane::of(what);
        let find = NODE_CONNECT_TIMEOUT * 3 + confirm;
        let ch = tokio::time::timeout(find, async {
            self.ensure_exchange(exchange).await?;
            self.publisher(lane).await
        })
        .await
        .map_err(|_| BrokerError::Timeout(find))??;
        let result = tokio::time::timeout(
            confirm * 2,
            self.publish_on(&ch, exchange, routing_key, message, what),
        )
        .await
        .unwrap_or(Err(BrokerError::Timeout(confirm * 2)));
        if matches!(lane, Lane::Stream(_)) && result.is_err() {
            self.retire_publisher(lane, &ch).await;
        }
        result
    }

    async fn publish_on(
        &self,
        ch: &Channel,
        exchange: &str,
        routing_key: &str,
        message: &Message,
        what: Target<'_>,
    ) -> Result<(), BrokerError> {
        let props = codec::properties(message)?;
        let ex = short("exchange", exchange)?;
        let rk = short("routing key", routing_key)?;
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
    pub(crate) inner: Arc<Inner>,
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
        let tls = options.tls.load()?;
        let management = options
            .management_url
            .as_deref()
            .map(|url| Management::configured(url, &tls))
            .transpose()?;
        let nodes = Nodes::parse(url)?.urls();
        let first = nodes.first().cloned().unwrap_or_else(|| url.to_owned());
        let store = settings_store(&first, &options, management.as_ref()).await?;
        let inner = Arc::new(Inner {
            url: first,
            nodes,
            preferred: AtomicUsize::new(0),
            opts: options,
            tls: tls.lapin(),
            management,
            store,
            conn: Mutex::new(None),
            publishers: StdMutex::new(Publishers::default()),
            publisher_reopen: Mutex::new(()),
            exchanges: StdMutex::new(HashSet::new()),
        });
        // The first connection fails fast: a wrong URL is a configuration error.
        let with_certificate = inner.opts.tls.cert.is_some();
        let conn = inner.connect_once().await.map_err(|e| match e {
            // Under TLS 1.3 a broker judges the client certificate after the client's
            // handshake is done, and its alert often loses the race with the reset of
            // the socket it closes. At the first connection that is the likely cause
            // (a broker going down refuses the TCP connection instead); later, in the
            // reconnect loop, a reset is retried like any lost connection.
            BrokerError::Connection { .. }
                if with_certificate && e.to_string().contains("reset by peer") =>
            {
                BrokerError::Config {
                    field: "certfile".into(),
                    reason: format!(
                        "the broker reset the connection right after the TLS handshake, \
                         before the AMQP sign-in: it most likely refused the client \
                         certificate (another CA, expired, revoked; its log says which): {e}"
                    ),
                }
            }
            lost @ BrokerError::Connection { .. } => {
                BrokerError::connection(format!("connecting to RabbitMQ failed: {lost}"))
                    .caused_by(lost)
            }
            refused => refused,
        })?;
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

    /// What [`Broker::subscribe`] declares for `sub` and the equivalent policies as
    /// `rabbitmqctl` commands (see [`plan_text`](crate::topology::plan_text)), for the probed server
    /// version. [`Broker::plan`] is the same plan as data.
    pub async fn plan_text(&self, sub: &Subscription) -> String {
        let version = self.server_version().await;
        topology::plan_text(sub, &self.inner.opts, version.as_deref())
    }
}
