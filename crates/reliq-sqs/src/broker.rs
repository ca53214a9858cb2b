//! The SQS connection: URL parsing, queue declaration, the topic → queues convention,
//! publishing, and the [`Broker`] implementation.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use aws_sdk_sqs::error::DisplayErrorContext;
use aws_sdk_sqs::types::QueueAttributeName;
use reliq_core::{Broker, BrokerError, Capabilities, Destination, Message, Receiver, Subscription};

use crate::error::{SqsError, sdk_error};
use crate::names::{self, CONSUMER_TAG, FILTER_TAG, ROLE_TAG, SOURCE_TAG};
use crate::options::{MAX_VISIBILITY, SqsOptions};
use crate::{batch, codec, receiver};

/// One consumer queue a topic's messages go to.
#[derive(Clone, Debug)]
struct Target {
    url: String,
    filter: Option<String>,
}

/// When a topic's queues were listed, and what they were.
type Listed = (Instant, Arc<Vec<Target>>);

/// A connection to SQS. Cheap to clone.
#[derive(Clone)]
pub struct SqsBroker {
    pub(crate) inner: Arc<Inner>,
}

impl std::fmt::Debug for SqsBroker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqsBroker").finish_non_exhaustive()
    }
}

pub(crate) struct Inner {
    pub(crate) client: aws_sdk_sqs::Client,
    sends: batch::Batcher<codec::Encoded>,
    deletes: batch::Batcher<String>,
    pub(crate) options: SqsOptions,
    /// topic → (when listed, its consumer queues).
    topics: Mutex<HashMap<String, Listed>>,
    /// queue url → its target (None: not a consumer queue). Tags do not change.
    tags: Mutex<HashMap<String, Option<(String, Target)>>>,
}

/// Where a subscription's queues live.
#[derive(Clone, Debug)]
pub(crate) struct Declared {
    pub(crate) url: String,
    pub(crate) dead_letter_url: String,
}

/// Whole seconds SQS can take for `d`: rounded up (a delay never fires early), ≤ 12 h.
pub(crate) fn whole_seconds(d: Duration) -> i32 {
    let d = d.min(MAX_VISIBILITY);
    let secs = d.as_secs() + u64::from(d.subsec_nanos() > 0);
    i32::try_from(secs).unwrap_or(i32::MAX)
}

fn config(field: &str, reason: impl Into<String>) -> BrokerError {
    BrokerError::Config {
        field: field.to_owned(),
        reason: reason.into(),
    }
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && i + 2 < bytes.len()
            && let Some(b) = std::str::from_utf8(&bytes[i + 1..i + 3])
                .ok()
                .and_then(|h| u8::from_str_radix(h, 16).ok())
        {
            out.push(b);
            i += 3;
            continue;
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A parsed `sqs://` URL.
#[derive(Debug, PartialEq, Eq)]
struct SqsUrl {
    endpoint: Option<String>,
    region: Option<String>,
    credentials: Option<(String, String)>,
    fifo: bool,
}

fn parse_url(url: &str) -> Result<SqsUrl, BrokerError> {
    let rest = url.strip_prefix("sqs://").ok_or_else(|| {
        config(
            "url",
            "expected sqs://host:port?region=… or sqs://?region=…",
        )
    })?;
    let (authority, query) = rest.split_once('?').unwrap_or((rest, ""));
    let authority = authority.trim_end_matches('/');
    let (userinfo, host) = match authority.rsplit_once('@') {
        Some((u, h)) => (Some(u), h),
        None => (None, authority),
    };
    let credentials = match userinfo {
        None => None,
        Some(u) => {
            let (key, secret) = u
                .split_once(':')
                .ok_or_else(|| config("url credentials", "expected KEY:SECRET@"))?;
            Some((percent_decode(key), percent_decode(secret)))
        }
    };
    let mut region = None;
    let mut tls = false;
    let mut fifo = false;
    for kv in query.split('&').filter(|kv| !kv.is_empty()) {
        let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
        match k {
            "region" => region = Some(v.to_owned()),
            "tls" => tls = v == "true" || v == "1",
            "fifo" => fifo = v == "true" || v == "1",
            other => {
                return Err(config(
                    &format!("url query `{other}`"),
                    "unknown SQS URL option (known: region, tls, fifo)",
                ));
            }
        }
    }
    let endpoint = (!host.is_empty()).then(|| {
        let scheme = if tls { "https" } else { "http" };
        format!("{scheme}://{host}")
    });
    if endpoint.is_none() && credentials.is_some() {
        return Err(config(
            "url credentials",
            "credentials in the URL need an endpoint; real AWS uses the default credential chain",
        ));
    }
    Ok(SqsUrl {
        endpoint,
        region,
        credentials,
        fifo,
    })
}

impl SqsBroker {
    /// Connect with default options (see the crate docs for the URL forms).
    pub async fn connect(url: &str) -> Result<Self, BrokerError> {
        Self::connect_with(url, SqsOptions::default()).await
    }

    /// Connect with options.
    pub async fn connect_with(url: &str, options: SqsOptions) -> Result<Self, BrokerError> {
        use aws_smithy_http_client::{Builder, tls};
        let parsed = parse_url(url)?;
        let http = Builder::new()
            .tls_provider(tls::Provider::Rustls(
                tls::rustls_provider::CryptoMode::Ring,
            ))
            .build_https();
        let mut loader =
            aws_config::defaults(aws_config::BehaviorVersion::latest()).http_client(http);
        if let Some(region) = &parsed.region {
            loader = loader.region(aws_config::Region::new(region.clone()));
        }
        if let Some(endpoint) = &parsed.endpoint {
            loader = loader.endpoint_url(endpoint);
            if parsed.region.is_none() {
                loader = loader.region(aws_config::Region::new("us-east-1"));
            }
            let (key, secret) = parsed
                .credentials
                .clone()
                .unwrap_or_else(|| ("reliq".into(), "reliq".into()));
            loader = loader.credentials_provider(aws_sdk_sqs::config::Credentials::new(
                key,
                secret,
                None,
                None,
                "reliq-url",
            ));
        }
        let conf = loader.load().await;
        if conf.region().is_none() {
            return Err(config(
                "url region",
                "no region: add ?region=… or configure AWS_REGION",
            ));
        }
        let options = SqsOptions {
            fifo: options.fifo || parsed.fifo,
            ..options
        };
        Ok(Self::from_client(aws_sdk_sqs::Client::new(&conf), options))
    }

    /// Wrap an existing client (custom credentials, retries, interceptors). Call it inside
    /// a tokio runtime: it starts the send and delete batchers.
    pub fn from_client(client: aws_sdk_sqs::Client, options: SqsOptions) -> Self {
        Self {
            inner: Arc::new(Inner {
                sends: batch::sends(client.clone(), options.batch_window),
                deletes: batch::deletes(client.clone(), options.batch_window),
                client,
                options,
                topics: Mutex::new(HashMap::new()),
                tags: Mutex::new(HashMap::new()),
            }),
        }
    }

    /// The underlying client.
    pub fn client(&self) -> &aws_sdk_sqs::Client {
        &self.inner.client
    }

    pub(crate) async fn queue_url(&self, name: &str) -> Result<Option<String>, BrokerError> {
        match self
            .inner
            .client
            .get_queue_url()
            .queue_name(name)
            .send()
            .await
        {
            Ok(out) => Ok(out.queue_url().map(str::to_owned)),
            Err(e) => match sdk_error("GetQueueUrl", e) {
                BrokerError::Unroutable(_) => Ok(None),
                other => Err(other),
            },
        }
    }

    /// Create `name` with `attributes` and `tags`, or bring an existing one up to date.
    /// A FIFO name (`.fifo`) is created with `FifoQueue=true`, which SQS accepts only at
    /// creation.
    async fn ensure_queue(
        &self,
        name: &str,
        attributes: &[(QueueAttributeName, String)],
        tags: &[(&str, String)],
    ) -> Result<String, BrokerError> {
        let client = &self.inner.client;
        if let Some(url) = self.queue_url(name).await? {
            let mut set = client.set_queue_attributes().queue_url(&url);
            for (k, v) in attributes {
                set = set.attributes(k.clone(), v.clone());
            }
            set.send()
                .await
                .map_err(|e| sdk_error("SetQueueAttributes", e))?;
            let mut tag = client.tag_queue().queue_url(&url);
            for (k, v) in tags {
                tag = tag.tags(*k, v.clone());
            }
            tag.send().await.map_err(|e| sdk_error("TagQueue", e))?;
            return Ok(url);
        }
        let mut create = client.create_queue().queue_name(name);
        if names::is_fifo(name) {
            create = create.attributes(QueueAttributeName::FifoQueue, "true");
        }
        for (k, v) in attributes {
            create = create.attributes(k.clone(), v.clone());
        }
        for (k, v) in tags {
            create = create.tags(*k, v.clone());
        }
        let out = create
            .send()
            .await
            .map_err(|e| sdk_error("CreateQueue", e))?;
        out.queue_url().map(str::to_owned).ok_or_else(|| {
            BrokerError::Other(Box::new(SqsError::Incomplete {
                operation: "CreateQueue",
                what: "queue url",
            }))
        })
    }

    pub(crate) async fn queue_arn(&self, url: &str) -> Result<String, BrokerError> {
        let out = self
            .inner
            .client
            .get_queue_attributes()
            .queue_url(url)
            .attribute_names(QueueAttributeName::QueueArn)
            .send()
            .await
            .map_err(|e| sdk_error("GetQueueAttributes", e))?;
        out.attributes()
            .and_then(|a| a.get(&QueueAttributeName::QueueArn))
            .cloned()
            .ok_or_else(|| {
                BrokerError::Other(Box::new(SqsError::Incomplete {
                    operation: "GetQueueAttributes",
                    what: "QueueArn",
                }))
            })
    }

    /// Declare the subscription's dead-letter queue (idempotent; messages kept 14 days,
    /// the SQS maximum). Returns its URL.
    pub async fn declare_dead_letters(&self, sub: &Subscription) -> Result<String, BrokerError> {
        self.ensure_queue(
            &names::dead_letter_queue_name(sub, self.inner.options.fifo),
            &[(
                QueueAttributeName::MessageRetentionPeriod,
                crate::topology::DEAD_LETTER_RETENTION_SECS.to_string(),
            )],
            &[
                (ROLE_TAG, "dead-letter".into()),
                (SOURCE_TAG, sub.source.clone()),
                (CONSUMER_TAG, sub.consumer.clone()),
            ],
        )
        .await
    }

    /// Delete the subscription's dead-letter queue (for fault-injection tests: the DLQ
    /// becomes unavailable; [`SqsBroker::declare_dead_letters`] restores it). Feature
    /// `test-util`.
    #[cfg(feature = "test-util")]
    pub async fn delete_dead_letters(&self, sub: &Subscription) -> Result<(), BrokerError> {
        if let Some(url) = self
            .queue_url(&names::dead_letter_queue_name(sub, self.inner.options.fifo))
            .await?
        {
            self.inner
                .client
                .delete_queue()
                .queue_url(url)
                .send()
                .await
                .map_err(|e| sdk_error("DeleteQueue", e))?;
        }
        Ok(())
    }

    /// Declare the subscription's queues (idempotent): the DLQ, then the consumer queue
    /// with its redrive policy, then the DLQ's redrive-allow policy.
    pub(crate) async fn declare(&self, sub: &Subscription) -> Result<Declared, BrokerError> {
        let dead_letter_url = self.declare_dead_letters(sub).await?;
        let dead_letter_arn = self.queue_arn(&dead_letter_url).await?;
        let redrive = serde_json::json!({
            "deadLetterTargetArn": dead_letter_arn,
            "maxReceiveCount": crate::topology::max_receive_count(sub),
        });
        let mut tags = vec![
            (ROLE_TAG, "consumer".to_owned()),
            (SOURCE_TAG, sub.source.clone()),
            (CONSUMER_TAG, sub.consumer.clone()),
        ];
        if let Some(filter) = sub.filter.as_ref().filter(|f| f.as_str() != "#") {
            tags.push((FILTER_TAG, filter.clone()));
        }
        let url = self
            .ensure_queue(
                &names::queue_name(sub, self.inner.options.fifo),
                &[
                    (
                        QueueAttributeName::VisibilityTimeout,
                        whole_seconds(sub.lease).max(1).to_string(),
                    ),
                    (QueueAttributeName::RedrivePolicy, redrive.to_string()),
                ],
                &tags,
            )
            .await?;
        let source_arn = self.queue_arn(&url).await?;
        let allow = serde_json::json!({
            "redrivePermission": "byQueue",
            "sourceQueueArns": [source_arn],
        });
        if let Err(e) = self
            .inner
            .client
            .set_queue_attributes()
            .queue_url(&dead_letter_url)
            .attributes(QueueAttributeName::RedriveAllowPolicy, allow.to_string())
            .send()
            .await
        {
            // Not every emulator knows the attribute; the redrive policy works without it.
            tracing::warn!(error = %DisplayErrorContext(&e), "cannot set the DLQ's RedriveAllowPolicy");
        }
        self.forget_topic(&sub.source);
        Ok(Declared {
            url,
            dead_letter_url,
        })
    }

    /// Ask SQS to move the subscription's dead letters back to its queue with a
    /// server-side `StartMessageMoveTask` (at most `per_second` messages per second, SQS's
    /// default rate when `None`). Returns the task handle, or `None` when the endpoint
    /// does not run one — emulators (moto answers HTTP 500) and any other refusal, which
    /// is logged: then redrive with the portable replay engine
    /// ([`reliq_core::replay`]), which works on every endpoint, strips the failure
    /// headers and marks the copies as replayed. A move task keeps each message as it
    /// is (the dead-letter record stays in its attributes).
    pub async fn start_message_move_task(
        &self,
        sub: &Subscription,
        per_second: Option<i32>,
    ) -> Result<Option<String>, BrokerError> {
        let dead_letter_url = self.declare_dead_letters(sub).await?;
        let name = names::queue_name(sub, self.inner.options.fifo);
        let url = self
            .queue_url(&name)
            .await?
            .ok_or(BrokerError::Unroutable(name))?;
        let (source, destination) = (
            self.queue_arn(&dead_letter_url).await?,
            self.queue_arn(&url).await?,
        );
        match self
            .inner
            .client
            .start_message_move_task()
            .source_arn(source)
            .destination_arn(destination)
            .set_max_number_of_messages_per_second(per_second)
            .send()
            .await
        {
            Ok(out) => Ok(out.task_handle().map(str::to_owned)),
            Err(e) => {
                tracing::warn!(error = %DisplayErrorContext(&e), "StartMessageMoveTask refused; redrive with the replay engine instead");
                Ok(None)
            }
        }
    }

    /// Messages of the subscription's queue that are received and not yet deleted, or
    /// waiting out a retry delay (`ApproximateNumberOfMessagesNotVisible`).
    pub async fn not_visible(&self, sub: &Subscription) -> Result<usize, BrokerError> {
        let url = self
            .queue_url(&names::queue_name(sub, self.inner.options.fifo))
            .await?
            .ok_or_else(|| {
                BrokerError::Unroutable(names::queue_name(sub, self.inner.options.fifo))
            })?;
        let out = self
            .inner
            .client
            .get_queue_attributes()
            .queue_url(url)
            .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesNotVisible)
            .send()
            .await
            .map_err(|e| sdk_error("GetQueueAttributes", e))?;
        Ok(out
            .attributes()
            .and_then(|a| a.get(&QueueAttributeName::ApproximateNumberOfMessagesNotVisible))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0))
    }

    fn forget_topic(&self, topic: &str) {
        self.inner
            .topics
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(topic);
    }

    /// The consumer queues of `topic` (cached for [`SqsOptions::topic_cache_ttl`]).
    async fn targets(&self, topic: &str) -> Result<Arc<Vec<Target>>, BrokerError> {
        if let Some((at, targets)) = self
            .inner
            .topics
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(topic)
            && at.elapsed() < self.inner.options.topic_cache_ttl
        {
            return Ok(targets.clone());
        }
        let mut urls = Vec::new();
        let mut next: Option<String> = None;
        loop {
            let out = self
                .inner
                .client
                .list_queues()
                .queue_name_prefix(names::topic_prefix(topic))
                .max_results(1000)
                .set_next_token(next.take())
                .send()
                .await
                .map_err(|e| sdk_error("ListQueues", e))?;
            urls.extend(out.queue_urls().iter().cloned());
            match out.next_token() {
                Some(t) if !t.is_empty() => next = Some(t.to_owned()),
                _ => break,
            }
        }
        let mut targets = Vec::new();
        for url in urls {
            let known = self
                .inner
                .tags
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(&url)
                .cloned();
            let target = match known {
                Some(t) => t,
                None => {
                    let out = match self
                        .inner
                        .client
                        .list_queue_tags()
                        .queue_url(&url)
                        .send()
                        .await
                    {
                        Ok(out) => out,
                        Err(e) => match sdk_error("ListQueueTags", e) {
                            // Deleted since it was listed.
                            BrokerError::Unroutable(_) => continue,
                            other => return Err(other),
                        },
                    };
                    let tags = out.tags();
                    let t = tags
                        .and_then(|t| {
                            (t.get(ROLE_TAG).map(String::as_str) == Some("consumer")).then_some(t)
                        })
                        .and_then(|t| t.get(SOURCE_TAG))
                        .map(|source| {
                            (
                                source.clone(),
                                Target {
                                    url: url.clone(),
                                    filter: tags.and_then(|t| t.get(FILTER_TAG)).cloned(),
                                },
                            )
                        });
                    self.inner
                        .tags
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .insert(url.clone(), t.clone());
                    t
                }
            };
            if let Some((source, target)) = target
                && source == topic
            {
                targets.push(target);
            }
        }
        let targets = Arc::new(targets);
        if !targets.is_empty() {
            self.inner
                .topics
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(topic.to_owned(), (Instant::now(), targets.clone()));
        }
        Ok(targets)
    }

    /// Send `encoded` (made from `message`) to the queue at `url`; a FIFO queue gets the
    /// message's group and `dedup` as its deduplication id.
    pub(crate) async fn send(
        &self,
        url: &str,
        encoded: &codec::Encoded,
        message: &Message,
        dedup: &str,
    ) -> Result<(), BrokerError> {
        let entry = if names::is_fifo(url) {
            encoded.for_fifo(message.key(), dedup)
        } else {
            encoded.clone()
        };
        self.inner.sends.send(url, entry).await
    }

    pub(crate) async fn delete(&self, url: &str, receipt: &str) -> Result<(), BrokerError> {
        self.inner.deletes.delete(url, receipt).await
    }

    async fn publish_once(
        &self,
        destination: &Destination,
        encoded: &codec::Encoded,
        message: &Message,
    ) -> Result<(), BrokerError> {
        let targets = self.targets(&destination.topic).await?;
        let route = destination.route.as_deref();
        let chosen: Vec<&Target> = targets
            .iter()
            .filter(|t| names::filter_matches(t.filter.as_deref(), route))
            .collect();
        if chosen.is_empty() {
            return Err(BrokerError::Unroutable(destination.to_string()));
        }
        let results = futures::future::join_all(
            chosen
                .iter()
                .map(|t| self.send(&t.url, encoded, message, message.id().as_str())),
        )
        .await;
        results.into_iter().collect()
    }
}

#[async_trait]
impl Broker for SqsBroker {
    fn kind(&self) -> &'static str {
        "sqs"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            rejects_unroutable: true,
            exact_retry_delay: true,
            delivery_limit: true,
            consumer_redelivery: true,
            attempts_count_every_delivery: true,
            // FIFO queues drop a second publish of an id within 5 minutes.
            deduplicates_publishes: self.inner.options.fifo,
            filters: true,
            retries_counted_apart: false,
        }
    }

    async fn publish(
        &self,
        destination: &Destination,
        message: Message,
    ) -> Result<(), BrokerError> {
        let encoded = codec::encode(&message, destination.route.as_deref())?;
        match self.publish_once(destination, &encoded, &message).await {
            // A cached queue was deleted: list again once.
            Err(BrokerError::Unroutable(_)) => {
                self.forget_topic(&destination.topic);
                self.publish_once(destination, &encoded, &message).await
            }
            other => other,
        }
    }

    async fn subscribe(
        &self,
        subscription: &Subscription,
    ) -> Result<Box<dyn Receiver>, BrokerError> {
        let declared = self.declare(subscription).await?;
        Ok(Box::new(receiver::SqsReceiver::start(
            self.clone(),
            subscription.clone(),
            declared,
        )))
    }

    async fn dead_letters(
        &self,
        subscription: &Subscription,
    ) -> Result<Box<dyn reliq_core::DeadLetters>, BrokerError> {
        let url = self.declare_dead_letters(subscription).await?;
        Ok(Box::new(crate::dead_letters::SqsDeadLetters::new(
            self.clone(),
            subscription.clone(),
            url,
        )))
    }

    async fn plan(&self, subscription: &Subscription) -> Result<reliq_core::Plan, BrokerError> {
        self.plan_topology(subscription).await
    }

    async fn inspect(
        &self,
        _subscription: &Subscription,
        plan: &reliq_core::Plan,
    ) -> Result<reliq_core::LiveTopology, BrokerError> {
        self.inspect_topology(plan).await
    }

    /// The consumer queue's approximate counts: visible and delayed are waiting, not
    /// visible is in flight (a retry waits there too: its visibility timeout is its delay).
    async fn backlog(
        &self,
        subscription: &Subscription,
    ) -> Result<reliq_core::Backlog, BrokerError> {
        let name = names::queue_name(subscription, self.inner.options.fifo);
        let url = self
            .queue_url(&name)
            .await?
            .ok_or_else(|| BrokerError::Unroutable(format!("queue `{name}` does not exist")))?;
        let out = self
            .inner
            .client
            .get_queue_attributes()
            .queue_url(&url)
            .attribute_names(QueueAttributeName::ApproximateNumberOfMessages)
            .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesDelayed)
            .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesNotVisible)
            .send()
            .await
            .map_err(|e| sdk_error("GetQueueAttributes", e))?;
        let count = |attribute: QueueAttributeName| -> u64 {
            out.attributes()
                .and_then(|a| a.get(&attribute))
                .and_then(|v| v.parse().ok())
                .unwrap_or(0)
        };
        let waiting = count(QueueAttributeName::ApproximateNumberOfMessages)
            + count(QueueAttributeName::ApproximateNumberOfMessagesDelayed);
        Ok(
            reliq_core::Backlog::waiting(waiting).with_in_flight(Some(count(
                QueueAttributeName::ApproximateNumberOfMessagesNotVisible,
            ))),
        )
    }

    async fn send_to_consumer(
        &self,
        subscription: &Subscription,
        message: Message,
    ) -> Result<(), BrokerError> {
        let name = names::queue_name(subscription, self.inner.options.fifo);
        let url = self
            .queue_url(&name)
            .await?
            .ok_or(BrokerError::Unroutable(name))?;
        let encoded = codec::encode(&message, None)?;
        // Replay delivers again on purpose: not the original's deduplication id.
        let dedup = format!("{}-replay-{}", message.id(), receiver::unique_suffix());
        self.send(&url, &encoded, &message, &dedup).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse_without_leaking_secrets() {
        let u = parse_url("sqs://127.0.0.1:4566?region=us-east-1").expect("url");
        assert_eq!(u.endpoint.as_deref(), Some("http://127.0.0.1:4566"));
        assert_eq!(u.region.as_deref(), Some("us-east-1"));
        let u = parse_url("sqs://?region=eu-west-1").expect("url");
        assert_eq!(u.endpoint, None);
        let u = parse_url("sqs://AK:s%2Fcret@h:1?tls=true").expect("url");
        assert_eq!(u.endpoint.as_deref(), Some("https://h:1"));
        assert_eq!(u.credentials, Some(("AK".into(), "s/cret".into())));
        let err = parse_url("sqs://h:1?bogus=1").expect_err("unknown option");
        assert!(err.to_string().contains("bogus"));
        let err = parse_url("sqs://AK:secret@?region=x").expect_err("needs endpoint");
        assert!(!err.to_string().contains("secret@"));
    }

    #[test]
    fn delays_round_up_to_whole_seconds_and_cap_at_12h() {
        assert_eq!(whole_seconds(Duration::ZERO), 0);
        assert_eq!(whole_seconds(Duration::from_millis(1)), 1);
        assert_eq!(whole_seconds(Duration::from_millis(1500)), 2);
        assert_eq!(whole_seconds(Duration::from_secs(2)), 2);
        assert_eq!(whole_seconds(Duration::from_secs(100_000)), 43_200);
    }
}
