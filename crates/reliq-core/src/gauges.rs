use crate::sync::lock;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use metrics::{counter, gauge};
use tokio_util::sync::CancellationToken;

use crate::backlog::Backlog;
use crate::broker::Broker;
use crate::dead_letters::{DeadLetterCount, DeadLetters};
use crate::error::BrokerError;
use crate::subscription::Subscription;
use crate::telemetry::{
    BACKLOG, BACKLOG_LAST_POLL, BACKLOG_POLL_FAILURES, DLQ_MESSAGES, DLQ_OLDEST_AGE, RETRY_WAITING,
    UNSETTLED,
};

/// The poller. Cheap per poll: one [`Broker::backlog`] and one [`DeadLetters::count`]
/// per consumer (each DLQ reader is opened once and kept).
///
/// [`BacklogGauges`]: a poller that reads what waits at the broker for some consumers
/// ([`Broker::backlog`], [`DeadLetters::count`]) and sets reliq's broker-side gauges
/// (`reliq_consumer_backlog_messages`, `reliq_retry_waiting_messages`, `reliq_dlq_messages`,
/// `reliq_dlq_oldest_age_seconds`, …; see [`metrics`](crate::metrics)).
///
/// The numbers come from the broker, so they are right even when every consumer process
/// is down — which is when an alert on them matters. A poll that fails leaves the gauges
/// at their last value, counts `reliq_backlog_poll_failures_total`, and does not move
/// `reliq_backlog_last_poll_timestamp_seconds` (alert on its age).
pub struct BacklogGauges {
    broker: Arc<dyn Broker>,
    consumers: Vec<Watched>,
    interval: Duration,
    /// How often the topology is checked (`reliq_topology_drift`); `None`: never.
    topology_every: Option<Duration>,
}

struct Watched {
    sub: Subscription,
    dlq: tokio::sync::Mutex<Option<Box<dyn DeadLetters>>>,
    /// Registered up front, so a scrape shows 0 before the first failure (an alert on
    /// its rate needs the series to exist).
    poll_failures: metrics::Counter,
    /// When the topology was last checked.
    topology_checked: std::sync::Mutex<Option<tokio::time::Instant>>,
}

impl std::fmt::Debug for BacklogGauges {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BacklogGauges")
            .field("consumers", &self.consumers.len())
            .field("interval", &self.interval)
            .finish_non_exhaustive()
    }
}

/// The `tier` label of a retry tier: its delay in whole seconds (`30s`), or in
/// milliseconds when it has a fraction (`1500ms`).
pub fn tier_label(delay: Duration) -> String {
    if delay.subsec_millis() == 0 {
        format!("{}s", delay.as_secs())
    } else {
        format!("{}ms", delay.as_millis())
    }
}

impl BacklogGauges {
    /// Watch `consumers` (each as its consumer subscribes: the retry tiers name Kafka's
    /// and RabbitMQ's tier routes) on `broker`, every 15 s.
    pub fn new(broker: Arc<dyn Broker>, consumers: impl IntoIterator<Item = Subscription>) -> Self {
        crate::telemetry::describe_metrics();
        Self {
            broker,
            consumers: consumers
                .into_iter()
                .map(|sub| Watched {
                    poll_failures: counter!(BACKLOG_POLL_FAILURES,
                        "consumer" => sub.consumer.clone(), "source" => sub.source.clone()),
                    sub,
                    dlq: tokio::sync::Mutex::new(None),
                    topology_checked: std::sync::Mutex::new(None),
                })
                .collect(),
            interval: Duration::from_secs(15),
            topology_every: None,
        }
    }

    /// Poll every `interval` instead (also each read's time limit).
    pub fn every(mut self, interval: Duration) -> Self {
        self.interval = interval;
        self
    }

    /// Also check each consumer's topology against its plan
    /// ([`Broker::check_topology`]) at the first poll and then every `every`, and set
    /// `reliq_topology_drift` (a check that fails is logged and tried at the next poll).
    pub fn check_topology_every(mut self, every: Duration) -> Self {
        self.topology_every = Some(every);
        self
    }

    /// Read every consumer once and set its gauges; the consumers that could not be read,
    /// with why.
    pub async fn poll(&self) -> Vec<(String, BrokerError)> {
        let mut failed = Vec::new();
        for w in &self.consumers {
            let read = tokio::time::timeout(self.interval, self.read(w)).await;
            let labels = [
                ("consumer", w.sub.consumer.clone()),
                ("source", w.sub.source.clone()),
            ];
            self.check_topology_if_due(w).await;
            match read.unwrap_or(Err(BrokerError::Timeout(self.interval))) {
                Ok((backlog, dlq)) => {
                    set(&labels, &backlog, dlq);
                    gauge!(BACKLOG_LAST_POLL, &labels).set(unix_seconds(SystemTime::now()));
                }
                Err(e) => {
                    w.poll_failures.increment(1);
                    tracing::warn!(consumer = %w.sub.consumer, source = %w.sub.source,
                        error = %crate::classify::ErrorChain(&e), "reading the broker's backlog failed");
                    *w.dlq.lock().await = None; // opened again next time
                    failed.push((w.sub.consumer.clone(), e));
                }
            }
        }
        failed
    }

    /// Poll every interval until `stop` is cancelled.
    pub async fn run(self, stop: CancellationToken) {
        let mut tick = tokio::time::interval(self.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tick.tick() => {}
            }
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = self.poll() => {}
            }
        }
    }

    async fn check_topology_if_due(&self, w: &Watched) {
        let Some(every) = self.topology_every else {
            return;
        };
        let now = tokio::time::Instant::now();
        let due = lock(&w.topology_checked).is_none_or(|t| now >= t + every);
        if !due {
            return;
        }
        match tokio::time::timeout(self.interval, self.broker.check_topology(&w.sub)).await {
            Ok(Ok(report)) => {
                report.record();
                *lock(&w.topology_checked) = Some(now);
            }
            Ok(Err(e)) => tracing::warn!(consumer = %w.sub.consumer, source = %w.sub.source,
                error = %crate::classify::ErrorChain(&e), "checking the topology failed"),
            Err(_) => tracing::warn!(consumer = %w.sub.consumer, source = %w.sub.source,
                "checking the topology took longer than the poll interval"),
        }
    }

    async fn read(&self, w: &Watched) -> Result<(Backlog, DeadLetterCount), BrokerError> {
        let backlog = self.broker.backlog(&w.sub).await?;
        let mut dlq = w.dlq.lock().await;
        if dlq.is_none() {
            *dlq = Some(self.broker.dead_letters(&w.sub).await?);
        }
        let count = match dlq.as_ref() {
            Some(reader) => reader.count().await?,
            None => DeadLetterCount::default(),
        };
        Ok((backlog, count))
    }
}

fn set(labels: &[(&'static str, String); 2], backlog: &Backlog, dlq: DeadLetterCount) {
    gauge!(BACKLOG, labels).set(backlog.waiting as f64);
    if let Some(n) = backlog.in_flight {
        gauge!(UNSETTLED, labels).set(n as f64);
    }
    let with_tier = |tier: String| {
        let mut l = labels.to_vec();
        l.push(("tier", tier));
        l
    };
    if backlog.retry_tiers.is_empty() {
        if let Some(n) = backlog.retries {
            gauge!(RETRY_WAITING, &with_tier("in_place".into())).set(n as f64);
        }
    } else {
        for t in &backlog.retry_tiers {
            gauge!(RETRY_WAITING, &with_tier(tier_label(t.delay))).set(t.waiting as f64);
        }
    }
    gauge!(DLQ_MESSAGES, labels).set(dlq.count as f64);
    let age = dlq
        .oldest_dead_lettered_at
        .and_then(|t| SystemTime::now().duration_since(t).ok())
        .map_or(0.0, |d| d.as_secs_f64());
    gauge!(DLQ_OLDEST_AGE, labels).set(age);
}

fn unix_seconds(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}
