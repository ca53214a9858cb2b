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
        let mut parsed = reqwest::Url::parse(url).map_err(|e| bad("url", e.to_string()))?;
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
        Ok((parsed.to_string(), options))
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
