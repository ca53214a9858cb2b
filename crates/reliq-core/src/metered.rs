use crate::sync::lock;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use async_trait::async_trait;
use metrics::{Counter, Histogram, counter, histogram};
use tracing::Instrument as _;

use crate::backlog::Backlog;
use crate::broker::{Broker, Receiver};
use crate::dead_letters::DeadLetters;
use crate::error::BrokerError;
use crate::headers;
use crate::message::Message;
use crate::subscription::{Capabilities, Destination, Subscription};
use crate::telemetry::{PUBLISH_DURATION, PUBLISH_FAILURES, PUBLISHED};

/// A broker whose publishes are counted and timed, per destination topic; everything
/// else is passed through untouched. `reliq::connect` returns its brokers wrapped in one.
///
/// [`MeteredBroker`]: any [`Broker`] with reliq's publish metrics
/// (`reliq_messages_published_total`, `reliq_publish_failures_total`,
/// `reliq_publish_duration_seconds`) and a `send <destination>` span per publish (see
/// [`metrics`](crate::metrics)).
pub struct MeteredBroker {
    inner: Arc<dyn Broker>,
    /// One set of handles per topic, so a publish does one map lookup, not a registry
    /// lookup per metric.
    topics: Mutex<HashMap<String, Arc<TopicMetrics>>>,
}

struct TopicMetrics {
    /// The span name, `send <topic>`.
    send: Box<str>,
    system: &'static str,
    published: Counter,
    duration: Histogram,
    backend: &'static str,
    topic: String,
}

impl TopicMetrics {
    fn failed(&self, e: &BrokerError) {
        counter!(PUBLISH_FAILURES, "backend" => self.backend, "destination" => self.topic.clone(), "kind" => e.kind())
            .increment(1);
    }
}

impl std::fmt::Debug for MeteredBroker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MeteredBroker")
            .field("backend", &self.inner.kind())
            .finish_non_exhaustive()
    }
}

impl MeteredBroker {
    /// Meter `inner`'s publishes.
    pub fn new(inner: Arc<dyn Broker>) -> Self {
        crate::telemetry::describe_metrics();
        Self {
            inner,
            topics: Mutex::new(HashMap::new()),
        }
    }

    /// The broker behind the metrics.
    pub fn inner(&self) -> &Arc<dyn Broker> {
        &self.inner
    }

    fn topic(&self, topic: &str) -> Arc<TopicMetrics> {
        let mut topics = lock(&self.topics);
        if let Some(m) = topics.get(topic) {
            return m.clone();
        }
        let backend = self.inner.kind();
        let labels = [
            ("backend", backend.to_owned()),
            ("destination", topic.to_owned()),
        ];
        let m = Arc::new(TopicMetrics {
            send: format!("send {topic}").into(),
            system: crate::telemetry::messaging_system(backend),
            published: counter!(PUBLISHED, &labels),
            duration: histogram!(PUBLISH_DURATION, &labels),
            backend,
            topic: topic.to_owned(),
        });
        topics.insert(topic.to_owned(), m.clone());
        m
    }
}

#[async_trait]
impl Broker for MeteredBroker {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    async fn publish(
        &self,
        destination: &Destination,
        mut message: Message,
    ) -> Result<(), BrokerError> {
        let metrics = self.topic(&destination.topic);
        let span = tracing::info_span!(
            "send",
            otel.name = %metrics.send,
            otel.kind = "producer",
            messaging.system = metrics.system,
            messaging.destination.name = %destination.topic,
            messaging.operation.type = "send",
            messaging.operation.name = "send",
            messaging.message.id = %message.id(),
            error.type = tracing::field::Empty,
        );
        // The consumer's process span continues this trace (feature `otel`); a message
        // that already carries a context (a replay, a relayed outbox row) keeps it.
        if !span.is_disabled()
            && message.headers().get(headers::TRACEPARENT).is_none()
            && let Some(tp) = crate::telemetry::traceparent_of(&span)
        {
            message.headers_mut().insert(headers::TRACEPARENT, tp);
        }
        let started = Instant::now();
        let result = self
            .inner
            .publish(destination, message)
            .instrument(span.clone())
            .await;
        metrics.duration.record(started.elapsed().as_secs_f64());
        match &result {
            Ok(()) => metrics.published.increment(1),
            Err(e) => {
                span.record("error.type", e.kind());
                metrics.failed(e)
            }
        }
        result
    }

    async fn subscribe(
        &self,
        subscription: &Subscription,
    ) -> Result<Box<dyn Receiver>, BrokerError> {
        self.inner.subscribe(subscription).await
    }

    async fn dead_letters(
        &self,
        subscription: &Subscription,
    ) -> Result<Box<dyn DeadLetters>, BrokerError> {
        self.inner.dead_letters(subscription).await
    }

    async fn ping(&self) -> Result<(), BrokerError> {
        self.inner.ping().await
    }

    async fn backlog(&self, subscription: &Subscription) -> Result<Backlog, BrokerError> {
        self.inner.backlog(subscription).await
    }

    async fn plan(
        &self,
        subscription: &Subscription,
    ) -> Result<crate::topology::Plan, BrokerError> {
        self.inner.plan(subscription).await
    }

    async fn inspect(
        &self,
        subscription: &Subscription,
        plan: &crate::topology::Plan,
    ) -> Result<crate::topology::LiveTopology, BrokerError> {
        self.inner.inspect(subscription, plan).await
    }

    async fn permissions(
        &self,
        access: &crate::permissions::Access,
    ) -> Result<crate::permissions::Permissions, BrokerError> {
        self.inner.permissions(access).await
    }

    async fn send_to_consumer(
        &self,
        subscription: &Subscription,
        message: Message,
    ) -> Result<(), BrokerError> {
        self.inner.send_to_consumer(subscription, message).await
    }
}

#[cfg(test)]
mod tests {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};

    use super::*;

    /// A broker that confirms `ok` topics and refuses the rest as unroutable.
    struct Topics;

    #[async_trait]
    impl Broker for Topics {
        fn kind(&self) -> &'static str {
            "test"
        }
        fn capabilities(&self) -> Capabilities {
            Capabilities::default()
        }
        async fn publish(&self, d: &Destination, _: Message) -> Result<(), BrokerError> {
            if d.topic == "ok" {
                Ok(())
            } else {
                Err(BrokerError::Unroutable(d.topic.clone()))
            }
        }
        async fn subscribe(&self, _: &Subscription) -> Result<Box<dyn Receiver>, BrokerError> {
            Err(BrokerError::Closed)
        }
        async fn dead_letters(
            &self,
            _: &Subscription,
        ) -> Result<Box<dyn DeadLetters>, BrokerError> {
            Err(BrokerError::Closed)
        }
        async fn ping(&self) -> Result<(), BrokerError> {
            Err(BrokerError::Closed)
        }
        async fn backlog(&self, _: &Subscription) -> Result<Backlog, BrokerError> {
            Err(BrokerError::Closed)
        }

        async fn plan(&self, _: &Subscription) -> Result<crate::topology::Plan, BrokerError> {
            Err(BrokerError::Closed)
        }

        async fn inspect(
            &self,
            _: &Subscription,
            _: &crate::topology::Plan,
        ) -> Result<crate::topology::LiveTopology, BrokerError> {
            Err(BrokerError::Closed)
        }
    }

    #[test]
    fn publishes_are_counted_timed_and_failures_labelled_by_kind() {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        metrics::with_local_recorder(&recorder, || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .build()
                .expect("runtime");
            rt.block_on(async {
                let broker = MeteredBroker::new(Arc::new(Topics));
                for _ in 0..3 {
                    broker
                        .publish(&Destination::new("ok"), Message::new("x"))
                        .await
                        .expect("ok");
                }
                assert!(
                    broker
                        .publish(&Destination::new("gone"), Message::new("x"))
                        .await
                        .is_err()
                );
            });
        });
        let mut published = HashMap::new();
        let mut failures = HashMap::new();
        let mut timed = 0;
        for (key, _, _, value) in snapshotter.snapshot().into_vec() {
            let labels: HashMap<String, String> = key
                .key()
                .labels()
                .map(|l| (l.key().to_owned(), l.value().to_owned()))
                .collect();
            match (key.key().name(), value) {
                (PUBLISHED, DebugValue::Counter(n)) => {
                    published.insert(labels["destination"].clone(), n);
                }
                (PUBLISH_FAILURES, DebugValue::Counter(n)) => {
                    failures.insert((labels["destination"].clone(), labels["kind"].clone()), n);
                }
                (PUBLISH_DURATION, DebugValue::Histogram(v)) => timed += v.len(),
                _ => {}
            }
        }
        assert_eq!(published.get("ok"), Some(&3));
        assert_eq!(published.get("gone").copied().unwrap_or(0), 0);
        assert_eq!(
            failures.get(&("gone".to_owned(), "unroutable".to_owned())),
            Some(&1)
        );
        assert_eq!(timed, 4, "every publish is timed, failures too");
    }
}
