//! Refused connections, reported at once.
//!
//! librdkafka reports a refused TLS handshake (wrong CA, an expired or unknown client
//! certificate), a failed SASL authentication or a plaintext client on a TLS listener
//! only through its error callback, and keeps reconnecting; the request that needed the
//! connection waits for its own timeout (30 s for a publish or a topic creation) and then
//! says only "timed out". The producers and the admin client run with [`WatchingContext`],
//! which keeps the last such refusal; [`Refusals::or_refused`] ends a request with it as
//! soon as it is seen, naming the cause (librdkafka's words: they carry no secret).

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::oauth::TokenSource;
use rdkafka::client::ClientContext;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::error::{KafkaError as RdError, RDKafkaErrorCode};
use reliq_core::{BrokerError, seam::lock};
use tokio::sync::watch;

/// A refusal seen this recently fails the next request at once: librdkafka tries again
/// after at most `reconnect.backoff.max.ms` (10 s), and would be refused the same way.
const FRESH: Duration = Duration::from_secs(15);

/// What refused the connection.
#[derive(Clone, Debug)]
pub(crate) struct Refusal {
    kind: RefusalKind,
    /// librdkafka's text, e.g. `ssl://127.0.0.1:9493/bootstrap: SSL handshake failed: …`.
    reason: String,
    at: Instant,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RefusalKind {
    /// SASL authentication failed (wrong password, unknown user, mechanism not enabled).
    Authentication,
    /// The TLS handshake failed (either side's certificate refused).
    Tls,
    /// The listener speaks another protocol (plaintext client, TLS listener).
    Protocol,
}

impl Refusal {
    fn of(error: &RdError, reason: &str) -> Option<Self> {
        let kind = match error.rdkafka_error_code()? {
            RDKafkaErrorCode::Authentication | RDKafkaErrorCode::SaslAuthenticationFailed
                if reason.contains("SSL") =>
            {
                RefusalKind::Tls
            }
            RDKafkaErrorCode::Authentication | RDKafkaErrorCode::SaslAuthenticationFailed => {
                RefusalKind::Authentication
            }
            RDKafkaErrorCode::SSL => RefusalKind::Tls,
            // The broker refused this client's certificate: an alert in the handshake.
            RDKafkaErrorCode::BrokerTransportFailure if reason.contains("SSL routines") => {
                RefusalKind::Tls
            }
            // librdkafka's own hint when a plaintext client meets a TLS listener.
            RDKafkaErrorCode::BrokerTransportFailure
                if reason.contains("incorrect security.protocol") =>
            {
                RefusalKind::Protocol
            }
            _ => return None,
        };
        Some(Self {
            kind,
            reason: reason.to_owned(),
            at: Instant::now(),
        })
    }

    /// The seam's error: an authentication failure is [`BrokerError::Unauthorized`]
    /// (permanent), a TLS or protocol mismatch a configuration error naming the settings
    /// to look at.
    pub(crate) fn to_error(&self, bootstrap: &str) -> BrokerError {
        match self.kind {
            RefusalKind::Authentication => BrokerError::Unauthorized {
                resource: format!("the cluster at {bootstrap}"),
                reason: format!("SASL authentication refused: {}", self.reason),
                source: None,
            },
            RefusalKind::Tls => BrokerError::Config {
                field: "ssl.*".into(),
                reason: format!("TLS with {bootstrap} refused: {}", self.reason),
            },
            RefusalKind::Protocol => BrokerError::Config {
                field: "security.protocol".into(),
                reason: format!(
                    "{bootstrap} does not speak this security.protocol: {}",
                    self.reason
                ),
            },
        }
    }
}

/// The last refusal the clients of one broker connection saw, shared by their contexts.
#[derive(Clone)]
pub(crate) struct Refusals {
    last: Arc<watch::Sender<Option<Refusal>>>,
    /// When a request last succeeded: a refusal older than that is over.
    healed: Arc<Mutex<Option<Instant>>>,
    /// The distinct bootstrap servers.
    servers: usize,
    /// Servers that hung up on their first request, and when ([`Self::hung_up`]).
    hang_ups: Arc<Mutex<HashMap<String, Instant>>>,
}

impl Refusals {
    /// The refusals of the clients of the cluster at `bootstrap` (`host:port,…`).
    pub(crate) fn new(bootstrap: &str) -> Self {
        let mut servers: Vec<&str> = bootstrap.split(',').map(str::trim).collect();
        servers.sort_unstable();
        servers.dedup();
        Self {
            last: Arc::new(watch::Sender::new(None)),
            healed: Arc::new(Mutex::new(None)),
            servers: servers.len().max(1),
            hang_ups: Arc::new(Mutex::new(HashMap::new())),
        }
    }

    /// A server hung up at the first request: a protocol mismatch (a plaintext client on
    /// a TLS or SASL listener) only once **every** bootstrap server has done so within
    /// [`FRESH`]. One node alone doing it is a node going down, or a load balancer or
    /// proxy whose node is down (it accepts, then resets) — seen in the chaos rounds: a
    /// consumer starting during a node loss failed with a `security.protocol` error. The
    /// client carries on through the other nodes then.
    fn hung_up(&self, refusal: Refusal) {
        let server = server_of(&refusal.reason).unwrap_or_default().to_owned();
        let all = {
            let mut hang_ups = lock(&self.hang_ups);
            hang_ups.retain(|_, at| at.elapsed() < FRESH);
            hang_ups.insert(server, refusal.at);
            hang_ups.len() >= self.servers
        };
        if all {
            self.last.send_replace(Some(refusal));
        }
    }

    fn refused(&self, refusal: Refusal) {
        if refusal.kind == RefusalKind::Protocol {
            self.hung_up(refusal);
        } else {
            self.last.send_replace(Some(refusal));
        }
    }

    /// A fresh refusal not healed by a later success.
    fn current(&self) -> Option<Refusal> {
        let healed = *lock(&self.healed);
        self.last
            .borrow()
            .clone()
            .filter(|r| r.at.elapsed() < FRESH && healed.is_none_or(|h| h < r.at))
    }

    /// `request`'s own result, unless a refusal ends it first (`Err`): one seen in the
    /// last seconds ends it at once, one seen while it waits ends it then. A success
    /// marks earlier refusals as over.
    pub(crate) async fn or_refused<T, E>(
        &self,
        bootstrap: &str,
        request: impl Future<Output = Result<T, E>>,
    ) -> Result<Result<T, E>, BrokerError> {
        if let Some(r) = self.current() {
            return Err(r.to_error(bootstrap));
        }
        let mut next = self.last.subscribe();
        next.mark_unchanged();
        tokio::select! {
            result = request => {
                if result.is_ok() {
                    *lock(&self.healed) = Some(Instant::now());
                }
                Ok(result)
            }
            refusal = async {
                loop {
                    if next.changed().await.is_err() {
                        // The sender lives as long as `self`: never ends first.
                        std::future::pending::<()>().await;
                    }
                    if let Some(r) = next.borrow_and_update().clone() {
                        return r;
                    }
                }
            } => Err(refusal.to_error(bootstrap)),
        }
    }
}

/// The server a librdkafka message is about: `127.0.0.1:9392` in
/// `[thrd:…]: 127.0.0.1:9392/bootstrap: Disconnected: …` or
/// `ssl://b-1.example:9094/2: SSL handshake failed: …`.
fn server_of(message: &str) -> Option<&str> {
    message
        .split_whitespace()
        .filter(|word| !word.starts_with("[thrd:"))
        .find_map(|word| {
            let word = word.strip_suffix(':')?;
            let word = word.rsplit("://").next()?;
            let (server, _name) = word.split_once('/')?;
            server.contains(':').then_some(server)
        })
}

/// The producers' and admin client's context: logs as librdkafka's default context does,
/// and keeps refusals in [`Refusals`].
pub(crate) struct WatchingContext {
    pub(crate) refusals: Refusals,
    /// Whether this client speaks plaintext (no TLS): then a listener that hangs up on its
    /// very first request is most likely a TLS listener.
    pub(crate) plaintext: bool,
    /// OAUTHBEARER tokens reliq makes (AWS MSK IAM), if any.
    pub(crate) tokens: TokenSource,
}

impl ClientContext for WatchingContext {
    crate::oauth::oauth_token_requests!(tokens);

    fn log(&self, level: RDKafkaLogLevel, fac: &str, message: &str) {
        // librdkafka reports a TLS listener closing on a plaintext client only in its
        // log, at the info level: a disconnect while asking for the API versions.
        if self.plaintext
            && message.contains("Disconnected")
            && message.contains("in state APIVERSION_QUERY")
        {
            self.refusals.refused(Refusal {
                kind: RefusalKind::Protocol,
                reason: format!(
                    "{message} — the listener closed the connection at the first request, as a TLS or SASL listener does with a plaintext client"
                ),
                at: Instant::now(),
            });
        }
        match level {
            RDKafkaLogLevel::Emerg
            | RDKafkaLogLevel::Alert
            | RDKafkaLogLevel::Critical
            | RDKafkaLogLevel::Error => {
                tracing::error!(target: "librdkafka", "librdkafka: {fac} {message}");
            }
            RDKafkaLogLevel::Warning => {
                tracing::warn!(target: "librdkafka", "librdkafka: {fac} {message}");
            }
            RDKafkaLogLevel::Notice | RDKafkaLogLevel::Info => {
                tracing::info!(target: "librdkafka", "librdkafka: {fac} {message}");
            }
            RDKafkaLogLevel::Debug => {
                tracing::debug!(target: "librdkafka", "librdkafka: {fac} {message}");
            }
        }
    }

    fn error(&self, error: RdError, reason: &str) {
        if let Some(refusal) = Refusal::of(&error, reason) {
            self.refusals.refused(refusal);
        }
        tracing::error!(target: "librdkafka", "librdkafka: {error}: {reason}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn global(code: RDKafkaErrorCode) -> RdError {
        RdError::Global(code)
    }

    #[test]
    fn refusals_are_told_apart_and_other_errors_are_not_refusals() {
        let tls = Refusal::of(
            &global(RDKafkaErrorCode::SSL),
            "ssl://127.0.0.1:9493/bootstrap: SSL handshake failed: certificate verify failed",
        )
        .expect("a refusal");
        assert!(
            matches!(tls.to_error("k:1"), BrokerError::Config { field, .. } if field == "ssl.*")
        );
        let sasl = Refusal::of(
            &global(RDKafkaErrorCode::Authentication),
            "sasl_ssl://127.0.0.1:9492/bootstrap: SASL authentication error: Authentication failed",
        )
        .expect("a refusal");
        let e = sasl.to_error("k:1");
        assert!(
            matches!(&e, BrokerError::Unauthorized { resource, .. } if resource == "the cluster at k:1"),
            "{e:?}"
        );
        let plain = Refusal::of(
            &global(RDKafkaErrorCode::BrokerTransportFailure),
            "127.0.0.1:9492/bootstrap: Disconnected while requesting ApiVersion: might be caused by incorrect security.protocol configuration (connecting to a SSL listener?)",
        )
        .expect("a refusal");
        assert!(
            matches!(plain.to_error("k:1"), BrokerError::Config { field, .. } if field == "security.protocol")
        );
        let alert = Refusal::of(
            &global(RDKafkaErrorCode::BrokerTransportFailure),
            "ssl://127.0.0.1:9493/bootstrap: Receive failed: error:0A000416:SSL routines::sslv3 alert certificate unknown",
        )
        .expect("a refusal");
        assert!(
            matches!(alert.to_error("k:1"), BrokerError::Config { field, .. } if field == "ssl.*")
        );
        assert!(
            Refusal::of(
                &global(RDKafkaErrorCode::BrokerTransportFailure),
                "Connection refused"
            )
            .is_none()
        );
        assert!(
            Refusal::of(
                &global(RDKafkaErrorCode::AllBrokersDown),
                "1/1 brokers are down"
            )
            .is_none()
        );
    }

    #[tokio::test]
    async fn a_waiting_request_ends_with_the_refusal_and_a_success_heals_it() {
        let refusals = Refusals::new("k:1");
        let context = WatchingContext {
            refusals: refusals.clone(),
            plaintext: true,
            tokens: TokenSource::default(),
        };
        let waiting = refusals.or_refused::<(), ()>("k:1", std::future::pending());
        let refuse = async {
            tokio::time::sleep(Duration::from_millis(20)).await;
            context.error(
                global(RDKafkaErrorCode::Authentication),
                "SASL authentication error",
            );
        };
        let (result, ()) = tokio::join!(waiting, refuse);
        assert!(
            matches!(result, Err(BrokerError::Unauthorized { .. })),
            "{result:?}"
        );
        // Fresh: the next request fails at once, without being polled to completion.
        let again = refusals
            .or_refused::<(), ()>("k:1", std::future::pending())
            .await;
        assert!(matches!(again, Err(BrokerError::Unauthorized { .. })));
        // Healed by a success after it (e.g. the broker's ACLs or users were fixed).
        *lock(&refusals.healed) = Some(Instant::now());
        let ok = refusals.or_refused::<u8, ()>("k:1", async { Ok(7) }).await;
        assert!(matches!(ok, Ok(Ok(7))), "{ok:?}");
    }

    #[test]
    fn the_server_of_a_message_is_read_from_its_broker_name() {
        assert_eq!(
            server_of(
                "[thrd:127.0.0.1:9392/bootstrap]: 127.0.0.1:9392/bootstrap: Disconnected: connection reset by peer (after 1ms in state APIVERSION_QUERY)"
            ),
            Some("127.0.0.1:9392")
        );
        assert_eq!(
            server_of("ssl://b-1.example:9094/2: SSL handshake failed"),
            Some("b-1.example:9094")
        );
        assert_eq!(server_of("1/1 brokers are down"), None);
    }

    #[tokio::test]
    async fn one_node_hanging_up_is_not_a_protocol_mismatch_every_node_is() {
        let refusals = Refusals::new("h:1,h:2,h:3");
        let context = WatchingContext {
            refusals: refusals.clone(),
            plaintext: true,
            tokens: TokenSource::default(),
        };
        let hang_up = |server: &str| {
            context.log(
                RDKafkaLogLevel::Info,
                "FAIL",
                &format!("[thrd:{server}/bootstrap]: {server}/bootstrap: Disconnected: connection reset by peer (after 1ms in state APIVERSION_QUERY)"),
            );
        };
        // A node down behind a proxy, hanging up again and again: the request goes on.
        hang_up("h:2");
        hang_up("h:2");
        let waiting = refusals.or_refused::<u8, ()>("h:1,h:2,h:3", async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            Ok(1)
        });
        assert!(matches!(waiting.await, Ok(Ok(1))));
        // Every node hangs up: the client speaks the wrong protocol.
        hang_up("h:1");
        hang_up("h:3");
        let refused = refusals
            .or_refused::<(), ()>("h:1,h:2,h:3", std::future::pending())
            .await;
        assert!(
            matches!(&refused, Err(BrokerError::Config { field, .. }) if field == "security.protocol"),
            "{refused:?}"
        );
    }
}
