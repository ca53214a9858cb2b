//! Connection settings: the `kafka://` URL and the client configuration derived from it.

use std::collections::BTreeMap;
use std::time::Duration;

use rdkafka::config::ClientConfig;

use crate::error::KafkaError;

/// What `publish` does when the producer's bounded in-flight buffer
/// (`queue.buffering.max.messages` / `queue.buffering.max.kbytes`) is full.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BufferPolicy {
    /// Wait up to this long for room, then fail with `BrokerError::Timeout`.
    Block(Duration),
    /// Fail at once with `BrokerError::Rejected`.
    FailFast,
}

/// How a consumer retries a failed record.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RetryMode {
    /// Non-blocking (default): the copy goes to the tier's retry topic
    /// `<topic>.<group>.retry.<delay>` and a relay hands it back when due; the partition
    /// moves on meanwhile (order between a retried record and later ones is not kept).
    #[default]
    Topics,
    /// Blocking, for ordered consumers: each partition runs one record at a time; a
    /// failed record is retried in place after the policy's backoff while its partition
    /// is paused (records read past it are dropped and read again after it: the
    /// partition seeks back). No retry topics. Poison and permanent failures still go to
    /// the DLQ topic, and the partition moves on. A crash during the backoff restarts the
    /// record's retry budget (the attempt count is not in Kafka); the delivery limit
    /// still ends a crash loop.
    Blocking,
}

/// Settings of a [`KafkaBroker`](crate::client::KafkaBroker).
///
/// Built from a URL `kafka://host:port[,host:port]?key=value&…`: keys starting with
/// `reliq.` are reliq's own settings (below); every other key is passed unchanged to
/// librdkafka (e.g. `security.protocol=ssl`, `session.timeout.ms=6000`) for every client
/// reliq creates, overriding reliq's defaults.
///
/// **Secured clusters** take librdkafka's own settings (this crate's librdkafka is built
/// with OpenSSL, SCRAM, PLAIN, OAUTHBEARER and its OIDC client-credentials flow):
///
/// | cluster | settings |
/// |---|---|
/// | TLS, private CA | `security.protocol=ssl&ssl.ca.location=/etc/kafka/ca.pem` |
/// | mutual TLS | the above and `ssl.certificate.location=…&ssl.key.location=…` (`ssl.key.password.file=…` for an encrypted key) |
/// | SASL/SCRAM over TLS | `security.protocol=sasl_ssl&sasl.mechanism=SCRAM-SHA-512&sasl.username=svc&sasl.password.file=/run/secrets/kafka` |
/// | SASL/PLAIN over TLS (Confluent Cloud, Event Hubs) | `security.protocol=sasl_ssl&sasl.mechanism=PLAIN&sasl.username=…&sasl.password.env=KAFKA_PASSWORD` |
/// | OAUTHBEARER, OIDC | `security.protocol=sasl_ssl&sasl.mechanism=OAUTHBEARER&sasl.oauthbearer.method=oidc&sasl.oauthbearer.client.id=…&sasl.oauthbearer.client.secret.file=…&sasl.oauthbearer.token.endpoint.url=…` |
/// | AWS MSK IAM (feature `msk-iam`) | `sasl.oauthbearer.method=aws_msk_iam&reliq.aws.region=eu-west-1` (optional `reliq.aws.profile=…`; see [`MskIamSettings`]) |
///
/// Any value may be percent-encoded; a secret may come from a file (`<key>.file=PATH`)
/// or an environment variable (`<key>.env=VAR`) instead of the URL, so it never shows in
/// a process list (see [`reliq_core::seam::secrets`]). `Debug` of this config and every error
/// show secret values as `***`. Set `client.id` per service: ACLs and quotas, and the
/// broker's request logs, name clients by it.
///
/// | key | default | meaning |
/// |---|---|---|
/// | `reliq.partitions` | 3 | partitions of topics reliq creates (source, retry tiers, DLQ) |
/// | `reliq.replication` | 1 | replication factor of topics reliq creates |
/// | `reliq.buffer` | `block:5000` | producer buffer policy: `block:<ms>` or `fail-fast` |
/// | `reliq.buffer.messages` | 10000 | producer buffer bound (`queue.buffering.max.messages`) |
/// | `reliq.send.timeout.ms` | 30000 | how long a publish may wait for its delivery report |
/// | `reliq.rebalance.drain.ms` | 10000 | how long a revoke waits for in-flight records to settle |
/// | `reliq.group.prefix` | (empty) | prepended to every consumer group id reliq joins (a namespace: environments, tenants, test runs) |
/// | `reliq.retry` | `topics` | [`RetryMode`]: `topics` (non-blocking) or `blocking` (ordered, in place) |
/// | `reliq.aws.region` | the AWS region chain | with `aws_msk_iam`: the region the token is signed for |
/// | `reliq.aws.profile` | the AWS profile chain | with `aws_msk_iam`: the shared-config profile whose credentials sign |
/// | `reliq.aws.cluster.arn` | any cluster | with `aws_msk_iam`: the cluster's ARN, for the IAM policy of `topology permissions` |
#[derive(Clone, PartialEq, Eq)]
pub struct KafkaConfig {
    /// `bootstrap.servers`.
    pub bootstrap: String,
    /// Extra librdkafka settings for every client (override reliq's defaults).
    pub client: BTreeMap<String, String>,
    /// Partitions of topics reliq creates.
    pub partitions: i32,
    /// Replication factor of topics reliq creates.
    pub replication: i32,
    /// Producer buffer policy.
    pub buffer: BufferPolicy,
    /// Producer buffer bound in messages.
    pub buffer_messages: u32,
    /// Delivery-report timeout of a publish (`message.timeout.ms`).
    pub send_timeout: Duration,
    /// How long a revoke waits for in-flight records of the revoked partitions.
    pub rebalance_drain: Duration,
    /// Prepended to every consumer group id (the consumer name in headers is unchanged).
    pub group_prefix: String,
    /// Retry through retry topics or in place.
    pub retry_mode: RetryMode,
    /// AWS MSK IAM sign-in, when the URL says `sasl.oauthbearer.method=aws_msk_iam`.
    pub msk_iam: Option<MskIamSettings>,
}

/// AWS MSK IAM sign-in: every client authenticates with SASL/OAUTHBEARER, its token a
/// SigV4-presigned `kafka-cluster:Connect` request (what AWS's `aws-msk-iam-sasl-signer`
/// libraries make) signed with credentials from the AWS default chain — environment
/// keys, the shared profile (static keys, `role_arn` through STS, SSO), web identity
/// (EKS IRSA), the ECS container endpoint, EC2 instance metadata. A token lives 15
/// minutes; librdkafka asks for a new one at 80% of that. Needs the crate feature
/// `msk-iam` (`kafka-msk-iam` of `reliq`).
///
/// It sets `sasl.mechanism=OAUTHBEARER` and `security.protocol=sasl_ssl` unless the URL
/// sets them (MSK's IAM listeners, port
/// 9098, speak TLS); the value itself is reliq's, not librdkafka's, and is not passed
/// on.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MskIamSettings {
    /// The region of the cluster (`reliq.aws.region`); unset: the AWS region chain
    /// (`AWS_REGION`, `AWS_DEFAULT_REGION`, the profile's `region`).
    pub region: Option<String>,
    /// The shared-config profile to sign with (`reliq.aws.profile`); unset: `AWS_PROFILE`
    /// or `default`.
    pub profile: Option<String>,
    /// The cluster's ARN (`reliq.aws.cluster.arn`), for the IAM policy
    /// `reliq topology permissions` prints; unset: any cluster of the account.
    pub cluster_arn: Option<String>,
}

/// The `sasl.oauthbearer.method` value that selects [`MskIamSettings`].
const AWS_MSK_IAM: &str = "aws_msk_iam";

/// The group session reliq's consumers ask for unless the URL sets `session.timeout.ms`:
/// how long the coordinator waits on a silent member (a crashed or frozen process) before
/// it gives the member's partitions to another. 6 s is the broker's default minimum
/// (`group.min.session.timeout.ms`): a lost consumer's partitions move quickly; a pause
/// longer than this (GC, SIGSTOP, a VM stall) makes the member a zombie, which the
/// receiver fences on its own (`receiver/frozen.rs`).
pub const DEFAULT_SESSION_TIMEOUT: Duration = Duration::from_secs(6);

impl std::fmt::Debug for KafkaConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let client: BTreeMap<&str, &str> = self
            .client
            .iter()
            .map(|(k, v)| {
                let v = if reliq_core::seam::secrets::is_secret_key(k) {
                    "***"
                } else {
                    v.as_str()
                };
                (k.as_str(), v)
            })
            .collect();
        f.debug_struct("KafkaConfig")
            .field("bootstrap", &self.bootstrap)
            .field("client", &client)
            .field("partitions", &self.partitions)
            .field("replication", &self.replication)
            .field("buffer", &self.buffer)
            .field("buffer_messages", &self.buffer_messages)
            .field("send_timeout", &self.send_timeout)
            .field("rebalance_drain", &self.rebalance_drain)
            .field("group_prefix", &self.group_prefix)
            .field("retry_mode", &self.retry_mode)
            .field("msk_iam", &self.msk_iam)
            .finish()
    }
}

impl KafkaConfig {
    /// Settings with defaults for `bootstrap` (`host:port[,host:port]`).
    pub fn new(bootstrap: impl Into<String>) -> Self {
        Self {
            bootstrap: bootstrap.into(),
            client: BTreeMap::new(),
            partitions: 3,
            replication: 1,
            buffer: BufferPolicy::Block(Duration::from_secs(5)),
            buffer_messages: 10_000,
            send_timeout: Duration::from_secs(30),
            rebalance_drain: Duration::from_secs(10),
            retry_mode: RetryMode::Topics,
            group_prefix: String::new(),
            msk_iam: None,
        }
    }

    /// Parse `kafka://host:port[,host:port]?key=value&…`.
    ///
    /// ```
    /// use reliq_kafka::KafkaConfig;
    /// let c = KafkaConfig::from_url("kafka://a:9092,b:9092?reliq.partitions=6&client.id=svc").unwrap();
    /// assert_eq!(c.bootstrap, "a:9092,b:9092");
    /// assert_eq!(c.partitions, 6);
    /// assert_eq!(c.client.get("client.id").map(String::as_str), Some("svc"));
    /// ```
    pub fn from_url(url: &str) -> Result<Self, KafkaError> {
        let bad = |field: &str, reason: String| KafkaError::Config {
            field: field.to_owned(),
            reason,
        };
        let (scheme, rest) = url
            .split_once("://")
            .ok_or_else(|| bad("url", "expected kafka://host:port".into()))?;
        if !scheme.eq_ignore_ascii_case("kafka") {
            return Err(bad("url", format!("scheme `{scheme}` is not kafka")));
        }
        let (hosts, query) = rest.split_once('?').unwrap_or((rest, ""));
        let hosts = hosts.trim_end_matches('/');
        if hosts.is_empty() || hosts.split(',').any(|h| !h.contains(':')) {
            return Err(bad(
                "url",
                "expected one or more host:port, comma-separated".into(),
            ));
        }
        let mut config = Self::new(hosts);
        let mut aws = MskIamSettings::default();
        let mut aws_key = None;
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair
                .split_once('=')
                .ok_or_else(|| bad(pair, "expected key=value".into()))?;
            let raw = reliq_core::seam::secrets::percent_decode(v);
            let (k, v) = reliq_core::seam::secrets::resolve_setting(k, &raw)
                .map_err(|e| bad(k, e.to_string()))?;
            let v = v.as_ref();
            let number = |v: &str| {
                v.parse::<u64>()
                    .map_err(|_| bad(k, format!("`{v}` is not a number")))
            };
            match k {
                "reliq.partitions" => {
                    config.partitions = i32::try_from(number(v)?)
                        .ok()
                        .filter(|n| *n >= 1)
                        .ok_or_else(|| bad(k, "must be 1..=i32::MAX".into()))?;
                }
                "reliq.replication" => {
                    config.replication = i32::try_from(number(v)?)
                        .ok()
                        .filter(|n| *n >= 1)
                        .ok_or_else(|| bad(k, "must be 1..=i32::MAX".into()))?;
                }
                "reliq.buffer" => {
                    config.buffer = match v.split_once(':') {
                        None if v == "fail-fast" => BufferPolicy::FailFast,
                        Some(("block", ms)) => {
                            BufferPolicy::Block(Duration::from_millis(number(ms)?))
                        }
                        _ => return Err(bad(k, "expected `block:<ms>` or `fail-fast`".into())),
                    };
                }
                "reliq.buffer.messages" => {
                    config.buffer_messages = u32::try_from(number(v)?)
                        .ok()
                        .filter(|n| *n >= 1)
                        .ok_or_else(|| bad(k, "must be at least 1".into()))?;
                }
                "reliq.send.timeout.ms" => config.send_timeout = Duration::from_millis(number(v)?),
                "reliq.rebalance.drain.ms" => {
                    config.rebalance_drain = Duration::from_millis(number(v)?)
                }
                "reliq.group.prefix" => config.group_prefix = v.to_owned(),
                "reliq.retry" => {
                    config.retry_mode = match v {
                        "topics" => RetryMode::Topics,
                        "blocking" => RetryMode::Blocking,
                        _ => return Err(bad(k, "expected `topics` or `blocking`".into())),
                    };
                }
                "reliq.aws.region" => {
                    (aws.region, aws_key) = (Some(v.to_owned()), Some(k.to_owned()))
                }
                "reliq.aws.profile" => {
                    (aws.profile, aws_key) = (Some(v.to_owned()), Some(k.to_owned()))
                }
                "reliq.aws.cluster.arn" => {
                    // arn:<partition>:kafka:<region>:<account>:cluster/<name>/<uuid>
                    let parts: Vec<&str> = v.splitn(6, ':').collect();
                    let cluster = parts.get(5).and_then(|c| c.strip_prefix("cluster/"));
                    if parts.len() != 6
                        || parts[0] != "arn"
                        || parts[2] != "kafka"
                        || cluster
                            .is_none_or(|c| c.split('/').filter(|p| !p.is_empty()).count() != 2)
                    {
                        return Err(bad(
                            k,
                            "expected arn:aws:kafka:<region>:<account>:cluster/<name>/<uuid>"
                                .into(),
                        ));
                    }
                    (aws.cluster_arn, aws_key) = (Some(v.to_owned()), Some(k.to_owned()));
                }
                "sasl.oauthbearer.method" if v.eq_ignore_ascii_case(AWS_MSK_IAM) => {
                    config.msk_iam = Some(MskIamSettings::default());
                }
                other if other.starts_with("reliq.") => {
                    return Err(bad(other, "unknown reliq setting".into()));
                }
                other => {
                    config.client.insert(other.to_owned(), v.to_owned());
                }
            }
        }
        match (&mut config.msk_iam, aws_key) {
            (Some(msk), _) => *msk = aws,
            (None, Some(key)) => {
                return Err(bad(
                    &key,
                    format!("applies only with sasl.oauthbearer.method={AWS_MSK_IAM}"),
                ));
            }
            (None, None) => {}
        }
        if config.msk_iam.is_some() {
            let mechanism = config.client.get("sasl.mechanism").map(String::as_str);
            if mechanism.is_some_and(|m| !m.eq_ignore_ascii_case("OAUTHBEARER")) {
                return Err(bad(
                    "sasl.mechanism",
                    format!("{AWS_MSK_IAM} signs in with OAUTHBEARER, not {mechanism:?}"),
                ));
            }
        }
        Ok(config)
    }

    fn base(&self, defaults: &[(&str, String)]) -> ClientConfig {
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", &self.bootstrap);
        for (k, v) in defaults {
            c.set(*k, v);
        }
        if self.msk_iam.is_some() {
            // The token comes from reliq's callback (crate::oauth), which librdkafka asks
            // only when OAUTHBEARER has no built-in method. MSK's IAM listeners speak TLS.
            c.set("security.protocol", "sasl_ssl");
            c.set("sasl.mechanism", "OAUTHBEARER");
        }
        for (k, v) in &self.client {
            c.set(k, v);
        }
        c
    }

    /// Configuration of the producer: `acks=all`, idempotent, bounded buffer.
    pub(crate) fn producer(&self, allow_auto_create: bool) -> ClientConfig {
        self.base(&[
            ("acks", "all".into()),
            ("enable.idempotence", "true".into()),
            ("linger.ms", "1".into()),
            (
                "queue.buffering.max.messages",
                self.buffer_messages.to_string(),
            ),
            (
                "message.timeout.ms",
                self.send_timeout.as_millis().to_string(),
            ),
            ("allow.auto.create.topics", allow_auto_create.to_string()),
            ("topic.metadata.propagation.max.ms", "1000".into()),
        ])
    }

    /// Configuration of a group consumer (manual commits, earliest reset).
    pub(crate) fn consumer(&self, group: &str, prefetch: u32) -> ClientConfig {
        self.base(&[
            ("group.id", format!("{}{group}", self.group_prefix)),
            ("enable.auto.commit", "false".into()),
            ("enable.auto.offset.store", "false".into()),
            ("auto.offset.reset", "earliest".into()),
            (
                "session.timeout.ms",
                DEFAULT_SESSION_TIMEOUT.as_millis().to_string(),
            ),
            ("heartbeat.interval.ms", "500".into()),
            ("fetch.wait.max.ms", "100".into()),
            // librdkafka's fetch queue is the second stage of flow control (the poll
            // thread stops taking records while the runtime's buffer is full), bounded
            // in memory by `queued.max.messages.kbytes`. It fetches again only once the
            // queue is below `queued.min.messages`, looking every
            // `fetch.queue.backoff.ms`: a threshold of a few prefetches starved fast
            // consumers (docs/benchmarks-history.md), so it stays at librdkafka's default of 100,000
            // records (the memory bound is the one above), and the look is frequent (the
            // default 1 s back-off would stall refills).
            (
                "queued.min.messages",
                prefetch.max(1).saturating_mul(4).max(100_000).to_string(),
            ),
            ("fetch.queue.backoff.ms", "10".into()),
            ("fetch.error.backoff.ms", "20".into()),
            ("queued.max.messages.kbytes", "4096".into()),
            ("allow.auto.create.topics", "false".into()),
        ])
    }

    /// Configuration of the dead-letter reader's consumer: assigned partitions only —
    /// librdkafka assigns only in a consumer with a `group.id`, but `group` is never
    /// joined and nothing is committed to it — and end-of-partition events to know a
    /// read is complete.
    pub(crate) fn reader(&self, group: &str) -> ClientConfig {
        self.base(&[
            ("group.id", format!("{}{group}", self.group_prefix)),
            ("enable.auto.commit", "false".into()),
            ("enable.auto.offset.store", "false".into()),
            ("enable.partition.eof", "true".into()),
            ("auto.offset.reset", "earliest".into()),
            ("fetch.wait.max.ms", "100".into()),
            ("queued.max.messages.kbytes", "4096".into()),
            ("allow.auto.create.topics", "false".into()),
        ])
    }

    /// Whether the clients speak without TLS (`security.protocol` unset, `plaintext` or
    /// `sasl_plaintext`).
    pub(crate) fn plaintext(&self) -> bool {
        match self.client.get("security.protocol") {
            Some(p) => {
                p.eq_ignore_ascii_case("plaintext") || p.eq_ignore_ascii_case("sasl_plaintext")
            }
            None => self.msk_iam.is_none(),
        }
    }

    /// Configuration of the admin client.
    pub(crate) fn admin(&self) -> ClientConfig {
        self.base(&[])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_hosts_and_settings() {
        let c = KafkaConfig::from_url(
            "kafka://h1:9092,h2:9093?reliq.buffer=fail-fast&session.timeout.ms=7000&reliq.replication=3",
        )
        .expect("valid URL");
        assert_eq!(c.bootstrap, "h1:9092,h2:9093");
        assert_eq!(c.buffer, BufferPolicy::FailFast);
        assert_eq!(c.replication, 3);
        assert_eq!(c.retry_mode, RetryMode::Topics);
        let b = KafkaConfig::from_url("kafka://h:1?reliq.retry=blocking").expect("valid URL");
        assert_eq!(b.retry_mode, RetryMode::Blocking);
        assert!(KafkaConfig::from_url("kafka://h:1?reliq.retry=sometimes").is_err());
        assert_eq!(
            c.client.get("session.timeout.ms").map(String::as_str),
            Some("7000")
        );
        let c = KafkaConfig::from_url("kafka://h:1?reliq.buffer=block:250").expect("valid URL");
        assert_eq!(c.buffer, BufferPolicy::Block(Duration::from_millis(250)));
    }

    #[test]
    fn secrets_come_decoded_from_the_url_a_file_or_the_environment_and_never_show() {
        let c = KafkaConfig::from_url(
            "kafka://h:1?security.protocol=sasl_ssl&sasl.username=svc&sasl.password=p%26ss%3D1",
        )
        .expect("valid URL");
        assert_eq!(
            c.client.get("sasl.password").map(String::as_str),
            Some("p&ss=1")
        );
        let shown = format!("{c:?}");
        assert!(!shown.contains("p&ss"), "{shown}");
        assert!(shown.contains("\"sasl.password\": \"***\""), "{shown}");
        assert!(shown.contains("\"sasl.username\": \"svc\""), "{shown}");

        let file = std::env::temp_dir().join(format!("reliq-kafka-pw-{}", std::process::id()));
        std::fs::write(&file, "from-a-file\n").expect("temp file");
        let c = KafkaConfig::from_url(&format!(
            "kafka://h:1?sasl.password.file={}",
            file.display()
        ))
        .expect("valid URL");
        assert_eq!(
            c.client.get("sasl.password").map(String::as_str),
            Some("from-a-file")
        );
        std::fs::remove_file(&file).expect("temp file");
        match KafkaConfig::from_url("kafka://h:1?sasl.password.file=/nonexistent/pw") {
            Err(KafkaError::Config { field, reason }) => {
                assert_eq!(field, "sasl.password.file");
                assert!(reason.contains("/nonexistent/pw"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
        match KafkaConfig::from_url("kafka://h:1?sasl.password.env=RELIQ_TEST_UNSET_VARIABLE") {
            Err(KafkaError::Config { field, .. }) => assert_eq!(field, "sasl.password.env"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn rejects_bad_urls_naming_the_field() {
        for (url, field) in [
            ("amqp://h:1", "url"),
            ("kafka://", "url"),
            ("kafka://hostonly", "url"),
            ("kafka://h:1?reliq.partitions=0", "reliq.partitions"),
            ("kafka://h:1?reliq.nope=1", "reliq.nope"),
            ("kafka://h:1?reliq.buffer=drop", "reliq.buffer"),
            ("kafka://h:1?novalue", "novalue"),
        ] {
            match KafkaConfig::from_url(url) {
                Err(KafkaError::Config { field: f, .. }) => assert_eq!(f, field, "{url}"),
                other => panic!("{url}: {other:?}"),
            }
        }
    }

    #[test]
    fn aws_msk_iam_is_reliqs_method_and_its_settings_need_it() {
        let c = KafkaConfig::from_url(
            "kafka://b-1:9098?sasl.oauthbearer.method=aws_msk_iam&reliq.aws.region=eu-west-1&reliq.aws.profile=svc",
        )
        .expect("valid URL");
        assert_eq!(
            c.msk_iam,
            Some(MskIamSettings {
                region: Some("eu-west-1".into()),
                profile: Some("svc".into()),
                cluster_arn: None,
            })
        );
        // Not librdkafka's value: not passed on; the mechanism and TLS are implied.
        assert!(!c.client.contains_key("sasl.oauthbearer.method"));
        assert!(!c.plaintext());
        let admin = c.admin();
        assert_eq!(admin.get("sasl.mechanism"), Some("OAUTHBEARER"));
        assert_eq!(admin.get("security.protocol"), Some("sasl_ssl"));
        assert_eq!(admin.get("sasl.oauthbearer.method"), None);
        // librdkafka's own methods still pass through.
        let oidc = KafkaConfig::from_url("kafka://b:1?sasl.oauthbearer.method=oidc").unwrap();
        assert_eq!(oidc.msk_iam, None);
        assert_eq!(
            oidc.client
                .get("sasl.oauthbearer.method")
                .map(String::as_str),
            Some("oidc")
        );
        for (url, field) in [
            ("kafka://b:1?reliq.aws.region=eu-west-1", "reliq.aws.region"),
            (
                "kafka://b:1?sasl.oauthbearer.method=aws_msk_iam&sasl.mechanism=SCRAM-SHA-512",
                "sasl.mechanism",
            ),
            (
                "kafka://b:1?sasl.oauthbearer.method=aws_msk_iam&reliq.aws.cluster.arn=arn:aws:sqs:eu-west-1:1:q",
                "reliq.aws.cluster.arn",
            ),
        ] {
            match KafkaConfig::from_url(url) {
                Err(KafkaError::Config { field: f, .. }) => assert_eq!(f, field, "{url}"),
                other => panic!("{url}: {other:?}"),
            }
        }
    }
}
