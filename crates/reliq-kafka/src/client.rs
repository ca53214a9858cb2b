//! The connection: its clients ([`Inner`]: two producers and an admin client) and
//! publishing. The [`Broker`](reliq_core::Broker) implementation is in `broker`.

use std::sync::{Arc, mpsc};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rdkafka::admin::AdminClient;
use rdkafka::error::RDKafkaErrorCode;
use rdkafka::producer::{FutureProducer, FutureRecord, Producer as _};
use rdkafka::util::Timeout;
use reliq_core::{BrokerError, Message};

use crate::codec::record_headers;
use crate::error::{KafkaError, client_error};
use crate::oauth::{self, TokenSource};
use crate::options::{BufferPolicy, KafkaConfig};
use crate::refusals::{Refusals, WatchingContext};
use crate::routes::{ROUTE_RECHECK, Routes};

pub(crate) struct Inner {
    pub(crate) config: KafkaConfig,
    /// Publishes (auto-create allowed where the broker allows it).
    pub(crate) producer: FutureProducer<WatchingContext>,
    /// Retry / DLQ copies (auto-create off; topics are declared at subscribe).
    pub(crate) route_producer: FutureProducer<WatchingContext>,
    pub(crate) admin: AdminClient<WatchingContext>,
    /// TLS / SASL refusals the clients above saw: requests end with them at once.
    pub(crate) refusals: Refusals,
    /// Retry and DLQ topics seen to exist: [`route_produce`] looks a topic up again only
    /// after [`ROUTE_RECHECK`] or a failed produce to it, one lookup at a time.
    pub(crate) routes: Routes,
    /// `reliq_producer_buffer_ratio`: the share of the publishing producer's bounded
    /// buffer in use, set after each publish.
    pub(crate) buffer_ratio: metrics::Gauge,
    /// OAUTHBEARER tokens reliq makes (AWS MSK IAM), if any.
    pub(crate) tokens: TokenSource,
    /// Held only to end the admin client's sign-in thread with `self` (dropped).
    _admin_sign_in: Option<mpsc::Sender<()>>,
}

/// A Kafka connection: two idempotent producers (publish; retry/DLQ copies) and an admin
/// client. Cheap to clone. Each `subscribe` / `dead_letters` creates its own consumers.
#[derive(Clone)]
pub struct KafkaBroker {
    pub(crate) inner: Arc<Inner>,
}

impl std::fmt::Debug for KafkaBroker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaBroker").finish_non_exhaustive()
    }
}

impl KafkaBroker {
    /// Connect with a `kafka://` URL (see [`KafkaConfig`]). Clients connect lazily; a
    /// broker that is down shows up on the first operation.
    pub fn connect(url: &str) -> Result<Self, KafkaError> {
        Self::with_config(KafkaConfig::from_url(url)?)
    }

    /// Connect with explicit settings.
    pub fn with_config(config: KafkaConfig) -> Result<Self, KafkaError> {
        let refusals = Refusals::new(&config.bootstrap);
        let tokens = TokenSource::for_config(&config)?;
        let watching = || WatchingContext {
            refusals: refusals.clone(),
            plaintext: config.plaintext(),
            tokens: tokens.clone(),
        };
        let producer = config.producer(true).create_with_context(watching())?;
        let route_producer = config.producer(false).create_with_context(watching())?;
        let admin = config.admin().create_with_context(watching())?;
        let (admin_sign_in, stop) = mpsc::channel();
        let inner = Arc::new(Inner {
            config,
            producer,
            route_producer,
            admin,
            refusals,
            routes: Routes::new(ROUTE_RECHECK),
            buffer_ratio: metrics::gauge!(
                reliq_core::metrics::PRODUCER_BUFFER_RATIO,
                "backend" => "kafka"
            ),
            tokens: tokens.clone(),
            _admin_sign_in: tokens.is_active().then_some(admin_sign_in),
        });
        if tokens.is_active() {
            oauth::keep_signed_in(
                tokens,
                Arc::downgrade(&inner),
                |inner: &Inner| inner.admin.inner(),
                stop,
            );
        }
        Ok(Self { inner })
    }

    /// The settings in use.
    pub fn config(&self) -> &KafkaConfig {
        &self.inner.config
    }

    /// Create `topics` (with the configured partitions and replication) where missing,
    /// and wait until the cluster's metadata shows them: a broker answers CreateTopics
    /// before its own metadata cache has the topic, and a publish or a lookup right
    /// after would not find it.
    pub async fn ensure_topics(&self, topics: &[String]) -> Result<(), KafkaError> {
        self.inner.ensure_topics(topics).await?;
        self.inner
            .wait_visible(topics)
            .await
            .map_err(|e| KafkaError::Admin {
                topic: topics.join(", "),
                reason: "created, but not in the cluster's metadata in time".into(),
                source: Some(Box::new(e)),
            })
    }

    /// Delete `topics` (for operators and tests; missing topics are not an error).
    pub async fn delete_topics(&self, topics: &[String]) -> Result<(), KafkaError> {
        self.inner.delete_topics(topics).await
    }

    /// Declare `sub`'s dead-letter topics — the DLQ and its removal ledger (idempotent;
    /// subscribing does this too) — and wait until the cluster shows them (e.g. to
    /// restore a deleted DLQ).
    pub async fn declare_dead_letters(
        &self,
        sub: &reliq_core::Subscription,
    ) -> Result<(), BrokerError> {
        let dlq = sub.dead_letter_name();
        self.inner.ensure_dead_letter_topics(&dlq).await?;
        let ledger = crate::names::ledger_topic(&dlq);
        self.inner.wait_visible(&[dlq, ledger]).await
    }

    /// Whether `topic` exists right now (a fresh metadata request that never creates it).
    pub async fn topic_exists(&self, topic: &str) -> Result<bool, KafkaError> {
        self.inner.topic_exists(topic).await
    }

    /// The names of every topic the principal may describe, sorted (one metadata
    /// request; creates nothing).
    pub async fn topic_names(&self) -> Result<Vec<String>, BrokerError> {
        let producer = self.inner.route_producer.clone();
        let lookup = tokio::task::spawn_blocking(move || {
            producer
                .client()
                .fetch_metadata(None, Duration::from_secs(10))
        });
        // A TLS or SASL refusal ends the wait at once, naming the cause.
        let metadata = self
            .inner
            .refusals
            .or_refused(&self.inner.config.bootstrap, lookup)
            .await?
            .map_err(|e| BrokerError::Other(Box::new(e)))?
            .map_err(|e| {
                BrokerError::connection(format!("reading the cluster's topics: {e}")).caused_by(e)
            })?;
        let mut names: Vec<String> = metadata
            .topics()
            .iter()
            .filter(|t| t.error().is_none())
            .map(|t| t.name().to_owned())
            .collect();
        names.sort();
        Ok(names)
    }
}

impl Inner {
    /// Produce `message` and wait for its delivery report.
    pub(crate) async fn produce(
        &self,
        route: bool,
        topic: &str,
        message: &Message,
        extra: &[(&str, String)],
    ) -> Result<(i32, i64), BrokerError> {
        let producer = if route {
            &self.route_producer
        } else {
            &self.producer
        };
        let mut record = FutureRecord::to(topic)
            .payload(message.payload().as_ref())
            .headers(record_headers(message, extra))
            .timestamp(now_millis_ceil());
        if let Some(key) = message.key() {
            record = record.key(key);
        }
        let queue_timeout = match self.config.buffer {
            BufferPolicy::Block(d) => Timeout::After(d),
            BufferPolicy::FailFast => Timeout::After(Duration::ZERO),
        };
        let sent = self
            .refusals
            .or_refused(&self.config.bootstrap, async {
                producer
                    .send(record, queue_timeout)
                    .await
                    .map_err(|(e, _)| e)
            })
            .await?;
        if !route {
            // What is still queued when this one is done: the pressure on the buffer.
            let queued = f64::from(rdkafka::producer::Producer::in_flight_count(producer).max(0));
            self.buffer_ratio
                .set(queued / f64::from(self.config.buffer_messages.max(1)));
        }
        match sent {
            Ok(delivery) => Ok((delivery.partition, delivery.offset)),
            Err(e) if e.rdkafka_error_code() == Some(RDKafkaErrorCode::Fatal) => {
                Err(fatal(producer, topic))
            }
            Err(e) => Err(match client_error(e, "producing to", topic) {
                BrokerError::Timeout(_) => BrokerError::Timeout(self.config.send_timeout),
                other => other,
            }),
        }
    }
}

/// What a producer's fatal error was. An idempotent producer refused its producer id (no
/// Write on any topic yet: its ACLs were granted after it started) fails for good and
/// every later send says only "Fatal": name the cause, as an authorization error where it
/// is one. Recreating the connection (`KafkaBroker::connect`) starts a new producer.
fn fatal<C: rdkafka::ClientContext>(producer: &FutureProducer<C>, topic: &str) -> BrokerError {
    let Some((code, reason)) = producer.client().fatal_error() else {
        return BrokerError::connection(format!(
            "producing to {topic}: the producer failed for good"
        ));
    };
    let reason = format!(
        "producing to {topic}: the producer failed for good ({code}: {reason}); connect again once it is fixed"
    );
    match crate::error::authorization_resource(code) {
        Some(kind) => BrokerError::Unauthorized {
            resource: if kind == "topic" {
                format!("topic {topic}")
            } else {
                kind.to_owned()
            },
            reason,
            source: Some(Box::new(code)),
        },
        None => BrokerError::connection(reason),
    }
}

/// Produce a retry / DLQ copy: the topic must exist (never auto-created), then wait for
/// the delivery report.
///
/// Whether it exists is asked of the broker once per topic per [`ROUTE_RECHECK`], by one
/// copy at a time ([`Routes`]). A topic deleted meanwhile is still caught: the route
/// producer never auto-creates, so the produce fails (unknown topic), the source is
/// released and the next copy looks the topic up again.
pub(crate) async fn route_produce(
    inner: &Inner,
    topic: &str,
    message: &Message,
    extra: &[(&str, String)],
) -> Result<(), BrokerError> {
    let exists = inner.routes.exists(topic, inner.topic_exists(topic));
    if !exists.await.map_err(BrokerError::from)? {
        return Err(BrokerError::Unroutable(topic.to_owned()));
    }
    let sent = inner.produce(true, topic, message, extra).await.map(drop);
    if sent.is_err() {
        inner.routes.forget(topic);
    }
    sent
}

/// Now in ms since the epoch, rounded up, so "timestamp + delay" is never earlier than
/// "produce time + delay".
pub(crate) fn now_millis_ceil() -> i64 {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let ms = now.as_millis() + u128::from(!now.subsec_nanos().is_multiple_of(1_000_000));
    i64::try_from(ms).unwrap_or(i64::MAX)
}
