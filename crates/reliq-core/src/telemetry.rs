//! Per-consumer metric handles, the spans' names and attributes, the W3C `traceparent`
//! parser, and the clock the runtime reads; the names themselves are listed (and
//! re-exported) in [`crate::metrics`].

use std::time::{Duration, SystemTime};

use metrics::{Counter, Gauge, Histogram, Unit, counter, gauge, histogram};

use crate::classify::ErrorClass;
use crate::headers::DeadLetterReason;

/// `reliq_messages_received_total`
pub const RECEIVED: &str = "reliq_messages_received_total";
/// `reliq_messages_processed_total`
pub const PROCESSED: &str = "reliq_messages_processed_total";
/// `reliq_messages_retried_total`
pub const RETRIED: &str = "reliq_messages_retried_total";
/// `reliq_messages_dead_lettered_total`
pub const DEAD_LETTERED: &str = "reliq_messages_dead_lettered_total";
/// `reliq_messages_discarded_total`
pub const DISCARDED: &str = "reliq_messages_discarded_total";
/// `reliq_messages_duplicate_total`
pub const DUPLICATES: &str = "reliq_messages_duplicate_total";
/// `reliq_handler_duration_seconds`
pub const HANDLER_DURATION: &str = "reliq_handler_duration_seconds";
/// `reliq_batch_size`
pub const BATCH_SIZE: &str = "reliq_batch_size";
/// `reliq_in_flight`
pub const IN_FLIGHT: &str = "reliq_in_flight";
/// `reliq_settle_failures_total`
pub const SETTLE_FAILURES: &str = "reliq_settle_failures_total";
/// `reliq_messages_replayed_total`
pub const REPLAYED: &str = "reliq_messages_replayed_total";

/// `reliq_outbox_published_total`
pub const OUTBOX_PUBLISHED: &str = "reliq_outbox_published_total";
/// `reliq_outbox_publish_failures_total`
pub const OUTBOX_PUBLISH_FAILURES: &str = "reliq_outbox_publish_failures_total";
/// `reliq_outbox_store_failures_total`
pub const OUTBOX_STORE_FAILURES: &str = "reliq_outbox_store_failures_total";
/// `reliq_outbox_backlog_rows`
pub const OUTBOX_BACKLOG: &str = "reliq_outbox_backlog_rows";
/// `reliq_outbox_oldest_age_seconds`
pub const OUTBOX_OLDEST_AGE: &str = "reliq_outbox_oldest_age_seconds";

/// The version of OpenTelemetry's semantic conventions the spans follow (messaging:
/// status "development").
pub const SEMCONV_VERSION: &str = "1.37.0";

/// `messaging.system` for a backend ([`Broker::kind`](crate::broker::Broker::kind)): the
/// conventions' values where they have one (`kafka`, `rabbitmq`, `aws_sqs`), reliq's own
/// otherwise (`nats`, `reliq_memory`, and the kind itself for other backends).
pub fn messaging_system(kind: &'static str) -> &'static str {
    match kind {
        "rabbit" => "rabbitmq",
        "sqs" => "aws_sqs",
        "memory" => "reliq_memory",
        other => other,
    }
}

/// The span names and constant attributes of one consumer, made once (no formatting per
/// message).
#[derive(Debug)]
pub(crate) struct SpanNames {
    pub process: Box<str>,
    pub settle: Box<str>,
    pub source: Box<str>,
    pub system: &'static str,
}

impl SpanNames {
    pub fn new(kind: &'static str, source: &str) -> Self {
        Self {
            process: format!("process {source}").into(),
            settle: format!("settle {source}").into(),
            source: source.into(),
            system: messaging_system(kind),
        }
    }
}

/// The remote span context a `traceparent` names (feature `otel`).
#[cfg(feature = "otel")]
fn remote_context(tp: &TraceParent<'_>) -> Option<opentelemetry::trace::SpanContext> {
    use opentelemetry::trace::{SpanContext, SpanId, TraceFlags, TraceId, TraceState};
    let flags = u8::from_str_radix(tp.flags, 16).ok()?;
    Some(SpanContext::new(
        TraceId::from_hex(tp.trace_id).ok()?,
        SpanId::from_hex(tp.parent_id).ok()?,
        TraceFlags::new(flags),
        true,
        TraceState::default(),
    ))
}

/// Make `span` a child of the context in `traceparent` (feature `otel`; without it,
/// nothing: the ids are still recorded as fields by the caller).
pub(crate) fn continue_trace(span: &tracing::Span, traceparent: &TraceParent<'_>) {
    #[cfg(feature = "otel")]
    if let Some(remote) = remote_context(traceparent) {
        use opentelemetry::trace::TraceContextExt as _;
        use tracing_opentelemetry::OpenTelemetrySpanExt as _;
        let _ = span.set_parent(opentelemetry::Context::new().with_remote_span_context(remote));
    }
    #[cfg(not(feature = "otel"))]
    let _ = (span, traceparent);
}

/// Link `span` to the creation context of each delivery that has a `traceparent` (a
/// batch's process span: many messages, many parents).
#[cfg(feature = "otel")]
pub(crate) fn link_traces(span: &tracing::Span, deliveries: &[crate::delivery::Delivery]) {
    use tracing_opentelemetry::OpenTelemetrySpanExt as _;
    for remote in deliveries
        .iter()
        .filter_map(|d| d.traceparent().and_then(TraceParent::parse))
        .filter_map(|tp| remote_context(&tp))
    {
        span.add_link(remote);
    }
}

/// The W3C `traceparent` of `span`'s OpenTelemetry context, if it has one (feature
/// `otel`): what a publish inside it writes on the message.
pub(crate) fn traceparent_of(span: &tracing::Span) -> Option<String> {
    #[cfg(feature = "otel")]
    {
        use opentelemetry::trace::TraceContextExt as _;
        use tracing_opentelemetry::OpenTelemetrySpanExt as _;
        let cx = span.context();
        let sc = cx.span().span_context().clone();
        if sc.is_valid() {
            return Some(format!(
                "00-{}-{}-{:02x}",
                sc.trace_id(),
                sc.span_id(),
                sc.trace_flags().to_u8()
            ));
        }
    }
    #[cfg(not(feature = "otel"))]
    let _ = span;
    None
}

/// `reliq_messages_published_total`
pub const PUBLISHED: &str = "reliq_messages_published_total";
/// `reliq_publish_failures_total`
pub const PUBLISH_FAILURES: &str = "reliq_publish_failures_total";
/// `reliq_publish_duration_seconds`
pub const PUBLISH_DURATION: &str = "reliq_publish_duration_seconds";
/// `reliq_producer_buffer_ratio`
pub const PRODUCER_BUFFER_RATIO: &str = "reliq_producer_buffer_ratio";

/// `reliq_consumer_backlog_messages`
pub const BACKLOG: &str = "reliq_consumer_backlog_messages";
/// `reliq_consumer_unsettled_messages`
pub const UNSETTLED: &str = "reliq_consumer_unsettled_messages";
/// `reliq_retry_waiting_messages`
pub const RETRY_WAITING: &str = "reliq_retry_waiting_messages";
/// `reliq_dlq_messages`
pub const DLQ_MESSAGES: &str = "reliq_dlq_messages";
/// `reliq_dlq_oldest_age_seconds`
pub const DLQ_OLDEST_AGE: &str = "reliq_dlq_oldest_age_seconds";
/// `reliq_backlog_last_poll_timestamp_seconds`
pub const BACKLOG_LAST_POLL: &str = "reliq_backlog_last_poll_timestamp_seconds";
/// `reliq_backlog_poll_failures_total`
pub const BACKLOG_POLL_FAILURES: &str = "reliq_backlog_poll_failures_total";
/// `reliq_topology_drift`
pub const TOPOLOGY_DRIFT: &str = "reliq_topology_drift";
/// `reliq_circuit_state`
pub const CIRCUIT_STATE: &str = "reliq_circuit_state";
/// `reliq_circuit_transitions_total`
pub const CIRCUIT_TRANSITIONS: &str = "reliq_circuit_transitions_total";

/// Histogram buckets for reliq's `*_seconds` histograms (handler and publish durations):
/// 1 ms to 60 s, so `histogram_quantile(0.99, …)` is meaningful in alert rules. Give them
/// to the exporter (`PrometheusBuilder::set_buckets_for_metric(Matcher::Suffix("_seconds".into()), DURATION_BUCKETS)`).
pub const DURATION_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// Histogram buckets for `reliq_batch_size`.
pub const BATCH_SIZE_BUCKETS: &[f64] = &[1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0];

/// Every metric name reliq records (the alert rules and the dashboard may use only
/// these; a test checks them against a scrape).
pub const ALL_METRICS: &[&str] = &[
    RECEIVED,
    PROCESSED,
    RETRIED,
    DEAD_LETTERED,
    DISCARDED,
    DUPLICATES,
    HANDLER_DURATION,
    BATCH_SIZE,
    IN_FLIGHT,
    SETTLE_FAILURES,
    REPLAYED,
    OUTBOX_PUBLISHED,
    OUTBOX_PUBLISH_FAILURES,
    OUTBOX_STORE_FAILURES,
    OUTBOX_BACKLOG,
    OUTBOX_OLDEST_AGE,
    PUBLISHED,
    PUBLISH_FAILURES,
    PUBLISH_DURATION,
    PRODUCER_BUFFER_RATIO,
    BACKLOG,
    UNSETTLED,
    RETRY_WAITING,
    DLQ_MESSAGES,
    DLQ_OLDEST_AGE,
    BACKLOG_LAST_POLL,
    BACKLOG_POLL_FAILURES,
    TOPOLOGY_DRIFT,
    CIRCUIT_STATE,
    CIRCUIT_TRANSITIONS,
];

/// The kind of one of reliq's metrics, for [`describe_metrics`].
#[derive(Clone, Copy)]
enum Kind {
    Counter,
    Gauge,
    Histogram,
}

/// Every metric's kind, unit and help text (what a scrape shows in `# HELP`): one row
/// per name of [`ALL_METRICS`] (a test checks that).
const DESCRIPTIONS: &[(&str, Kind, Unit, &str)] = &[
    (
        RECEIVED,
        Kind::Counter,
        Unit::Count,
        "Deliveries the consumer received from the broker.",
    ),
    (
        PROCESSED,
        Kind::Counter,
        Unit::Count,
        "Deliveries the handler handled and the consumer acknowledged.",
    ),
    (
        RETRIED,
        Kind::Counter,
        Unit::Count,
        "Deliveries sent to a retry (by the failure class that caused it).",
    ),
    (
        DEAD_LETTERED,
        Kind::Counter,
        Unit::Count,
        "Deliveries moved to the dead-letter queue (by reason), each after the DLQ copy was confirmed.",
    ),
    (
        DISCARDED,
        Kind::Counter,
        Unit::Count,
        "Deliveries dropped on purpose by the retry policy's final route (by reason).",
    ),
    (
        DUPLICATES,
        Kind::Counter,
        Unit::Count,
        "Deliveries the inbox recognised as already handled and acknowledged without calling the handler.",
    ),
    (
        HANDLER_DURATION,
        Kind::Histogram,
        Unit::Seconds,
        "Time of one handler call (per message, or per batch with a batch handler).",
    ),
    (
        BATCH_SIZE,
        Kind::Histogram,
        Unit::Count,
        "Deliveries per batch-handler call.",
    ),
    (
        IN_FLIGHT,
        Kind::Gauge,
        Unit::Count,
        "Deliveries received and not yet settled.",
    ),
    (
        SETTLE_FAILURES,
        Kind::Counter,
        Unit::Count,
        "Settlements the broker refused or did not confirm (by operation: ack, retry, dead_letter, release); the delivery is held and settled again.",
    ),
    (
        REPLAYED,
        Kind::Counter,
        Unit::Count,
        "Dead letters replayed to their consumer and removed from the DLQ.",
    ),
    (
        OUTBOX_PUBLISHED,
        Kind::Counter,
        Unit::Count,
        "Outbox rows the relay published and marked sent.",
    ),
    (
        OUTBOX_PUBLISH_FAILURES,
        Kind::Counter,
        Unit::Count,
        "Outbox publishes the broker refused or did not confirm (the row is tried again).",
    ),
    (
        OUTBOX_STORE_FAILURES,
        Kind::Counter,
        Unit::Count,
        "Outbox store calls (claim, mark sent) that failed.",
    ),
    (
        OUTBOX_BACKLOG,
        Kind::Gauge,
        Unit::Count,
        "Outbox rows not yet sent, read from the store every 5 s.",
    ),
    (
        OUTBOX_OLDEST_AGE,
        Kind::Gauge,
        Unit::Seconds,
        "Age of the oldest unsent outbox row.",
    ),
    (
        PUBLISHED,
        Kind::Counter,
        Unit::Count,
        "Messages published and confirmed by the broker.",
    ),
    (
        PUBLISH_FAILURES,
        Kind::Counter,
        Unit::Count,
        "Publishes that failed (by kind of broker error).",
    ),
    (
        PUBLISH_DURATION,
        Kind::Histogram,
        Unit::Seconds,
        "Time from publish to the broker's confirm, failures included.",
    ),
    (
        PRODUCER_BUFFER_RATIO,
        Kind::Gauge,
        Unit::Count,
        "Share of the Kafka producer's queue.buffering.max.messages in use after a publish (0 to 1).",
    ),
    (
        BACKLOG,
        Kind::Gauge,
        Unit::Count,
        "Messages waiting at the broker for the consumer (Kafka: its lag).",
    ),
    (
        UNSETTLED,
        Kind::Gauge,
        Unit::Count,
        "Messages delivered to the consumer and not yet settled, where the broker says.",
    ),
    (
        RETRY_WAITING,
        Kind::Gauge,
        Unit::Count,
        "Retries waiting at the broker (by tier).",
    ),
    (
        DLQ_MESSAGES,
        Kind::Gauge,
        Unit::Count,
        "Messages in the consumer's dead-letter queue.",
    ),
    (
        DLQ_OLDEST_AGE,
        Kind::Gauge,
        Unit::Seconds,
        "Age of the oldest dead letter (0 when the DLQ is empty).",
    ),
    (
        BACKLOG_LAST_POLL,
        Kind::Gauge,
        Unit::Seconds,
        "Unix time of the last backlog poll that read everything (a stale one means the gauges are old).",
    ),
    (
        BACKLOG_POLL_FAILURES,
        Kind::Counter,
        Unit::Count,
        "Backlog polls that could not read the broker.",
    ),
    (
        TOPOLOGY_DRIFT,
        Kind::Gauge,
        Unit::Count,
        "Differences between the consumer's planned topology and the broker's (by severity).",
    ),
    (
        CIRCUIT_STATE,
        Kind::Gauge,
        Unit::Count,
        "A circuit breaker's state: 0 closed, 1 half-open, 2 open.",
    ),
    (
        CIRCUIT_TRANSITIONS,
        Kind::Counter,
        Unit::Count,
        "A circuit breaker's state changes (by the state entered).",
    ),
];

/// Gives every metric of [`ALL_METRICS`] its help text and unit in the installed
/// recorder (what a Prometheus scrape shows as `# HELP`). The consumer, the outbox relay,
/// a [`MeteredBroker`](crate::metered::MeteredBroker) and the backlog poller call it when
/// they start; an application that installs its recorder later calls it after that.
pub fn describe_metrics() {
    for &(name, kind, unit, help) in DESCRIPTIONS {
        match kind {
            Kind::Counter => metrics::describe_counter!(name, unit, help),
            Kind::Gauge => metrics::describe_gauge!(name, unit, help),
            Kind::Histogram => metrics::describe_histogram!(name, unit, help),
        }
    }
}

/// A settlement operation, for `reliq_settle_failures_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SettleOp {
    /// ack
    Ack = 0,
    /// retry
    Retry = 1,
    /// dead_letter
    DeadLetter = 2,
    /// release
    Release = 3,
}

impl SettleOp {
    const NAMES: [&'static str; 4] = ["ack", "retry", "dead_letter", "release"];
    /// The label value.
    pub fn as_str(self) -> &'static str {
        Self::NAMES[self as usize]
    }
}

/// Metric handles registered once per consumer, so the per-message path does no label
/// allocation or registry lookup.
#[derive(Clone)]
pub(crate) struct ConsumerMetrics {
    pub received: Counter,
    pub processed: Counter,
    pub retried: [Counter; 5],
    pub dead_lettered: [Counter; 6],
    pub discarded: [Counter; 6],
    pub duplicates: Counter,
    pub handler_duration: Histogram,
    pub batch_size: Histogram,
    pub in_flight: Gauge,
    pub settle_failures: [Counter; 4],
}

impl ConsumerMetrics {
    pub fn new(consumer: &str) -> Self {
        describe_metrics();
        let c = consumer.to_owned();
        Self {
            received: counter!(RECEIVED, "consumer" => c.clone()),
            processed: counter!(PROCESSED, "consumer" => c.clone()),
            retried: ErrorClass::ALL
                .map(|k| counter!(RETRIED, "consumer" => c.clone(), "class" => k.as_str())),
            dead_lettered: DeadLetterReason::ALL
                .map(|r| counter!(DEAD_LETTERED, "consumer" => c.clone(), "reason" => r.as_str())),
            discarded: DeadLetterReason::ALL
                .map(|r| counter!(DISCARDED, "consumer" => c.clone(), "reason" => r.as_str())),
            duplicates: counter!(DUPLICATES, "consumer" => c.clone()),
            handler_duration: histogram!(HANDLER_DURATION, "consumer" => c.clone()),
            batch_size: histogram!(BATCH_SIZE, "consumer" => c.clone()),
            in_flight: gauge!(IN_FLIGHT, "consumer" => c.clone()),
            settle_failures: SettleOp::NAMES
                .map(|op| counter!(SETTLE_FAILURES, "consumer" => c.clone(), "operation" => op)),
        }
    }

    pub fn retried(&self, class: ErrorClass) -> &Counter {
        &self.retried[ErrorClass::ALL
            .iter()
            .position(|c| *c == class)
            .unwrap_or(0)]
    }

    pub fn dead_lettered(&self, reason: DeadLetterReason) -> &Counter {
        &self.dead_lettered[reason_index(reason)]
    }

    pub fn discarded(&self, reason: DeadLetterReason) -> &Counter {
        &self.discarded[reason_index(reason)]
    }
}

/// Metric handles of one outbox relay.
pub(crate) struct RelayMetrics {
    pub published: Counter,
    pub publish_failures: Counter,
    pub store_failures: Counter,
    pub backlog_rows: Gauge,
    pub oldest_age: Gauge,
}

impl RelayMetrics {
    pub fn new(relay: &str) -> Self {
        describe_metrics();
        let r = relay.to_owned();
        Self {
            published: counter!(OUTBOX_PUBLISHED, "relay" => r.clone()),
            publish_failures: counter!(OUTBOX_PUBLISH_FAILURES, "relay" => r.clone()),
            store_failures: counter!(OUTBOX_STORE_FAILURES, "relay" => r.clone()),
            backlog_rows: gauge!(OUTBOX_BACKLOG, "relay" => r.clone()),
            oldest_age: gauge!(OUTBOX_OLDEST_AGE, "relay" => r),
        }
    }
}

fn reason_index(reason: DeadLetterReason) -> usize {
    DeadLetterReason::ALL
        .iter()
        .position(|r| *r == reason)
        .unwrap_or(0)
}

/// The parts of a W3C `traceparent` header (`00-<trace id>-<parent id>-<flags>`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct TraceParent<'a> {
    /// 32 hex digits.
    pub trace_id: &'a str,
    /// 16 hex digits.
    pub parent_id: &'a str,
    /// 2 hex digits.
    pub flags: &'a str,
}

impl<'a> TraceParent<'a> {
    /// Parse a `traceparent` value; `None` when it is malformed (never an error: a bad
    /// trace header must not make a message poison).
    pub fn parse(value: &'a str) -> Option<Self> {
        let mut parts = value.trim().split('-');
        let version = parts.next()?;
        let trace_id = parts.next()?;
        let parent_id = parts.next()?;
        let flags = parts.next()?;
        let hex = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit());
        if !(hex(version, 2)
            && version != "ff"
            && hex(trace_id, 32)
            && hex(parent_id, 16)
            && hex(flags, 2))
            || trace_id.bytes().all(|b| b == b'0')
            || parent_id.bytes().all(|b| b == b'0')
        {
            return None;
        }
        Some(Self {
            trace_id,
            parent_id,
            flags,
        })
    }
}

/// Wall-clock time that follows tokio's clock: `SystemTime` at creation plus the tokio
/// time elapsed since. In production this is the wall clock; under
/// `tokio::time::pause()` it advances with virtual time, so age-based policies (max age)
/// are testable in milliseconds.
#[derive(Clone, Copy, Debug)]
pub struct Clock {
    wall: SystemTime,
    mono: tokio::time::Instant,
}

impl Clock {
    /// Anchor a clock now (inside a tokio runtime).
    pub fn new() -> Self {
        Self {
            wall: SystemTime::now(),
            mono: tokio::time::Instant::now(),
        }
    }

    /// The current time.
    pub fn now(&self) -> SystemTime {
        self.wall + self.mono.elapsed()
    }

    /// Time elapsed since `earlier` (zero if `earlier` is in the future).
    pub fn since(&self, earlier: SystemTime) -> Duration {
        self.now().duration_since(earlier).unwrap_or_default()
    }
}

impl Default for Clock {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_metric_has_help_text_once() {
        let described: Vec<&str> = DESCRIPTIONS.iter().map(|d| d.0).collect();
        for name in ALL_METRICS {
            assert_eq!(described.iter().filter(|d| *d == name).count(), 1, "{name}");
        }
        assert_eq!(described.len(), ALL_METRICS.len());
        assert!(DESCRIPTIONS.iter().all(|d| d.3.ends_with('.')));
    }

    #[test]
    fn traceparent_parses_valid_and_rejects_bad() {
        let tp =
            TraceParent::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").unwrap();
        assert_eq!(tp.trace_id, "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(tp.parent_id, "00f067aa0ba902b7");
        assert!(
            TraceParent::parse("00-00000000000000000000000000000000-00f067aa0ba902b7-01").is_none()
        );
        assert!(TraceParent::parse("garbage").is_none());
        assert!(TraceParent::parse("00-4bf92f35-00f067aa0ba902b7-01").is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn clock_follows_virtual_time() {
        let clock = Clock::new();
        let t0 = clock.now();
        tokio::time::sleep(Duration::from_secs(3600)).await;
        let elapsed = clock.since(t0);
        assert!(elapsed >= Duration::from_secs(3600) && elapsed < Duration::from_secs(3601));
    }
}
