//! What scenarios are built from: the [`Backend`] factory, a per-test [`Ctx`], a
//! [`Recorder`] of handler calls, and condition waits with deadlines.

use reliq_core::{
    Broker, Consumer, ConsumerBuilder, Cursor, DeadLetter, DeadLetterEntry, DeadLetters, Delivery,
    Destination, Message, MessageId, RetryPolicy, Subscription, Transient, seam::lock,
};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context as _, bail, ensure};
use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

/// A backend under test: a connection factory plus fault hooks.
#[async_trait]
pub trait Backend: Send + Sync + 'static {
    /// `memory`, `kafka`, `rabbit`, `nats` or `sqs`.
    fn name(&self) -> &'static str;

    /// Get ready for a test on the source `topic`, before its first connection (a
    /// backend whose credentials are fixed at sign-in issues them here). Default: nothing.
    async fn prepare(&self, topic: &str) -> anyhow::Result<()> {
        let _ = topic;
        Ok(())
    }

    /// A connection (a new one per call where the backend has connections).
    async fn connect(&self) -> anyhow::Result<Arc<dyn Broker>>;

    /// The schema registry (Confluent-compatible API) the typed scenarios register with:
    /// the real server the project's script runs (`RELIQ_SCHEMA_REGISTRY_URL`).
    fn schema_registry(&self) -> String;

    /// Two short retry delay tiers: long enough to measure on this backend's clock,
    /// short enough for CI.
    fn tiers(&self) -> [Duration; 2];

    /// How late a delayed retry may arrive and still count as on time.
    fn tolerance(&self) -> Duration;

    /// How long to wait for "nothing more arrives".
    fn quiet_period(&self) -> Duration;

    /// The lease (ack wait / visibility timeout) crash scenarios use: how long a crashed
    /// consumer's deliveries stay invisible on brokers that only notice a crash by the
    /// lease running out (NATS, SQS). Brokers that notice a dropped connection (memory,
    /// RabbitMQ, Kafka) keep the 30 s default.
    fn crash_lease(&self) -> Duration {
        Duration::from_secs(30)
    }

    /// How many messages the backpressure scenario queues (10,000). A backend whose local
    /// test endpoint cannot take that many in reasonable time (the single-process SQS
    /// emulator) may queue fewer; the bound asserted (held ≤ prefetch) is the same.
    fn backpressure_backlog(&self) -> u32 {
        10_000
    }

    /// How many messages the failure-burst scenario fails at once: more than the prefetch
    /// plus any retry headroom a backend keeps (1,100). A backend whose local test
    /// endpoint cannot take that many in reasonable time may use fewer, as long as it
    /// keeps no in-flight window that many waiting retries could fill.
    fn failure_burst(&self) -> usize {
        1_100
    }

    /// Create the source destination `topic` so publishes to it are routable even before
    /// a consumer subscribed (a no-op where subscribing declares everything).
    async fn declare_source(&self, broker: &Arc<dyn Broker>, topic: &str) -> anyhow::Result<()>;

    /// Make the consumer's dead-letter queue unavailable (or available again).
    async fn set_dead_letter_available(
        &self,
        broker: &Arc<dyn Broker>,
        sub: &Subscription,
        available: bool,
    ) -> anyhow::Result<()>;

    /// Break (or repair) the consumer's retry route.
    async fn set_retry_available(
        &self,
        broker: &Arc<dyn Broker>,
        sub: &Subscription,
        available: bool,
    ) -> anyhow::Result<()>;

    /// Unsettled deliveries the broker has handed to this consumer right now, where the
    /// backend can tell (`None` otherwise).
    async fn unsettled(&self, broker: &Arc<dyn Broker>, sub: &Subscription) -> Option<usize>;

    /// The names of the broker's objects — topics, streams and their consumers, queues,
    /// exchanges — that contain `fragment` (a test's unique source name), sorted, read
    /// with the broker's own listing (not through reliq): what the read-only scenarios
    /// compare before and after a read.
    async fn objects(
        &self,
        broker: &Arc<dyn Broker>,
        fragment: &str,
    ) -> anyhow::Result<Vec<String>>;
}

static UNIQUE: AtomicU64 = AtomicU64::new(0);

/// The consumer builder every scenario starts from: `name` on `topic` with the backend's
/// short tiers ([`Ctx::consumer`]). A backend that must prepare for a consumer before it
/// starts (grant its permissions) builds the same subscription with it.
pub fn test_consumer(
    backend: &dyn Backend,
    broker: Arc<dyn Broker>,
    topic: &str,
    name: &str,
) -> ConsumerBuilder {
    let [t1, t2] = backend.tiers();
    Consumer::builder(broker, name)
        .subscribe(topic.to_owned())
        .retry(RetryPolicy::tiers([t1, t2]).max_attempts(3))
        .max_in_flight(32)
        .settle_backoff(Duration::from_millis(50), Duration::from_millis(500))
        .shutdown_timeout(Duration::from_secs(10))
}

/// Per-test context: a connection and fresh names.
pub struct Ctx<'a> {
    /// The backend.
    pub backend: &'a dyn Backend,
    /// A connection.
    pub broker: Arc<dyn Broker>,
    /// A fresh source name for this test.
    pub topic: String,
}

impl std::fmt::Debug for Ctx<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ctx")
            .field("broker", &self.broker.kind())
            .field("topic", &self.topic)
            .finish_non_exhaustive()
    }
}

impl<'a> Ctx<'a> {
    /// Connect and pick fresh names.
    pub async fn new(backend: &'a dyn Backend, test: &str) -> anyhow::Result<Self> {
        let topic = unique(test);
        backend
            .prepare(&topic)
            .await
            .context("preparing the backend")?;
        let broker = backend
            .connect()
            .await
            .context("connecting to the broker")?;
        backend.declare_source(&broker, &topic).await?;
        Ok(Self {
            backend,
            broker,
            topic,
        })
    }

    /// A consumer builder on this test's topic with the backend's short tiers.
    pub fn consumer(&self, name: &str) -> ConsumerBuilder {
        self.consumer_on(self.broker.clone(), name)
    }

    /// Same, on another connection.
    pub fn consumer_on(&self, broker: Arc<dyn Broker>, name: &str) -> ConsumerBuilder {
        test_consumer(self.backend, broker, &self.topic, name)
    }

    /// The subscription a builder made by [`Ctx::consumer`] uses.
    pub fn subscription(&self, name: &str) -> Subscription {
        self.consumer(name)
            .subscription()
            .unwrap_or_else(|_| Subscription::new(name, self.topic.clone()))
    }

    /// Publish (confirmed) to this test's topic.
    pub async fn publish(&self, message: Message) -> anyhow::Result<()> {
        self.broker
            .publish(&Destination::new(self.topic.clone()), message)
            .await
            .context("publish")
    }

    /// Publish many, a few at a time (confirmed each).
    pub async fn publish_all(&self, messages: Vec<Message>) -> anyhow::Result<()> {
        let dest = Destination::new(self.topic.clone());
        let mut iter = messages.into_iter();
        loop {
            let batch: Vec<Message> = iter.by_ref().take(64).collect();
            if batch.is_empty() {
                return Ok(());
            }
            let results =
                futures::future::join_all(batch.into_iter().map(|m| self.broker.publish(&dest, m)))
                    .await;
            for r in results {
                r.context("publish")?;
            }
        }
    }

    /// Wait up to `within` for `expected` dead letters of `consumer`, check that no more
    /// arrive within the quiet period, remove them, and return them with their decoded
    /// records. Fails if fewer arrive or if more are there.
    pub async fn take_dead_letters(
        &self,
        consumer: &str,
        expected: usize,
        within: Duration,
    ) -> anyhow::Result<Vec<(Message, DeadLetter)>> {
        let sub = self.subscription(consumer);
        let dlq = self.broker.dead_letters(&sub).await?;
        let deadline = Instant::now() + within;
        loop {
            let held = dlq.count().await.context("counting dead letters")?.count as usize;
            if held >= expected {
                break;
            }
            if Instant::now() >= deadline {
                bail!(
                    "expected {expected} dead letters for `{consumer}` within {within:?}, got {held}"
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        tokio::time::sleep(self.backend.quiet_period()).await;
        let entries = browse_all(dlq.as_ref()).await?;
        if entries.len() > expected {
            bail!(
                "{} dead letters for `{consumer}`, more than the {expected} expected (e.g. {})",
                entries.len(),
                entries[expected].id()
            );
        }
        let mut out = Vec::with_capacity(entries.len());
        for entry in &entries {
            let record = entry.record().context("decoding the dead-letter record")?;
            out.push((entry.message.clone(), record));
        }
        let ids: Vec<MessageId> = entries.iter().map(|e| e.id().clone()).collect();
        let removed = dlq.remove(&ids).await.context("removing dead letters")?;
        ensure!(
            removed.len() == ids.len(),
            "removed {} of {} dead letters",
            removed.len(),
            ids.len()
        );
        Ok(out)
    }

    /// Assert the consumer's DLQ is empty (nothing arrives within the quiet period).
    pub async fn assert_no_dead_letters(&self, consumer: &str) -> anyhow::Result<()> {
        self.take_dead_letters(consumer, 0, Duration::ZERO)
            .await
            .map(drop)
    }
}

/// A fresh name: `<base>-<pid>-<counter>-<nanos>`, valid as a topic, queue, stream and
/// consumer name on every backend.
pub fn unique(base: &str) -> String {
    let n = UNIQUE.fetch_add(1, Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let base: String = base
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .take(32)
        .collect();
    format!("{base}-{}-{n}-{nanos}", std::process::id())
}

/// The JSON payload of the scenarios' ordinary messages.
#[derive(Serialize, Deserialize)]
pub(crate) struct Order {
    pub(crate) n: u32,
}

/// A message carrying [`Order`] `n`.
pub(crate) fn order(n: u32) -> Message {
    Message::json(&Order { n }).unwrap_or_else(|_| Message::new(n.to_string()))
}

/// One handler call.
#[derive(Clone, Debug)]
pub struct Call {
    /// Message id.
    pub id: MessageId,
    /// Attempt number.
    pub attempt: u32,
    /// When the handler started.
    pub at: Instant,
    /// Key.
    pub key: Option<String>,
    /// Payload.
    pub payload: Vec<u8>,
    /// Headers.
    pub headers: Vec<(String, String)>,
}

/// A per-message handler made by a [`Recorder`].
pub trait RecordingHandler:
    Fn(Delivery) -> futures::future::BoxFuture<'static, Result<(), reliq_core::BoxError>>
    + Send
    + Sync
    + 'static
{
}

impl<F> RecordingHandler for F where
    F: Fn(Delivery) -> futures::future::BoxFuture<'static, Result<(), reliq_core::BoxError>>
        + Send
        + Sync
        + 'static
{
}

/// Records handler calls and effects, shared between a test and its handler.
#[derive(Clone, Default)]
pub struct Recorder {
    calls: Arc<Mutex<Vec<Call>>>,
    effects: Arc<Mutex<HashMap<MessageId, u32>>>,
}

impl std::fmt::Debug for Recorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recorder")
            .field(
                "calls",
                &self.calls.lock().map(|c| c.len()).unwrap_or_default(),
            )
            .field(
                "effects",
                &self.effects.lock().map(|e| e.len()).unwrap_or_default(),
            )
            .finish()
    }
}

impl Recorder {
    /// A new recorder.
    pub fn new() -> Self {
        Self::default()
    }

    /// Record a call.
    pub fn call(&self, d: &Delivery) {
        let call = Call {
            id: d.id().clone(),
            attempt: d.attempt(),
            at: Instant::now(),
            key: d.key().map(str::to_owned),
            payload: d.payload().to_vec(),
            headers: d
                .headers()
                .iter()
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect(),
        };
        lock(&self.calls).push(call);
    }

    /// Record that the business effect of `id` happened.
    pub fn effect(&self, id: &MessageId) {
        *lock(&self.effects).entry(id.clone()).or_insert(0) += 1;
    }

    /// All calls so far.
    pub fn calls(&self) -> Vec<Call> {
        lock(&self.calls).clone()
    }

    /// Calls for one id.
    pub fn calls_for(&self, id: &MessageId) -> Vec<Call> {
        self.calls().into_iter().filter(|c| &c.id == id).collect()
    }

    /// Effects per id.
    pub fn effects(&self) -> HashMap<MessageId, u32> {
        lock(&self.effects).clone()
    }

    /// A handler that records each call and its effect, and succeeds.
    pub fn succeeding(&self) -> impl RecordingHandler + use<> {
        self.failing_attempts_below(1)
    }

    /// A handler that records each call, fails each message's first attempt
    /// (transient: "fails once") and records the effect of the second.
    pub fn failing_first_attempt(&self) -> impl RecordingHandler + use<> {
        self.failing_attempts_below(2)
    }

    /// Records each call; attempts below `succeeds_at` fail (transient), the others
    /// record their effect and succeed.
    fn failing_attempts_below(&self, succeeds_at: u32) -> impl RecordingHandler + use<> {
        let rec = self.clone();
        move |d: Delivery| {
            let r = rec.clone();
            Box::pin(async move {
                r.call(&d);
                if d.attempt() < succeeds_at {
                    return Err(Transient::msg("fails once").into());
                }
                r.effect(d.id());
                Ok(())
            }) as futures::future::BoxFuture<'static, Result<(), reliq_core::BoxError>>
        }
    }

    /// A handler that records each call and fails transiently ("database unavailable")
    /// while `down` is set, and otherwise records the effect and succeeds: a downstream
    /// outage the test switches off.
    pub fn down_while(
        &self,
        down: Arc<std::sync::atomic::AtomicBool>,
    ) -> impl Fn(Delivery) -> futures::future::BoxFuture<'static, Result<(), reliq_core::BoxError>>
    + Send
    + Sync
    + 'static {
        let rec = self.clone();
        move |d: Delivery| {
            let (r, down) = (rec.clone(), down.clone());
            Box::pin(async move {
                r.call(&d);
                if down.load(std::sync::atomic::Ordering::SeqCst) {
                    return Err(reliq_core::Transient::msg("database unavailable").into());
                }
                r.effect(d.id());
                Ok(())
            })
        }
    }

    /// Number of ids with at least one effect.
    pub fn effect_count(&self) -> usize {
        lock(&self.effects).len()
    }
}

/// A generous deadline for things that should happen "soon".
pub fn soon(b: &dyn Backend) -> Duration {
    let [t1, t2] = b.tiers();
    Duration::from_secs(30) + (t1 + t2) * 3
}

/// Wait until `cond` holds, polling; fail with `what` after `within`.
pub async fn wait_until(
    what: &str,
    within: Duration,
    mut cond: impl FnMut() -> bool,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + within;
    loop {
        if cond() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            bail!("timed out after {within:?} waiting for: {what}");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Every entry of a dead-letter queue, browsed a page at a time.
pub async fn browse_all(dlq: &dyn DeadLetters) -> anyhow::Result<Vec<DeadLetterEntry>> {
    let mut cursor = Cursor::start();
    let mut all = Vec::new();
    loop {
        let page = dlq
            .browse(&cursor, 100)
            .await
            .context("browsing dead letters")?;
        let empty = page.entries.is_empty();
        all.extend(page.entries);
        if page.at_end || empty {
            return Ok(all);
        }
        cursor = page.next;
    }
}

/// The warnings and errors this process logged (through `tracing`, and through `log` from
/// client crates such as rdkafka), from the moment [`captured_log`] was first called.
pub struct CapturedLog {
    events: Arc<Mutex<Vec<String>>>,
}

impl std::fmt::Debug for CapturedLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CapturedLog")
            .field(
                "events",
                &self.events.lock().map(|e| e.len()).unwrap_or_default(),
            )
            .finish()
    }
}

impl CapturedLog {
    /// After `settle` (clients close and log on threads of their own: an absence can
    /// only be observed over a period), fail naming `what` with every WARN and ERROR
    /// event logged so far, if there is one.
    pub async fn ensure_quiet_after(&self, settle: Duration, what: &str) -> anyhow::Result<()> {
        tokio::time::sleep(settle).await;
        let lines = self.warnings();
        ensure!(
            lines.is_empty(),
            "{what} logged {} warnings or errors:\n{}",
            lines.len(),
            lines.join("\n")
        );
        Ok(())
    }

    /// Every WARN and ERROR event so far, as `LEVEL target: message`.
    pub fn warnings(&self) -> Vec<String> {
        lock(&self.events).clone()
    }
}

struct CaptureLayer {
    events: Arc<Mutex<Vec<String>>>,
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for CaptureLayer {
    fn on_event(
        &self,
        event: &tracing::Event<'_>,
        _ctx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        let level = *event.metadata().level();
        if level > tracing::Level::WARN {
            return;
        }
        struct Text(String);
        impl tracing::field::Visit for Text {
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                use std::fmt::Write as _;
                let _ = write!(self.0, " {}={value:?}", field.name());
            }
        }
        let mut text = Text(String::new());
        event.record(&mut text);
        let line = format!("{level} {}:{}", event.metadata().target(), text.0);
        lock(&self.events).push(line);
    }
}

static CAPTURE: std::sync::OnceLock<Option<Arc<Mutex<Vec<String>>>>> = std::sync::OnceLock::new();

/// Install (once per process) a global subscriber that keeps every WARN and ERROR event,
/// and return its log. Fails if another global subscriber was installed first (then
/// nothing could be seen, and a scenario reading the log would pass for nothing).
pub fn captured_log() -> anyhow::Result<CapturedLog> {
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;
    let events = CAPTURE.get_or_init(|| {
        let events = Arc::new(Mutex::new(Vec::new()));
        let layer = CaptureLayer {
            events: events.clone(),
        };
        tracing_subscriber::registry()
            .with(layer)
            .try_init()
            .ok()
            .map(|()| events)
    });
    match events {
        Some(events) => Ok(CapturedLog {
            events: events.clone(),
        }),
        None => bail!("another global tracing subscriber is installed: the log cannot be read"),
    }
}
