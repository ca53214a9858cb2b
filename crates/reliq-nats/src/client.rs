//! The connection: publishing and topology. The [`Broker`](reliq_core::Broker)
//! implementation is in `broker`.

use reliq_core::{BrokerError, Message, Subscription, seam::lock};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::{self, consumer::pull, stream};
use tokio::task::JoinHandle;

use crate::clock::ServerClock;
use crate::codec::{MSG_ID, to_nats_headers};
use crate::error::{api, connection};
use crate::names::{
    consumer_name, dead_letter_stream, dead_letter_subject, retry_subjects, stream_name,
};
use crate::options::{ExistingConsumer, NatsOptions};
use crate::topology::DEAD_LETTER_DUPLICATE_WINDOW;

/// A connection to NATS JetStream. Cheap to clone.
#[derive(Clone)]
pub struct NatsBroker {
    pub(crate) inner: Arc<Inner>,
}

impl std::fmt::Debug for NatsBroker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsBroker").finish_non_exhaustive()
    }
}

pub(crate) struct Inner {
    pub(crate) client: async_nats::Client,
    pub(crate) js: jetstream::Context,
    pub(crate) options: NatsOptions,
    pub(crate) advisory_watchers: Mutex<HashMap<(String, String), JoinHandle<()>>>,
    /// The server's clock, which fires the retries' schedules.
    pub(crate) clock: ServerClock,
}

impl Drop for Inner {
    fn drop(&mut self) {
        for (_, watcher) in lock(&self.advisory_watchers).drain() {
            watcher.abort();
        }
    }
}

/// The servers a URL names: one, or a cluster's, listed in the authority with commas
/// (`nats://user:password@h1:4222,h2:4222,h3:4222`; each gets the scheme and the
/// credentials). async-nats connects to one of them and, when it loses that one, to
/// another (it also learns the cluster's other servers from the one it reached).
fn server_addrs(address: &str) -> Result<Vec<async_nats::ServerAddr>, BrokerError> {
    let bad = |reason: String| BrokerError::Config {
        field: "url".into(),
        reason,
    };
    let (scheme, authority) = address
        .split_once("://")
        .ok_or_else(|| bad("expected nats://host:port or tls://host:port".into()))?;
    let (userinfo, hosts) = match authority.rsplit_once('@') {
        Some((user, hosts)) => (format!("{user}@"), hosts),
        None => (String::new(), authority),
    };
    hosts
        .split(',')
        .map(|host| {
            let host = host.trim();
            if host.is_empty() {
                return Err(bad("an empty host in the URL's host list".into()));
            }
            format!("{scheme}://{userinfo}{host}")
                .parse()
                .map_err(|e: std::io::Error| bad(format!("`{}`: {e}", redact(host))))
        })
        .collect()
}

impl NatsBroker {
    /// Connect with default options. URL: `nats://[user:password@]host:port[?token=…]`, or
    /// `tls://…` to require TLS; a cluster's servers separated by commas
    /// (`nats://h1:4222,h2:4222,h3:4222?reliq.replicas=3`). A client reconnects to any
    /// server of the cluster, the ones it advertises included;
    /// `?reliq.ignore_discovered_servers=true` keeps it to the URL's servers (when the
    /// cluster is reached through a proxy, a load balancer or NAT). Credentials are never
    /// logged.
    ///
    /// Secured servers: `tls.ca=PATH` (a private CA), `tls.cert=PATH&tls.key=PATH` (a
    /// client certificate), `user=…&password=…`, `token=…`, `nkey=SEED` (an nkey user's
    /// seed), `creds=PATH` (a credentials file: user JWT + nkey seed, the decentralized
    /// model); a secret may come from a file or the environment (`password.file=PATH`,
    /// `nkey.env=VAR`, see [`reliq_core::seam::secrets`]). A refused sign-in fails at once
    /// with [`BrokerError::Unauthorized`], a refused TLS handshake with
    /// [`BrokerError::Config`] naming `tls.*`.
    pub async fn connect(url: &str) -> Result<Self, BrokerError> {
        Self::connect_with(url, NatsOptions::default()).await
    }

    /// Connect with options.
    pub async fn connect_with(url: &str, options: NatsOptions) -> Result<Self, BrokerError> {
        let mut options = options;
        let (address, query) = url.split_once('?').unwrap_or((url, ""));
        let mut connect = async_nats::ConnectOptions::new()
            .name("reliq")
            .connection_timeout(Duration::from_secs(10))
            .event_callback(|event| async move { log_event(&event) });
        let bad = |field: &str, reason: String| BrokerError::Config {
            field: field.to_owned(),
            reason,
        };
        let (mut user, mut password) = (None, None);
        let (mut client_cert, mut client_key) = (None, None);
        for (k, v) in query.split('&').filter_map(|kv| kv.split_once('=')) {
            let raw = reliq_core::seam::secrets::percent_decode(v);
            let (k, v) = reliq_core::seam::secrets::resolve_setting(k, &raw)
                .map_err(|e| bad(k, e.to_string()))?;
            let v = v.as_ref();
            match k {
                "token" => connect = connect.token(v.to_owned()),
                "user" => user = Some(v.to_owned()),
                "password" => password = Some(v.to_owned()),
                "nkey" => connect = connect.nkey(v.to_owned()),
                "creds" => {
                    connect = connect
                        .credentials_file(v)
                        .await
                        .map_err(|e| bad("creds", format!("`{v}`: {e}")))?;
                }
                "tls.ca" => connect = connect.add_root_certificates(v.into()),
                "tls.cert" => client_cert = Some(std::path::PathBuf::from(v)),
                "tls.key" => client_key = Some(std::path::PathBuf::from(v)),
                "name" => connect = connect.name(v),
                "reliq.replicas" => {
                    options.replicas =
                        v.parse()
                            .ok()
                            .filter(|r| (1..=5).contains(r))
                            .ok_or_else(|| {
                                bad(
                                    "reliq.replicas",
                                    format!("`{v}` is not a stream replica count (1 to 5)"),
                                )
                            })?;
                }
                // Only the URL's servers, never the ones the cluster advertises (behind a
                // proxy, a load balancer or NAT, where those addresses do not reach it).
                "reliq.ignore_discovered_servers" => match v {
                    "true" => connect = connect.ignore_discovered_servers(),
                    "false" => {}
                    _ => {
                        return Err(bad(
                            "reliq.ignore_discovered_servers",
                            format!("`{v}` is not true or false"),
                        ));
                    }
                },
                other => {
                    return Err(bad(
                        &format!("url query `{other}`"),
                        "unknown NATS URL option (known: token, user, password, nkey, creds, \
                         tls.ca, tls.cert, tls.key, name, reliq.replicas, \
                         reliq.ignore_discovered_servers; any of them as <key>.file or <key>.env)"
                            .into(),
                    ));
                }
            }
        }
        match (user, password) {
            (Some(u), Some(p)) => connect = connect.user_and_password(u, p),
            (None, None) => {}
            (Some(_), None) => {
                return Err(bad("password", "`user` is set without a password".into()));
            }
            (None, Some(_)) => return Err(bad("user", "`password` is set without a user".into())),
        }
        match (client_cert, client_key) {
            (Some(cert), Some(key)) => connect = connect.add_client_certificate(cert, key),
            (None, None) => {}
            (Some(_), None) => return Err(bad("tls.key", "`tls.cert` needs its key".into())),
            (None, Some(_)) => {
                return Err(bad("tls.cert", "`tls.key` needs its certificate".into()));
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
        let servers = server_addrs(&address)?;
        let at = redact(&address);
        let client = connect
            .connect(servers.as_slice())
            .await
            .map_err(|e| connect_error(e, &at))?;
        let js = jetstream::new(client.clone());
        Ok(Self {
            inner: Arc::new(Inner {
                client,
                js,
                options,
                advisory_watchers: Mutex::new(HashMap::new()),
                clock: ServerClock::default(),
            }),
        })
    }

    /// Declare the source stream (idempotent): subjects `<source>` and `<source>.>`, and
    /// [`retry_subjects`](crate::names::retry_subjects) `retry.<stream>.>` with message schedules
    /// allowed, where its consumers' retries wait (NATS 2.12+). A stream that exists
    /// without them (made by another tool, or by an older reliq) is updated to have them.
    pub async fn declare_source(&self, source: &str) -> Result<(), BrokerError> {
        let retries = retry_subjects(source);
        let stream = self
            .inner
            .js
            .get_or_create_stream(stream::Config {
                name: stream_name(source),
                subjects: vec![source.to_owned(), format!("{source}.>"), retries.clone()],
                allow_direct: true,
                allow_message_schedules: true,
                num_replicas: self.inner.options.replicas,
                ..Default::default()
            })
            .await
            .map_err(api(format!(
                "declaring source stream `{}`",
                stream_name(source)
            )))?;
        let mut config = stream.cached_info().config.clone();
        if config.allow_message_schedules && config.subjects.contains(&retries) {
            return Ok(());
        }
        tracing::info!(stream = %config.name, subjects = %retries,
            "adding the retry subjects and message schedules to the source stream");
        config.allow_message_schedules = true;
        if !config.subjects.contains(&retries) {
            config.subjects.push(retries);
        }
        self.inner
            .js
            .update_stream(&config)
            .await
            .map_err(api(format!(
                "updating source stream `{}` for retries (message schedules need NATS 2.12+)",
                config.name
            )))?;
        Ok(())
    }

    /// Declare the subscription's DLQ stream (idempotent). A dead letter stays until an
    /// operator tool (replay, purge) removes it through [`Broker::dead_letters`](reliq_core::Broker::dead_letters).
    pub async fn declare_dead_letters(&self, sub: &Subscription) -> Result<(), BrokerError> {
        let stream = self
            .inner
            .js
            .get_or_create_stream(stream::Config {
                name: dead_letter_stream(sub),
                subjects: vec![dead_letter_subject(sub)],
                allow_direct: true,
                num_replicas: self.inner.options.replicas,
                duplicate_window: DEAD_LETTER_DUPLICATE_WINDOW,
                ..Default::default()
            })
            .await
            .map_err(api(format!(
                "declaring DLQ stream `{}`",
                dead_letter_stream(sub)
            )))?;
        // A DLQ stream made before the window was set (or by hand) gets it: a longer
        // window only drops more repeats.
        let mut config = stream.cached_info().config.clone();
        if config.duplicate_window < DEAD_LETTER_DUPLICATE_WINDOW {
            tracing::info!(stream = %config.name, from = ?config.duplicate_window,
                to = ?DEAD_LETTER_DUPLICATE_WINDOW, "lengthening the DLQ stream's duplicate window");
            config.duplicate_window = DEAD_LETTER_DUPLICATE_WINDOW;
            self.inner
                .js
                .update_stream(config)
                .await
                .map_err(api(format!(
                    "setting the duplicate window of DLQ stream `{}`",
                    dead_letter_stream(sub)
                )))?;
        }
        Ok(())
    }

    /// Delete the subscription's DLQ stream (for fault-injection tests: the DLQ becomes
    /// unavailable; [`NatsBroker::declare_dead_letters`] restores it). Feature `test-util`.
    #[cfg(feature = "test-util")]
    pub async fn delete_dead_letters(&self, sub: &Subscription) -> Result<(), BrokerError> {
        self.inner
            .js
            .delete_stream(dead_letter_stream(sub))
            .await
            .map_err(api(format!(
                "deleting DLQ stream `{}`",
                dead_letter_stream(sub)
            )))?;
        Ok(())
    }

    /// A JetStream account-info request (the `ping` of the seam).
    pub(crate) async fn ping_jetstream(&self) -> Result<(), BrokerError> {
        self.inner
            .js
            .query_account()
            .await
            .map(drop)
            .map_err(api("reading the JetStream account info"))
    }

    /// The subscription's source stream, as the server describes it.
    async fn source_stream(
        &self,
        sub: &Subscription,
    ) -> Result<jetstream::stream::Stream, BrokerError> {
        let name = stream_name(&sub.source);
        self.inner
            .js
            .get_stream(&name)
            .await
            .map_err(api(format!("reading source stream `{name}`")))
    }

    /// Every stream and its durable consumers, as `stream` and `stream/consumer`, sorted
    /// (for tests that check an operation created nothing). Feature `test-util`.
    #[cfg(feature = "test-util")]
    pub async fn object_names(&self) -> Result<Vec<String>, BrokerError> {
        use futures::TryStreamExt;
        let streams: Vec<String> = self
            .inner
            .js
            .stream_names()
            .try_collect()
            .await
            .map_err(api("listing streams"))?;
        let mut names = Vec::new();
        for stream in streams {
            let consumers: Vec<String> = match self.inner.js.get_stream(&stream).await {
                Ok(s) => s
                    .consumer_names()
                    .try_collect()
                    .await
                    .map_err(api(format!("listing the consumers of `{stream}`")))?,
                // Deleted since it was listed.
                Err(e) if crate::error::stream_not_found(&e) => continue,
                Err(e) => return Err(api(format!("reading stream `{stream}`"))(e)),
            };
            names.extend(consumers.into_iter().map(|c| format!("{stream}/{c}")));
            names.push(stream);
        }
        names.sort();
        Ok(names)
    }

    /// Unacknowledged deliveries of the subscription's consumer, from the server.
    pub async fn ack_pending(&self, sub: &Subscription) -> Result<usize, BrokerError> {
        let stream = self.source_stream(sub).await?;
        let info = stream
            .consumer_info(consumer_name(&sub.consumer))
            .await
            .map_err(api(format!(
                "reading consumer `{}`",
                consumer_name(&sub.consumer)
            )))?;
        Ok(info.num_ack_pending)
    }

    /// The consumer's pending and ack-pending counts and the retries waiting on their
    /// schedules (the schedule subjects `retry.<stream>.<consumer>.at.*` of the source
    /// stream, counted from the server's per-subject totals).
    pub(crate) async fn read_backlog(
        &self,
        sub: &Subscription,
    ) -> Result<reliq_core::Backlog, BrokerError> {
        use futures::TryStreamExt as _;
        let stream = self.source_stream(sub).await?;
        let consumer = consumer_name(&sub.consumer);
        let info = stream
            .consumer_info(&consumer)
            .await
            .map_err(api(format!("reading consumer `{consumer}`")))?;
        let schedules = crate::names::retry_schedules(sub);
        let retries: usize = stream
            .info_with_subjects(&schedules)
            .await
            .map_err(api(format!(
                "counting the retries waiting on `{schedules}`"
            )))?
            .map_ok(|(_, count)| count)
            .try_fold(0, |sum, count| async move { Ok(sum + count) })
            .await
            .map_err(api(format!(
                "counting the retries waiting on `{schedules}`"
            )))?;
        Ok(reliq_core::Backlog::waiting(info.num_pending)
            .with_in_flight(Some(info.num_ack_pending as u64))
            .with_retries(retries as u64))
    }

    /// Park `dead` in the subscription's DLQ stream, confirmed, once per source message:
    /// the `Nats-Msg-Id` names the stream message first consumed (`origin_seq`: the
    /// message itself, or the one a retry copy was made from), so its redeliveries, its
    /// retry copies and the advisory watcher's entry for it make one entry within the
    /// DLQ's duplicate window ([`DEAD_LETTER_DUPLICATE_WINDOW`]). Not keyed by message id:
    /// a producer outside reliq may give distinct messages one id (the fuzz test's foreign
    /// messages do: keyed by id, all but one of them were dropped as duplicates — lost).
    pub(crate) async fn publish_dead_letter(
        &self,
        sub: &Subscription,
        origin_seq: u64,
        dead: Message,
    ) -> Result<(), BrokerError> {
        let mut headers = to_nats_headers(&dead);
        let msg_id = format!("dl:{}:{origin_seq}", stream_name(&sub.source));
        headers.insert(MSG_ID, msg_id);
        let (_, _, payload, _) = dead.into_parts();
        self.publish_raw(dead_letter_subject(sub), headers, payload)
            .await
    }

    pub(crate) async fn publish_raw(
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
                jetstream::context::PublishErrorKind::BrokenPipe => {
                    connection(format!("publishing to `{subject}`"))(e)
                }
                _ => {
                    let reason = format!("publish to `{subject}`: {e}");
                    BrokerError::rejected(reason).caused_by(e)
                }
            }),
        }
    }

    async fn consumer_config(
        &self,
        sub: &Subscription,
    ) -> Result<jetstream::consumer::Consumer<pull::Config>, BrokerError> {
        let stream = self.source_stream(sub).await?;
        let wanted = crate::topology::wanted_consumer(sub, &self.inner.options);
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
                if !c.filter_subject.is_empty() || c.filter_subjects != wanted.filter_subjects {
                    let had = if c.filter_subject.is_empty() {
                        c.filter_subjects.join(", ")
                    } else {
                        c.filter_subject.clone()
                    };
                    differs.push(format!(
                        "filter subjects `{had}` ≠ `{}`",
                        wanted.filter_subjects.join(", ")
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
                            return stream
                                .update_consumer(wanted)
                                .await
                                .map_err(api(format!("updating consumer `{name}`")));
                        }
                    }
                }
                stream
                    .get_consumer(&name)
                    .await
                    .map_err(api(format!("opening consumer `{name}`")))
            }
            Err(_) => stream
                .create_consumer(wanted)
                .await
                .map_err(api(format!("creating consumer `{name}`"))),
        }
    }

    /// The streams and the durable consumer of `sub` (idempotent).
    pub(crate) async fn declare_all(
        &self,
        sub: &Subscription,
    ) -> Result<jetstream::consumer::Consumer<pull::Config>, BrokerError> {
        self.declare_source(&sub.source).await?;
        self.declare_dead_letters(sub).await?;
        self.consumer_config(sub).await
    }
}

/// How long subscribing (and opening the DLQ) keeps trying while JetStream answers as a
/// cluster does during a leader election (a server lost: meta or stream leader moving),
/// seconds on a healthy cluster — or does not answer in time. Other errors (a bad
/// configuration) fail at once. A minute, as the other backends' subscribes: a consumer
/// restarted during a chaos round's node pause and lossy link timed out declaring its
/// stream after 30 s and exited.
const ELECTION_WAIT: Duration = Duration::from_secs(60);

/// Whether `e` is JetStream unable to answer for now — the API request timed out, or the
/// cluster says it is not available, not active, not the leader or incomplete — rather
/// than a refusal.
fn electing(e: &BrokerError) -> bool {
    use async_nats::jetstream::ErrorCode;
    use async_nats::jetstream::context::{
        CreateStreamError, CreateStreamErrorKind, GetStreamError, GetStreamErrorKind,
    };
    use async_nats::jetstream::stream::{ConsumerError, ConsumerErrorKind};
    let cluster = |e: &async_nats::jetstream::Error| {
        [
            ErrorCode::CLUSTER_NOT_AVAILABLE,
            ErrorCode::CLUSTER_NOT_ACTIVE,
            ErrorCode::CLUSTER_NOT_LEADER,
            ErrorCode::CLUSTER_INCOMPLETE,
            ErrorCode::CLUSTER_NO_PEERS,
        ]
        .contains(&e.error_code())
    };
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = source {
        if let Some(c) = err.downcast_ref::<CreateStreamError>() {
            return match c.kind() {
                CreateStreamErrorKind::TimedOut | CreateStreamErrorKind::JetStreamUnavailable => {
                    true
                }
                CreateStreamErrorKind::JetStream(j) => cluster(&j),
                _ => false,
            };
        }
        if let Some(c) = err.downcast_ref::<ConsumerError>() {
            return match c.kind() {
                ConsumerErrorKind::TimedOut => true,
                ConsumerErrorKind::JetStream(j) => cluster(&j),
                _ => false,
            };
        }
        if let Some(c) = err.downcast_ref::<GetStreamError>() {
            return match c.kind() {
                GetStreamErrorKind::Request => true,
                GetStreamErrorKind::JetStream(j) => cluster(&j),
                _ => false,
            };
        }
        source = err.source();
    }
    false
}

/// `attempt`, made again (backing off to 5 s) for up to [`ELECTION_WAIT`] while
/// JetStream is electing a leader or not answering (see [`electing`]), or the connection
/// is lost; any other error at once.
pub(crate) async fn through_election<T, F>(
    doing: &str,
    attempt: impl FnMut() -> F,
) -> Result<T, BrokerError>
where
    F: std::future::Future<Output = Result<T, BrokerError>>,
{
    reliq_core::through_outage(
        &format!("{doing} (JetStream electing a leader, a server lost?)"),
        reliq_core::OutageWait::up_to(ELECTION_WAIT),
        |e| e.is_unreachable() || electing(e),
        attempt,
    )
    .await
}

/// What the server tells the client outside any request's answer. A permissions
/// violation is otherwise silent: the request it refused (a pull, a publish, a JetStream
/// API call) just never gets its answer.
fn log_event(event: &async_nats::Event) {
    use async_nats::{Event, ServerError};
    match event {
        Event::ServerError(ServerError::Other(text)) if text.contains("Permissions Violation") => {
            crate::error::record_violation(text);
            tracing::error!(server = %text, "NATS refused a subject this user is not allowed: \
                grant what `reliq topology permissions` prints for the consumer");
        }
        Event::ServerError(e) => tracing::error!(server = %e, "NATS server error"),
        Event::SlowConsumer(sid) => tracing::warn!(
            sid,
            "NATS: this client reads too slowly; messages were dropped by the server"
        ),
        Event::LameDuckMode => tracing::warn!(
            "NATS: the server is shutting down (lame duck mode); reconnecting elsewhere"
        ),
        Event::ClientError(e) => tracing::warn!(error = %e, "NATS client error"),
        other => tracing::debug!(event = %other, "NATS connection event"),
    }
}

/// A failed first connection: a refused sign-in is permanent and says so, a refused TLS
/// handshake is a setting to fix; the rest (down, unreachable) is a lost connection.
fn connect_error(e: async_nats::ConnectError, at: &str) -> BrokerError {
    use async_nats::ConnectErrorKind::{Authentication, AuthorizationViolation, Io, Tls};
    let chain = reliq_core::ErrorChain(&e).to_string();
    // async-nats reports a certificate the handshake refused (rustls: "invalid peer
    // certificate", or the server's "received fatal alert") as an I/O error.
    let refused_tls =
        e.kind() == Io && (chain.contains("peer certificate") || chain.contains("fatal alert"));
    match e.kind() {
        AuthorizationViolation | Authentication => BrokerError::Unauthorized {
            resource: format!("the NATS server at {at}"),
            reason: format!("sign-in refused: {e}"),
            source: Some(Box::new(e)),
        },
        Tls => BrokerError::Config {
            field: "tls.*".into(),
            reason: format!("TLS with the NATS server at {at} failed: {chain}"),
        },
        Io if refused_tls => BrokerError::Config {
            field: "tls.*".into(),
            reason: format!("TLS with the NATS server at {at} refused: {chain}"),
        },
        _ => connection(format!("connecting to NATS at {at}"))(e),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_election_is_waited_through_and_a_refusal_is_not() {
        use async_nats::jetstream::context::{CreateStreamError, CreateStreamErrorKind};
        let timed_out = api("declaring source stream `s`")(CreateStreamError::new(
            CreateStreamErrorKind::TimedOut,
        ));
        assert!(electing(&timed_out));
        let refused = api("declaring source stream `s`")(CreateStreamError::new(
            CreateStreamErrorKind::InvalidStreamName,
        ));
        assert!(!electing(&refused));
        assert!(!electing(&BrokerError::connection("other")));
    }

    #[test]
    fn a_cluster_url_names_every_server_with_the_scheme_and_credentials() {
        let servers =
            server_addrs("nats://u:p@10.0.0.1:4222, 10.0.0.2:4223,node-3").expect("cluster");
        let named: Vec<(String, u16, Option<String>)> = servers
            .iter()
            .map(|s| {
                (
                    s.host().to_owned(),
                    s.port(),
                    s.username().map(str::to_owned),
                )
            })
            .collect();
        let user = Some("u".to_owned());
        assert_eq!(
            named,
            [
                ("10.0.0.1".to_owned(), 4222, user.clone()),
                ("10.0.0.2".to_owned(), 4223, user.clone()),
                ("node-3".to_owned(), 4222, user),
            ]
        );
        assert_eq!(server_addrs("tls://h:4222").expect("single").len(), 1);
        let err = server_addrs("nats://h1,,h3").expect_err("empty host");
        assert!(err.to_string().contains("empty host"), "{err}");
    }

    #[tokio::test]
    async fn bad_url_options_fail_before_connecting_naming_the_option() {
        // Port 1: nothing listens; the options are refused before any connection.
        for (url, field) in [
            ("nats://127.0.0.1:1?reliq.replicas=7", "reliq.replicas"),
            (
                "nats://127.0.0.1:1?reliq.ignore_discovered_servers=yes",
                "reliq.ignore_discovered_servers",
            ),
            (
                "nats://127.0.0.1:1?reliq.replica=3",
                "url query `reliq.replica`",
            ),
        ] {
            match NatsBroker::connect(url).await {
                Err(BrokerError::Config { field: f, .. }) => assert_eq!(f, field, "{url}"),
                Err(other) => panic!("{url}: {other}"),
                Ok(_) => panic!("{url} connected"),
            }
        }
    }

    #[test]
    fn credentials_are_redacted() {
        assert_eq!(redact("nats://u:secret@h:4222"), "nats://***@h:4222");
    }
}
