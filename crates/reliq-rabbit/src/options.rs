//! Settings of a [`RabbitBroker`](crate::client::RabbitBroker): queue type, confirm timeout,
//! reconnect policy, where queue settings live (policies or arguments), TLS trust and
//! client certificate.

use std::path::PathBuf;
use std::time::Duration;

use reliq_core::{
    BrokerError,
    seam::secrets::{redact_url, resolve_setting},
};

/// What stays unencoded in a URL's path segment or user info: RFC 3986's `unreserved`.
pub(crate) const UNRESERVED: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

/// Percent-encode one path segment (queue, policy and vhost names).
pub fn encode_segment(s: &str) -> String {
    percent_encoding::utf8_percent_encode(s, UNRESERVED).to_string()
}

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
    /// [`RabbitOptions::management_url`]; an unreachable API fails [`RabbitBroker::connect_with`](crate::client::RabbitBroker::connect_with).
    /// Policies are not removed with their queues (delete them with
    /// [`Management::delete_policy`](crate::management::Management::delete_policy) when a consumer is retired), and every policy change
    /// makes RabbitMQ re-match all queues of the vhost: fine for long-lived consumers,
    /// not for thousands of short-lived ones (use `Arguments` there).
    Policies,
}

/// TLS beyond what `amqps://` alone gives (the platform's trust store, no client
/// certificate), for the AMQP connection and the management API alike. The URL names
/// them with the RabbitMQ URI spec's query parameters: `cacertfile`, `certfile`,
/// `keyfile`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Tls {
    /// PEM file of CA certificates to trust besides the platform's (a private CA).
    pub ca: Option<PathBuf>,
    /// PEM file of the client certificate (chain) for mutual TLS; with
    /// `auth_mechanism=external` the broker signs the connection in as the user the
    /// certificate names (`ssl_cert_login_from`).
    pub cert: Option<PathBuf>,
    /// PEM file of the client certificate's private key.
    pub key: Option<PathBuf>,
}

impl Tls {
    /// Whether anything is set.
    pub fn is_empty(&self) -> bool {
        self == &Self::default()
    }

    /// The files read: a CA bundle and a client identity, each named by its setting
    /// when it cannot be read or holds no PEM certificate (checked here, at connect time,
    /// rather than as a TLS failure on every connection attempt).
    pub(crate) fn load(&self) -> Result<LoadedTls, BrokerError> {
        use rustls::pki_types::pem::PemObject as _;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};
        let read = |field: &str, path: &PathBuf| {
            std::fs::read(path).map_err(|e| BrokerError::Config {
                field: field.to_owned(),
                reason: format!("cannot read `{}`: {e}", path.display()),
            })
        };
        let certs = |field: &str, pem: &[u8]| {
            let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(pem)
                .collect::<Result<_, _>>()
                .map_err(|e| BrokerError::Config {
                    field: field.to_owned(),
                    reason: format!("not PEM certificates: {e}"),
                })?;
            if certs.is_empty() {
                return Err(BrokerError::Config {
                    field: field.to_owned(),
                    reason: "no PEM certificate in the file".into(),
                });
            }
            Ok(certs)
        };
        let ca = match &self.ca {
            Some(path) => {
                let pem = read("cacertfile", path)?;
                Some((certs("cacertfile", &pem)?, pem))
            }
            None => None,
        };
        let identity = match (&self.cert, &self.key) {
            (Some(cert), Some(key)) => {
                let cert_pem = read("certfile", cert)?;
                let key_pem = read("keyfile", key)?;
                let chain = certs("certfile", &cert_pem)?;
                let private =
                    PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| BrokerError::Config {
                        field: "keyfile".into(),
                        reason: format!("no PEM private key: {e}"),
                    })?;
                Some(Identity {
                    cert_pem,
                    key_pem,
                    chain,
                    key: private,
                })
            }
            (None, None) => None,
            (Some(_), None) => {
                return Err(BrokerError::Config {
                    field: "keyfile".into(),
                    reason: "a client certificate needs its key".into(),
                });
            }
            (None, Some(_)) => {
                return Err(BrokerError::Config {
                    field: "certfile".into(),
                    reason: "a private key needs its certificate".into(),
                });
            }
        };
        Ok(LoadedTls { ca, identity })
    }
}

/// A client certificate chain and its key, as PEM (for lapin) and parsed (for rustls).
pub(crate) struct Identity {
    cert_pem: Vec<u8>,
    key_pem: Vec<u8>,
    chain: Vec<rustls::pki_types::CertificateDer<'static>>,
    key: rustls::pki_types::PrivateKeyDer<'static>,
}

/// [`Tls`] with its files read.
pub(crate) struct LoadedTls {
    /// The CA certificates, parsed and as the PEM text.
    ca: Option<(Vec<rustls::pki_types::CertificateDer<'static>>, Vec<u8>)>,
    identity: Option<Identity>,
}

impl LoadedTls {
    /// lapin's TLS settings: the CA bundle is added to the platform's roots.
    pub(crate) fn lapin(&self) -> lapin::tcp::OwnedTLSConfig {
        lapin::tcp::OwnedTLSConfig {
            identity: self
                .identity
                .as_ref()
                .map(|i| lapin::tcp::OwnedIdentity::PKCS8 {
                    pem: i.cert_pem.clone(),
                    key: i.key_pem.clone(),
                }),
            cert_chain: self
                .ca
                .as_ref()
                .map(|(_, pem)| String::from_utf8_lossy(pem).into_owned()),
        }
    }

    /// The management API's rustls configuration, on the ring provider lapin uses: the
    /// platform's verifier with the CA bundle as extra roots (what lapin trusts too), and
    /// the client certificate when there is one.
    pub(crate) fn rustls(&self) -> Result<rustls::ClientConfig, BrokerError> {
        let config = |reason: String| BrokerError::Config {
            field: "management_url".into(),
            reason,
        };
        let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
        let extra = self.ca.iter().flat_map(|(certs, _)| certs.iter().cloned());
        let verifier =
            rustls_platform_verifier::Verifier::new_with_extra_roots(extra, provider.clone())
                .map_err(|e| config(format!("TLS setup failed: {e}")))?;
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| config(format!("TLS setup failed: {e}")))?
            .dangerous() // only to install the platform verifier, which verifies fully
            .with_custom_certificate_verifier(std::sync::Arc::new(verifier));
        match &self.identity {
            None => Ok(builder.with_no_client_auth()),
            Some(i) => builder
                .with_client_auth_cert(i.chain.clone(), i.key.clone_key())
                .map_err(|e| BrokerError::Config {
                    field: "certfile".into(),
                    reason: format!("the client certificate and key do not fit: {e}"),
                }),
        }
    }
}

/// Settings of a [`RabbitBroker`](crate::client::RabbitBroker).
#[derive(Clone)]
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
    /// A private CA and a client certificate, for `amqps://` and an `https://`
    /// management API.
    pub tls: Tls,
}

impl std::fmt::Debug for RabbitOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The management URL carries the API's password: never print it.
        f.debug_struct("RabbitOptions")
            .field("queue_type", &self.queue_type)
            .field("confirm_timeout", &self.confirm_timeout)
            .field("reconnect", &self.reconnect)
            .field(
                "management_url",
                &self.management_url.as_deref().map(redact_url),
            )
            .field("queue_settings", &self.queue_settings)
            .field("policy_priority", &self.policy_priority)
            .field("queue_expiry", &self.queue_expiry)
            .field("connection_name", &self.connection_name)
            .field("tls", &self.tls)
            .finish()
    }
}

impl RabbitOptions {
    /// The options a URL carries in its query, and the URL without them (what lapin
    /// connects to):
    ///
    /// | parameter | what |
    /// |---|---|
    /// | `reliq.management=15672` | the management API on this port of the URL's host, with its credentials (`https` for `amqps://`) |
    /// | `reliq.management=<URL>` | the management API at that (percent-encoded) URL |
    /// | `cacertfile=<path>` | trust this PEM CA bundle besides the platform's ([`Tls::ca`]) |
    /// | `certfile=<path>`, `keyfile=<path>` | the client certificate and its key, for mutual TLS ([`Tls::cert`], [`Tls::key`]) |
    /// | `password.file=<path>`, `password.env=<VAR>` | the password of the URL's user, from a file or an environment variable (not in the process list) |
    ///
    /// `cacertfile`, `certfile` and `keyfile` are the RabbitMQ URI spec's names. lapin's
    /// own parameters stay in the URL: `heartbeat`, `connection_timeout`, `channel_max`,
    /// `frame_max`, and `auth_mechanism=external` (sign in with the client certificate:
    /// the broker's `rabbitmq_auth_mechanism_ssl` plugin). Any other `reliq.*` parameter
    /// is an error naming it.
    pub fn from_url(url: &str) -> Result<(String, Self), BrokerError> {
        let bad = |field: &str, reason: String| BrokerError::Config {
            field: field.to_owned(),
            reason,
        };
        // A cluster's URL names several nodes; the query is read from the first node's.
        let mut nodes = Nodes::parse(url)?;
        let mut parsed =
            reqwest::Url::parse(&nodes.url(0)).map_err(|e| bad("url", e.to_string()))?;
        let mut options = Self::default();
        let mut management = None;
        let mut kept = Vec::new();
        for (k, v) in parsed.query_pairs() {
            let (key, value) =
                resolve_setting(&k, &v).map_err(|e| bad(k.as_ref(), e.to_string()))?;
            match key {
                "reliq.management" => management = Some(value.into_owned()),
                "cacertfile" => options.tls.ca = Some(PathBuf::from(value.as_ref())),
                "certfile" => options.tls.cert = Some(PathBuf::from(value.as_ref())),
                "keyfile" => options.tls.key = Some(PathBuf::from(value.as_ref())),
                "password" => {
                    if parsed.username().is_empty() {
                        return Err(bad(
                            &k,
                            "a password needs a user: amqps://USER@host/…?password.file=…".into(),
                        ));
                    }
                    nodes.set_password(&value);
                }
                other if other.starts_with("reliq.") => {
                    return Err(bad(
                        other,
                        "unknown reliq option in the URL (known: reliq.management)".into(),
                    ));
                }
                _ => kept.push((k.into_owned(), v.into_owned())),
            }
        }
        if options.tls.cert.is_some() != options.tls.key.is_some() {
            let missing = if options.tls.cert.is_some() {
                "keyfile"
            } else {
                "certfile"
            };
            return Err(bad(
                missing,
                "a client certificate needs both certfile and keyfile".into(),
            ));
        }
        // The port form borrows the (possibly just read) credentials of the URL.
        let with_password =
            reqwest::Url::parse(&nodes.url(0)).map_err(|e| bad("url", e.to_string()))?;
        options.management_url = management
            .map(|v| -> Result<String, BrokerError> {
                let Ok(port) = v.parse::<u16>() else {
                    return Ok(v);
                };
                let scheme = if with_password.scheme() == "amqps" {
                    "https"
                } else {
                    "http"
                };
                let host = with_password
                    .host_str()
                    .ok_or_else(|| bad("url", "no host".into()))?;
                let userinfo = match with_password.password() {
                    Some(password) => format!("{}:{password}@", with_password.username()),
                    None if !with_password.username().is_empty() => {
                        format!("{}@", with_password.username())
                    }
                    None => String::new(),
                };
                Ok(format!("{scheme}://{userinfo}{host}:{port}"))
            })
            .transpose()?;
        if kept.is_empty() {
            parsed.set_query(None);
        } else {
            parsed.query_pairs_mut().clear().extend_pairs(kept);
        }
        let tail = match parsed.query() {
            Some(q) => format!("{}?{q}", parsed.path()),
            None => parsed.path().to_owned(),
        };
        let url = Nodes { tail, ..nodes }.to_string();
        Ok((url, options))
    }
}

/// The nodes an AMQP URL names. A cluster's URL lists them in its authority, separated
/// by commas — `amqp://user:password@host1:5672,host2:5672,host3:5672/vhost?query` — and
/// every node gets the same credentials, vhost and query. lapin connects to one host; the
/// broker tries the nodes in turn (see [`crate::client::RabbitBroker`]).
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct Nodes {
    /// `scheme://` and the user info with its `@`.
    prefix: String,
    /// `host[:port]` per node, in the URL's order.
    pub(crate) hosts: Vec<String>,
    /// The path (vhost) and query.
    tail: String,
}

impl Nodes {
    pub(crate) fn parse(url: &str) -> Result<Self, BrokerError> {
        let bad = |reason: &str| BrokerError::Config {
            field: "url".into(),
            reason: reason.into(),
        };
        let (scheme, rest) = url
            .split_once("://")
            .ok_or_else(|| bad("expected amqp://… or amqps://…"))?;
        let end = rest.find(['/', '?']).unwrap_or(rest.len());
        let (authority, tail) = rest.split_at(end);
        // The hosts follow the last `@` (a password's own `@` is percent-encoded).
        let (userinfo, hosts) = match authority.rsplit_once('@') {
            Some((user, hosts)) => (format!("{user}@"), hosts),
            None => (String::new(), authority),
        };
        let hosts: Vec<String> = hosts.split(',').map(|h| h.trim().to_owned()).collect();
        if hosts.iter().any(String::is_empty) {
            return Err(bad("an empty host in the URL's host list"));
        }
        Ok(Self {
            prefix: format!("{scheme}://{userinfo}"),
            hosts,
            tail: tail.to_owned(),
        })
    }

    /// The single-host URL of node `i` (what lapin connects to).
    pub(crate) fn url(&self, i: usize) -> String {
        let host = self.hosts.get(i).map_or("", String::as_str);
        format!("{}{host}{}", self.prefix, self.tail)
    }

    /// Set the password of the URL's user (percent-encoded into the user info).
    pub(crate) fn set_password(&mut self, password: &str) {
        let (scheme, userinfo) = self.prefix.split_once("://").unwrap_or(("amqp", ""));
        let userinfo = userinfo.strip_suffix('@').unwrap_or(userinfo);
        let user = userinfo.split_once(':').map_or(userinfo, |(u, _)| u);
        let encoded = encode_segment(password);
        self.prefix = format!("{scheme}://{user}:{encoded}@");
    }

    /// Every node's single-host URL, in order.
    pub(crate) fn urls(&self) -> Vec<String> {
        (0..self.hosts.len()).map(|i| self.url(i)).collect()
    }
}

impl std::fmt::Debug for Nodes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The prefix holds the password: print the URL redacted.
        f.write_str(&redact_url(&self.to_string()))
    }
}

impl std::fmt::Display for Nodes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}{}{}", self.prefix, self.hosts.join(","), self.tail)
    }
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
            tls: Tls::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cluster_url_names_every_node_with_the_same_credentials_vhost_and_query() {
        let (url, o) = RabbitOptions::from_url(
            "amqp://u:p%40ss@10.0.0.1:5672, 10.0.0.2:5673,node-3/%2f?heartbeat=10&reliq.management=15672",
        )
        .expect("cluster url");
        assert_eq!(
            url,
            "amqp://u:p%40ss@10.0.0.1:5672,10.0.0.2:5673,node-3/%2f?heartbeat=10"
        );
        // The management API is the first node's.
        assert_eq!(
            o.management_url.as_deref(),
            Some("http://u:p%40ss@10.0.0.1:15672")
        );
        let nodes = Nodes::parse(&url).expect("nodes");
        assert_eq!(
            nodes.urls(),
            [
                "amqp://u:p%40ss@10.0.0.1:5672/%2f?heartbeat=10",
                "amqp://u:p%40ss@10.0.0.2:5673/%2f?heartbeat=10",
                "amqp://u:p%40ss@node-3/%2f?heartbeat=10",
            ]
        );
        assert!(!format!("{nodes:?}").contains("p%40ss"), "{nodes:?}");
        let single = Nodes::parse("amqp://127.0.0.1:5672").expect("single");
        assert_eq!(single.urls(), ["amqp://127.0.0.1:5672"]);
        let err = Nodes::parse("amqp://u:p@h1,,h3/%2f").expect_err("empty host");
        assert!(err.to_string().contains("empty host"), "{err}");
    }

    #[test]
    fn url_options_are_taken_out_and_named_when_unknown() {
        let (url, o) = RabbitOptions::from_url(
            "amqp://gu%40est:p%3Ass@rabbit:5672/%2f?reliq.management=15672&heartbeat=10",
        )
        .expect("port form");
        assert_eq!(url, "amqp://gu%40est:p%3Ass@rabbit:5672/%2f?heartbeat=10");
        assert_eq!(
            o.management_url.as_deref(),
            Some("http://gu%40est:p%3Ass@rabbit:15672")
        );
        let (url, o) = RabbitOptions::from_url(
            "amqps://u:p@rabbit/%2f?reliq.management=https%3A%2F%2Fadmin%3Asecret%40mgmt%3A443",
        )
        .expect("URL form");
        assert_eq!(url, "amqps://u:p@rabbit/%2f");
        assert_eq!(
            o.management_url.as_deref(),
            Some("https://admin:secret@mgmt:443")
        );
        let (_, o) = RabbitOptions::from_url("amqps://u:p@rabbit/%2f?reliq.management=15671")
            .expect("amqps");
        assert_eq!(
            o.management_url.as_deref(),
            Some("https://u:p@rabbit:15671")
        );
        let (url, o) = RabbitOptions::from_url("amqp://127.0.0.1:5672/%2f").expect("plain");
        assert_eq!(
            (url.as_str(), o.management_url),
            ("amqp://127.0.0.1:5672/%2f", None)
        );
        let err = RabbitOptions::from_url("amqp://u:secret@h/%2f?reliq.queue_tyep=classic")
            .expect_err("unknown option");
        assert!(
            matches!(&err, BrokerError::Config { field, .. } if field == "reliq.queue_tyep"),
            "{err}"
        );
        assert!(!err.to_string().contains("secret"));
    }

    #[test]
    fn a_password_from_a_file_is_encoded_into_the_user_info_and_never_shown() {
        let path = std::env::temp_dir().join(format!("reliq-rabbit-pw-{}", std::process::id()));
        std::fs::write(&path, "p@ss/w:rd\n").expect("write the password file");
        let (url, o) = RabbitOptions::from_url(&format!(
            "amqps://svc@rabbit:5671/shop?password.file={}&reliq.management=15671",
            path.display()
        ))
        .expect("password from a file");
        let _ = std::fs::remove_file(&path);
        assert_eq!(url, "amqps://svc:p%40ss%2Fw%3Ard@rabbit:5671/shop");
        assert_eq!(
            o.management_url.as_deref(),
            Some("https://svc:p%40ss%2Fw%3Ard@rabbit:15671")
        );
        assert!(!format!("{o:?}").contains("p%40ss"), "{o:?}");
        let err = RabbitOptions::from_url("amqps://rabbit/shop?password.env=RELIQ_TEST_UNSET_VAR")
            .expect_err("unset variable");
        assert!(err.to_string().contains("RELIQ_TEST_UNSET_VAR"), "{err}");
    }
}
