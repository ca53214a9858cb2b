//! Building a consumer: settings, validation, and starting the receive loop.

use super::error::ConsumerError;
use super::handle::Handling;
use super::receive::{
    DeliveryOrder, Dispatch, RECEIVE_BATCH, Shared, dispatch_batch, dispatch_each, receive_loop,
};
use super::running::{ConsumerHandle, ShutdownReport};
use super::settle::{SettleBackoff, Settler};
use super::signal::Signal;
use super::stats::Stats;
use crate::asyncapi::AsyncApi;
use crate::batch::{Batch, BatchError};
use crate::breaker::CircuitBreaker;
use crate::broker::{Broker, Receiver};
use crate::classify::{BoxError, Classifier};
use crate::codec::{Codec, MessageSchema};
use crate::delivery::Delivery;
use crate::inbox::Inbox;
use crate::retry::RetryPolicy;
use crate::subscription::Subscription;
use crate::telemetry::{Clock, ConsumerMetrics};
use crate::topology::{Severity, StartupCheck};
use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::AtomicU32;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// A consumer under construction. Start with [`Consumer::builder`].
pub struct ConsumerBuilder {
    pub(super) broker: Arc<dyn Broker>,
    pub(super) name: String,
    pub(super) source: Option<String>,
    pub(super) filter: Option<String>,
    pub(super) policy: RetryPolicy,
    pub(super) max_in_flight: u32,
    pub(super) concurrency: Option<usize>,
    pub(super) ordering: DeliveryOrder,
    pub(super) handler_timeout: Option<Duration>,
    pub(super) shutdown_timeout: Duration,
    pub(super) inbox: Option<Arc<dyn Inbox>>,
    pub(super) classifier: Classifier,
    pub(super) lease: Duration,
    pub(super) delivery_limit: Option<u32>,
    pub(super) settle_backoff: (Duration, Duration),
    pub(super) batch_size: usize,
    pub(super) rate_limit: Option<(u32, u32)>,
    pub(super) topology_check: StartupCheck,
    pub(super) schema_check: StartupCheck,
    pub(super) breaker: Option<CircuitBreaker>,
}

impl std::fmt::Debug for ConsumerBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConsumerBuilder")
            .field("broker", &self.broker.kind())
            .field("name", &self.name)
            .field("source", &self.source)
            .field("filter", &self.filter)
            .field("policy", &self.policy)
            .field("max_in_flight", &self.max_in_flight)
            .finish_non_exhaustive()
    }
}

/// Entry point of the runtime: receive (bounded) → handle (timeout, panic capture) →
/// classify → ack / retry / dead-letter, written once for every backend.
///
/// Guarantees:
/// - The source delivery is settled only after the retry or dead-letter copy was
///   confirmed by the broker. If that publish fails (the DLQ or retry route down, a node
///   lost), the delivery is *held* — still leased, its handler not called again, no
///   attempt spent — and the copy sent again after the settle back-off, until it is
///   confirmed; a hard stop releases it (the broker delivers it again later). A delivery
///   the receiver no longer holds (its channel closed, its partition revoked) is left to
///   the broker's redelivery. A message is never dropped and never just logged.
/// - At most `max_in_flight` deliveries are held (received, not yet settled); the broker
///   is asked for the same prefetch bound. At most `concurrency` handlers run at once.
/// - With [`DeliveryOrder::PerKey`], deliveries with the same key are handled one after the
///   other in arrival order, while other keys run in parallel.
/// - Shutdown stops receiving, lets in-flight work finish within `shutdown_timeout`, then
///   releases whatever is left. Nothing is lost and nothing is settled twice.
#[derive(Debug)]
pub struct Consumer;

impl Consumer {
    /// A consumer named `name` (the consumer group) on `broker`.
    pub fn builder(broker: Arc<dyn Broker>, name: impl Into<String>) -> ConsumerBuilder {
        ConsumerBuilder {
            broker,
            name: name.into(),
            source: None,
            filter: None,
            policy: RetryPolicy::default(),
            max_in_flight: 64,
            concurrency: None,
            ordering: DeliveryOrder::Unordered,
            handler_timeout: None,
            shutdown_timeout: Duration::from_secs(30),
            inbox: None,
            classifier: Classifier::default(),
            lease: Duration::from_secs(30),
            delivery_limit: None,
            settle_backoff: (Duration::from_millis(100), Duration::from_secs(10)),
            batch_size: DEFAULT_BATCH_SIZE,
            rate_limit: None,
            topology_check: StartupCheck::Off,
            schema_check: StartupCheck::Off,
            breaker: None,
        }
    }
}

impl ConsumerBuilder {
    /// Read `source` (topic / exchange / stream / queue): everything published to it,
    /// unless [`filter`](Self::filter) narrows it.
    pub fn subscribe(mut self, source: impl Into<String>) -> Self {
        self.source = Some(source.into());
        self
    }

    /// Only what matches `pattern`: a routing-key pattern or subject (`*` one word, `#`
    /// any number of words). Where the broker cannot filter (Kafka:
    /// [`Capabilities::filters`](crate::subscription::Capabilities::filters) is false), `start` fails
    /// with a config error naming `filter`.
    pub fn filter(mut self, pattern: impl Into<String>) -> Self {
        self.filter = Some(pattern.into());
        self
    }

    /// The retry policy (default: [`RetryPolicy::default`]).
    pub fn retry(mut self, policy: RetryPolicy) -> Self {
        self.policy = policy;
        self
    }

    /// Most deliveries held at once, received but not settled (default 64). Also the
    /// prefetch asked of the broker.
    pub fn max_in_flight(mut self, n: u32) -> Self {
        self.max_in_flight = n;
        self
    }

    /// At most `per_second` deliveries a second are taken from the broker and handed to
    /// the handler, `burst` of them at once after a quiet spell (a batch handler's calls
    /// count their deliveries). The wait is before a delivery is received, so none sits
    /// leased while it waits; the rest stay in the broker. Protects a downstream that
    /// takes only so much (a database, a rate-limited API); in-flight and concurrency
    /// bound how much runs *at once*, this bounds how much runs *per second*.
    pub fn rate_limit(mut self, per_second: u32, burst: u32) -> Self {
        self.rate_limit = Some((per_second, burst));
        self
    }

    /// Compare the broker's topology with this consumer's plan once subscribed
    /// ([`Broker::check_topology`]): [`StartupCheck::Warn`] logs each difference,
    /// [`StartupCheck::Refuse`] fails `start` with [`ConsumerError::Topology`] on one that
    /// breaks delivery guarantees (an operator policy replacing the delivery limit, a
    /// retry topic with a retention shorter than its tier…). Either way the result is in
    /// `reliq_topology_drift`. Off by default (on RabbitMQ it needs the management API).
    pub fn check_topology(mut self, check: StartupCheck) -> Self {
        self.topology_check = check;
        self
    }

    /// Stop taking deliveries while the downstream fails: `breaker` opens when the share
    /// of transient failures over its window crosses its threshold (permanent, poison and
    /// panic failures do not count), and the consumer receives nothing until its
    /// cool-down ends; then a few probes decide (see [`CircuitBreaker`]). What waits stays
    /// in the broker and spends no attempt. Pass clones of one breaker to every consumer
    /// that calls the same downstream.
    pub fn circuit_breaker(mut self, breaker: CircuitBreaker) -> Self {
        self.breaker = Some(breaker);
        self
    }

    /// Most handlers running at once (default: `max_in_flight`).
    pub fn concurrency(mut self, n: usize) -> Self {
        self.concurrency = Some(n);
        self
    }

    /// DeliveryOrder between deliveries (default [`DeliveryOrder::Unordered`]).
    pub fn ordering(mut self, ordering: DeliveryOrder) -> Self {
        self.ordering = ordering;
        self
    }

    /// A handler running longer fails with a transient timeout error.
    pub fn handler_timeout(mut self, timeout: Duration) -> Self {
        self.handler_timeout = Some(timeout);
        self
    }

    /// How long shutdown waits for in-flight handlers before releasing them (default 30 s).
    pub fn shutdown_timeout(mut self, timeout: Duration) -> Self {
        self.shutdown_timeout = timeout;
        self
    }

    /// Skip messages whose id this consumer already handled.
    pub fn inbox(mut self, inbox: Arc<dyn Inbox>) -> Self {
        self.inbox = Some(inbox);
        self
    }

    /// How errors are classified (default: markers and built-in rules only).
    pub fn classifier(mut self, classifier: Classifier) -> Self {
        self.classifier = classifier;
        self
    }

    /// Lease of a delivery before the broker may hand it out again (default 30 s).
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// The broker-side delivery limit (default: the policy's attempts + 5). Must be above
    /// the policy's attempts, or the broker would dead-letter before the policy does.
    pub fn delivery_limit(mut self, limit: u32) -> Self {
        self.delivery_limit = Some(limit);
        self
    }

    /// Back-off bounds after a failed settlement (default 100 ms doubling to 10 s): how
    /// long a held delivery waits before its retry or dead-letter copy is sent again, and
    /// how long a released one waits before it comes back.
    pub fn settle_backoff(mut self, initial: Duration, max: Duration) -> Self {
        self.settle_backoff = (initial, max);
        self
    }

    /// Most deliveries in one call of a batch handler ([`ConsumerBuilder::start_batch`];
    /// default 64, at most `max_in_flight`). A batch is what the broker has ready, up to
    /// this many: the runtime never waits for a batch to fill.
    pub fn batch_size(mut self, n: usize) -> Self {
        self.batch_size = n;
        self
    }

    /// The subscription this consumer will ask the broker for.
    pub fn subscription(&self) -> Result<Subscription, ConsumerError> {
        let filter = self.filter.clone();
        let source = self.source.clone().ok_or(ConsumerError::Config {
            field: "subscribe",
            reason: "no source: call .subscribe(source)".into(),
        })?;
        let delivery_limit = self
            .delivery_limit
            .unwrap_or_else(|| self.policy.get_max_attempts().saturating_add(5));
        Ok(Subscription {
            consumer: self.name.clone(),
            source,
            filter,
            prefetch: self.max_in_flight,
            retry_tiers: self.policy.tier_delays(),
            delivery_limit,
            lease: self.lease,
        })
    }

    pub(super) fn validate(&self) -> Result<Subscription, ConsumerError> {
        let config = |field, reason: &str| ConsumerError::Config {
            field,
            reason: reason.into(),
        };
        if self.name.trim().is_empty() {
            return Err(config("name", "must not be empty"));
        }
        if self.max_in_flight == 0 {
            return Err(config("max_in_flight", "must be at least 1"));
        }
        if self.concurrency == Some(0) {
            return Err(config("concurrency", "must be at least 1"));
        }
        if self.lease.is_zero() {
            return Err(config("lease", "must be longer than zero"));
        }
        if let Some((per_second, burst)) = self.rate_limit
            && (per_second == 0 || burst == 0)
        {
            return Err(config(
                "rate_limit",
                "per_second and burst must each be at least 1",
            ));
        }
        if let Some((field, reason)) = self.breaker.as_ref().and_then(CircuitBreaker::invalid) {
            return Err(config(field, &reason));
        }
        self.policy.validate()?;
        let subscription = self.subscription()?;
        if let Err(e) = subscription.check_names() {
            // The builder's own names for the two: `.name(…)` and `.subscribe(…)`.
            let field = if e.field == "consumer" {
                "name"
            } else {
                "subscribe"
            };
            return Err(config(field, &e.to_string()));
        }
        if subscription.delivery_limit <= self.policy.get_max_attempts() {
            return Err(config(
                "delivery_limit",
                "must be greater than the retry policy's max attempts",
            ));
        }
        Ok(subscription)
    }

    /// `doc` with this consumer in it: the channel it reads with `payload` as its message
    /// (a codec's [`schema`](Codec::schema); `None`: bytes), its retry channels, its
    /// dead-letter channel with reliq's dead-letter record, and the broker's bindings —
    /// from the broker's [`plan`](Broker::plan) for this consumer (creates nothing).
    /// Chain it over a service's consumers for one document.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let broker: std::sync::Arc<dyn reliq_core::Broker> = std::sync::Arc::new(reliq_memory::MemoryBroker::new());
    /// use reliq_core::{AsyncApi, Consumer};
    /// let billing = Consumer::builder(broker, "billing").subscribe("orders");
    /// let doc = billing.asyncapi(AsyncApi::new("billing", "1.4.0"), None).await?;
    /// assert!(doc.to_json()["channels"]["orders_billing_dlq"].is_object());
    /// # Ok(()) }
    /// ```
    pub async fn asyncapi(
        &self,
        doc: AsyncApi,
        payload: Option<MessageSchema>,
    ) -> Result<AsyncApi, ConsumerError> {
        let subscription = self.validate()?;
        let plan = self
            .broker
            .plan(&subscription)
            .await
            .map_err(ConsumerError::Plan)?;
        Ok(doc.consumer(plan, payload))
    }

    /// What a typed consumer ([`start_typed`](Self::start_typed)) checks at start: whether
    /// the schema the producers write to the source (the registry's latest for its
    /// subject) can be read as the handler's type ([`Codec::check_readable`]).
    /// [`StartupCheck::Warn`] logs an incompatibility (or a registry that cannot be asked)
    /// and starts; [`StartupCheck::Refuse`] does not start. Default: off.
    pub fn check_schema(mut self, check: StartupCheck) -> Self {
        self.schema_check = check;
        self
    }

    /// Like [`start`](Self::start), with a typed handler: each delivery's payload is
    /// decoded by `codec` before `handler` runs, and the handler gets the value and the
    /// delivery (its id, key, headers, attempt). A payload that does not decode is poison:
    /// parked at once with the decoder's reason, the handler not called. A codec that
    /// cannot reach its registry fails transiently: the message is retried, not parked.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let broker: std::sync::Arc<dyn reliq_core::Broker> = std::sync::Arc::new(reliq_memory::MemoryBroker::new());
    /// use reliq_core::{BoxError, Consumer, Delivery, Destination, JsonCodec, TypedPublisher};
    /// #[derive(serde::Serialize, serde::Deserialize)]
    /// struct OrderCreated { order: String, cents: u64 }
    ///
    /// let consumer = Consumer::builder(broker.clone(), "billing")
    ///     .subscribe("orders")
    ///     .start_typed(JsonCodec::<OrderCreated>::new(), |order: OrderCreated, _d: Delivery| async move {
    ///         assert_eq!(order.cents, 1250);
    ///         Ok::<(), BoxError>(())
    ///     })
    ///     .await?;
    /// let orders = TypedPublisher::new(broker, Destination::new("orders"), JsonCodec::new());
    /// orders.publish(&OrderCreated { order: "o-1".into(), cents: 1250 }).await?;
    /// # while consumer.stats().processed == 0 { tokio::time::sleep(std::time::Duration::from_millis(5)).await; }
    /// consumer.shutdown().await;
    /// # Ok(()) }
    /// ```
    pub async fn start_typed<T, C, F, Fut>(
        self,
        codec: C,
        handler: F,
    ) -> Result<ConsumerHandle, ConsumerError>
    where
        T: Send + Sync + 'static,
        C: Codec<T>,
        F: Fn(T, Delivery) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), BoxError>> + Send + 'static,
    {
        let subscription = self.validate()?;
        self.schema_startup_check(&codec, &subscription.source)
            .await?;
        let typed = Arc::new((codec, handler));
        self.start(move |delivery: Delivery| {
            let typed = typed.clone();
            async move {
                let (codec, handler) = &*typed;
                let value = match codec.decode_now(delivery.payload()) {
                    Some(decoded) => decoded?,
                    None => codec.decode(delivery.payload()).await?,
                };
                handler(value, delivery).await
            }
        })
        .await
    }

    /// The start-up schema check of a typed consumer (before it subscribes).
    async fn schema_startup_check<T: Send + Sync + 'static>(
        &self,
        codec: &dyn Codec<T>,
        source: &str,
    ) -> Result<(), ConsumerError> {
        let check = self.schema_check;
        if check == StartupCheck::Off {
            return Ok(());
        }
        let unreadable = match codec.check_readable(source).await {
            Ok(None) => return Ok(()),
            Ok(Some(reason)) => reason,
            Err(e) if check == StartupCheck::Warn => {
                tracing::warn!(consumer = %self.name, source, error = %crate::classify::ErrorChain(&e),
                    "cannot check the producers' schema; starting anyway");
                return Ok(());
            }
            Err(e) => return Err(ConsumerError::SchemaCheck(e)),
        };
        if check == StartupCheck::Refuse {
            return Err(ConsumerError::Schema {
                topic: source.to_owned(),
                reason: unreadable,
            });
        }
        tracing::error!(consumer = %self.name, source, reason = %unreadable,
            "the producers' schema cannot be read by this consumer; starting anyway (check_schema: warn)");
        Ok(())
    }

    /// Subscribe and start consuming in the background, one handler call per delivery;
    /// returns a handle to stop it.
    pub async fn start<F, Fut>(self, handler: F) -> Result<ConsumerHandle, ConsumerError>
    where
        F: Fn(Delivery) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), BoxError>> + Send + 'static,
    {
        let subscription = self.validate()?;
        self.launch(
            subscription,
            handler,
            RECEIVE_BATCH,
            dispatch_each::<F, Fut>,
        )
        .await
    }

    /// Like [`ConsumerBuilder::start`], with a batch handler: one call for up to
    /// [`ConsumerBuilder::batch_size`] deliveries, the successes acknowledged together
    /// (see [`Batch`](crate::Batch)). A batch counts as one handler against `concurrency`, the
    /// handler timeout and the handler metrics. [`DeliveryOrder::PerKey`] is refused: two
    /// batches in flight may hold the same key.
    pub async fn start_batch<F, Fut>(self, handler: F) -> Result<ConsumerHandle, ConsumerError>
    where
        F: Fn(Batch) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), BatchError>> + Send + 'static,
    {
        let subscription = self.validate()?;
        if self.ordering == DeliveryOrder::PerKey {
            return Err(ConsumerError::Config {
                field: "ordering",
                reason: "per-key ordering needs a per-message handler (start), not start_batch"
                    .into(),
            });
        }
        if self.batch_size == 0 || self.batch_size > self.max_in_flight as usize {
            return Err(ConsumerError::Config {
                field: "batch_size",
                reason: format!(
                    "must be between 1 and max_in_flight ({}), not {}",
                    self.max_in_flight, self.batch_size
                ),
            });
        }
        let max = self.batch_size;
        self.launch(subscription, handler, max, dispatch_batch::<F, Fut>)
            .await
    }

    /// The start-up topology check (after the subscription declared what it declares).
    async fn startup_check(&self, subscription: &Subscription) -> Result<(), ConsumerError> {
        let check = self.topology_check;
        if check == StartupCheck::Off {
            return Ok(());
        }
        let report = match self.broker.check_topology(subscription).await {
            Ok(report) => report,
            Err(e) if check == StartupCheck::Warn => {
                tracing::warn!(consumer = %subscription.consumer, error = %crate::classify::ErrorChain(&e),
                    "cannot check the broker's topology; starting anyway");
                return Ok(());
            }
            Err(e) => return Err(ConsumerError::TopologyCheck(e)),
        };
        report.record();
        for d in &report.drift {
            match d.severity {
                Severity::Breaking => {
                    tracing::error!(consumer = %subscription.consumer, drift = %d, "topology drift")
                }
                Severity::Cosmetic => {
                    tracing::warn!(consumer = %subscription.consumer, drift = %d, "topology drift")
                }
            }
        }
        if check == StartupCheck::Refuse && report.is_breaking() {
            return Err(ConsumerError::Topology(Box::new(report)));
        }
        Ok(())
    }

    /// Subscribe and start the receive loop; `dispatch` hands out what each receive
    /// returned (per delivery, or as one batch).
    pub(super) async fn launch<H: Send + Sync + 'static>(
        self,
        subscription: Subscription,
        handler: H,
        receive_max: usize,
        dispatch: Dispatch<H>,
    ) -> Result<ConsumerHandle, ConsumerError> {
        let receiver: Arc<dyn Receiver> = Arc::from(
            self.broker
                .subscribe(&subscription)
                .await
                .map_err(ConsumerError::Subscribe)?,
        );
        if let Err(e) = self.startup_check(&subscription).await {
            if let Err(close) = receiver.close().await {
                tracing::debug!(error = %crate::classify::ErrorChain(&close), "closing the refused receiver");
            }
            return Err(e);
        }
        let concurrency = self
            .concurrency
            .unwrap_or(self.max_in_flight as usize)
            .min(Semaphore::MAX_PERMITS);
        let settler = Settler {
            name: self.name.as_str().into(),
            receiver: receiver.clone(),
            policy: self.policy,
            classifier: self.classifier,
            inbox: self.inbox,
            clock: Clock::new(),
            stats: Arc::new(Stats::default()),
            metrics: ConsumerMetrics::new(&self.name),
            spans: crate::telemetry::SpanNames::new(self.broker.kind(), &subscription.source),
            breaker: self.breaker,
            backoff: SettleBackoff {
                failures: AtomicU32::new(0),
                initial: self.settle_backoff.0,
                max: self.settle_backoff.1,
            },
            hard_stop: Signal::default(),
        };
        let handling = Handling {
            handler,
            handler_timeout: self.handler_timeout,
            concurrency: (concurrency < self.max_in_flight as usize)
                .then(|| Semaphore::new(concurrency)),
            crash: Signal::default(),
            settler,
        };
        let shared = Arc::new(Shared {
            handling: Arc::new(handling),
            rate: self.rate_limit.and_then(|(per_second, burst)| {
                Some(super::rate::HandlerRate::new(
                    std::num::NonZeroU32::new(per_second)?,
                    std::num::NonZeroU32::new(burst)?,
                ))
            }),
            keyed: Mutex::new(HashMap::new()),
            group_size: (self.max_in_flight as usize
                / (2 * tokio::runtime::Handle::current()
                    .metrics()
                    .num_workers()
                    .max(1)))
            .clamp(1, RECEIVE_BATCH),
            runners: Default::default(),
            ordering: self.ordering,
            tracker: TaskTracker::new(),
        });
        let stop = CancellationToken::new();
        let in_flight = Arc::new(Semaphore::new(self.max_in_flight as usize));
        let loop_task = tokio::spawn(receive_loop(
            shared.clone(),
            stop.clone(),
            in_flight,
            receive_max,
            dispatch,
        ));
        tracing::info!(consumer = %shared.settler().name, source = %subscription.source, "consumer started");
        Ok(ConsumerHandle {
            shared,
            stop,
            loop_task,
            shutdown_timeout: self.shutdown_timeout,
            receiver,
        })
    }

    /// Start, run until `shutdown` completes, then shut down gracefully.
    pub async fn run<F, Fut>(
        self,
        handler: F,
        shutdown: impl Future<Output = ()>,
    ) -> Result<ShutdownReport, ConsumerError>
    where
        F: Fn(Delivery) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), BoxError>> + Send + 'static,
    {
        let handle = self.start(handler).await?;
        shutdown.await;
        Ok(handle.shutdown().await)
    }

    /// [`ConsumerBuilder::start_batch`], run until `shutdown` completes, then shut down
    /// gracefully.
    pub async fn run_batch<F, Fut>(
        self,
        handler: F,
        shutdown: impl Future<Output = ()>,
    ) -> Result<ShutdownReport, ConsumerError>
    where
        F: Fn(Batch) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), BatchError>> + Send + 'static,
    {
        let handle = self.start_batch(handler).await?;
        shutdown.await;
        Ok(handle.shutdown().await)
    }
}

/// Default [`ConsumerBuilder::batch_size`].
pub(super) const DEFAULT_BATCH_SIZE: usize = 64;
