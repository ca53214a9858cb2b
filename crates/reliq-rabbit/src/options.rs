//! Settings of a [`RabbitBroker`](crate::RabbitBroker): queue type, confirm timeout,
//! reconnect policy, where queue settings live (policies or arguments).

use std::time::Duration;

use reliq_core::BrokerError;

#[cfg(doc)]
use crate::{Management, RabbitBroker};

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

impl RabbitOptions {
    /// The options a URL carries in `reliq.*` query parameters, and the URL without them
    /// (what lapin connects to):
    ///
    /// | parameter | what |
    /// |---|---|
    /// | `reliq.management=15672` | the management API on this port of the URL's host, with its credentials (`https` for `amqps://`) |
    /// | `reliq.management=<URL>` | the management API at that (percent-encoded) URL |
    ///
    /// Any other `reliq.*` parameter is an error naming it; the rest (lapin's own,
    /// `heartbeat`, `frame_max`, …) is left in the URL.
    pub fn from_url(url: &str) -> Result<(String, Self), BrokerError> {
        let bad = |field: &str, reason: String| BrokerError::Config {
            field: field.to_owned(),
            reason,
        };
        // A cluster's URL names several nodes; the query is read from the first node's.
        let nodes = Nodes::parse(url)?;
        let mut parsed =
            reqwest::Url::parse(&nodes.url(0)).map_err(|e| bad("url", e.to_string()))?;
        let mut options = Self::default();
        let mut kept = Vec::new();
        for (k, v) in parsed.query_pairs() {
            match k.as_ref() {
                "reliq.management" => {
                    options.management_url = Some(if let Ok(port) = v.parse::<u16>() {
                        let scheme = if parsed.scheme() == "amqps" {
                            "https"
                        } else {
                            "http"
                        };
                        let host = parsed
                            .host_str()
                            .ok_or_else(|| bad("url", "no host".into()))?;
                        let userinfo = match parsed.password() {
                            Some(password) => format!("{}:{password}@", parsed.username()),
                            None if !parsed.username().is_empty() => {
                                format!("{}@", parsed.username())
                            }
                            None => String::new(),
                        };
                        format!("{scheme}://{userinfo}{host}:{port}")
                    } else {
                        v.into_owned()
                    });
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
/// broker tries the nodes in turn (see [`crate::RabbitBroker`]).
#[derive(Clone, Debug, PartialEq, Eq)]
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

    /// Every node's single-host URL, in order.
    pub(crate) fn urls(&self) -> Vec<String> {
        (0..self.hosts.len()).map(|i| self.url(i)).collect()
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
}
