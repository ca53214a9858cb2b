//! The settle stage: what a handler's outcome becomes — ack, retry, dead-letter or
//! release, each confirmed by the broker before the delivery counts as settled — with
//! the inbox claim's completion, the back-off after failed settlements, and the counts.

use super::signal::Signal;
use super::stats::Stats;
use crate::breaker::CircuitBreaker;
use crate::broker::Receiver;
use crate::classify::{BoxError, Classifier, ErrorClass};
use crate::delivery::{Delivery, RetryRequest};
use crate::error::BrokerError;
use crate::headers::{self, DeadLetter};
use crate::inbox::{Claim, Duplicate, Inbox};
use crate::retry::{Decision, Failure, RetryPolicy};
use crate::telemetry::{Clock, ConsumerMetrics, SettleOp, SpanNames};
use futures::future::BoxFuture;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering as AtomicOrdering};
use std::time::Duration;
use tracing::Instrument as _;

pub(super) struct SettleBackoff {
    pub(super) failures: AtomicU32,
    pub(super) initial: Duration,
    pub(super) max: Duration,
}

impl SettleBackoff {
    pub(super) fn delay_for(&self, failures: u32) -> Duration {
        if failures == 0 {
            return Duration::ZERO;
        }
        let exp = (failures - 1).min(20);
        self.initial.saturating_mul(1 << exp).min(self.max)
    }

    /// Record a failure; the delay before the failed delivery should come back.
    pub(super) fn failed(&self) -> Duration {
        let n = self.failures.fetch_add(1, AtomicOrdering::Relaxed) + 1;
        self.delay_for(n)
    }

    pub(super) fn succeeded(&self) {
        if self.failures.load(AtomicOrdering::Relaxed) != 0 {
            self.failures.store(0, AtomicOrdering::Relaxed);
        }
    }

    pub(super) fn current(&self) -> Duration {
        self.delay_for(self.failures.load(AtomicOrdering::Relaxed))
    }
}

#[derive(Clone)]
pub(super) enum Outcome {
    Done,
    /// The handler returned [`Duplicate`]: ack, skip, count.
    Duplicate,
    /// The handler failed.
    Failed {
        /// The failure's class.
        class: ErrorClass,
        /// Its error text (the chain of sources).
        reason: String,
        /// Whether it is news about the circuit breaker's downstream (a transient
        /// failure its `counting` accepts).
        counts_for_breaker: bool,
    },
}

/// What settling needs: the receiver, the retry policy and the classifier, the inbox,
/// the back-off after failed settlements, the circuit breaker, and what counts and traces
/// it. The handle stage ([`super::handle`]) holds one.
pub(super) struct Settler {
    pub(super) name: Arc<str>,
    pub(super) receiver: Arc<dyn Receiver>,
    pub(super) policy: RetryPolicy,
    pub(super) classifier: Classifier,
    pub(super) inbox: Option<Arc<dyn Inbox>>,
    pub(super) clock: Clock,
    pub(super) stats: Arc<Stats>,
    pub(super) metrics: ConsumerMetrics,
    /// The spans' names and constant attributes.
    pub(super) spans: SpanNames,
    /// The circuit breaker on handler outcomes, if any.
    pub(super) breaker: Option<CircuitBreaker>,
    pub(super) backoff: SettleBackoff,
    /// Fired at the shutdown deadline: a handler still running is cut short and its
    /// delivery released; a delivery held for a failed settlement is released too.
    pub(super) hard_stop: Signal,
}

impl Settler {
    /// Claim `d` in the runtime's inbox, if there is one. False: already settled (a
    /// duplicate, acknowledged; or the claim failed and the delivery was released).
    pub(super) async fn claim(&self, d: &Delivery) -> bool {
        let Some(inbox) = &self.inbox else {
            return true;
        };
        match inbox.claim(&self.name, d.id()).await {
            Ok(Claim::First) => true,
            Ok(Claim::Duplicate) => {
                self.skip_duplicate(d).await;
                false
            }
            Err(e) => {
                tracing::warn!(error = %crate::classify::ErrorChain(&e), "inbox claim failed; releasing the delivery");
                let wait = self.backoff.failed();
                self.release(d, wait).await;
                false
            }
        }
    }

    /// Complete the inbox claims of handled deliveries and acknowledge them together.
    pub(super) async fn ack_done(&self, done: &[Delivery]) {
        if done.is_empty() {
            return;
        }
        for d in done {
            self.complete_claim(d).await;
        }
        let span = self.settle_span("ack");
        if !span.is_disabled() {
            match done {
                [one] => span.record("messaging.message.id", one.id().as_str()),
                many => span.record("messaging.batch.message_count", many.len()),
            };
        }
        // A backend that acknowledges locally answers at once, without a boxed future.
        let tried = if span.is_disabled() {
            self.receiver.try_ack_batch(done)
        } else {
            span.in_scope(|| self.receiver.try_ack_batch(done))
        };
        let failed = match tried {
            Some(failed) => failed,
            None => self.receiver.ack_batch(done).instrument(span.clone()).await,
        };
        if let Some((_, e)) = failed.first() {
            span.record("error.type", e.kind());
        }
        let acked = (done.len() - failed.len().min(done.len())) as u64;
        if let Some(breaker) = &self.breaker {
            breaker.succeeded(done.len() as u64);
        }
        if acked > 0 {
            // Claimed, handled and acknowledged: whatever failed before works again.
            self.backoff.succeeded();
        }
        self.stats
            .processed
            .fetch_add(acked, AtomicOrdering::Relaxed);
        self.metrics.processed.increment(acked);
        for (i, e) in failed {
            let id = done.get(i).map(|d| d.id().to_string()).unwrap_or_default();
            self.ack_failed(&e, &id);
        }
    }

    /// What a handler error means: a [`Duplicate`] marker anywhere in its chain, or a
    /// failure of the class the classifier gives it.
    pub(super) fn failure(&self, e: BoxError) -> Outcome {
        if Duplicate::is_in(e.as_ref()) {
            Outcome::Duplicate
        } else {
            let class = self.classifier.classify(e.as_ref());
            let counts = class == ErrorClass::Transient
                && self.breaker.as_ref().is_none_or(|b| b.counts(e.as_ref()));
            Outcome::Failed {
                class,
                reason: chain_text(e.as_ref()),
                counts_for_breaker: counts,
            }
        }
    }

    /// Acknowledge a delivery whose effect already happened, and count it.
    pub(super) async fn skip_duplicate(&self, d: &Delivery) {
        Stats::bump(&self.stats.duplicates);
        self.metrics.duplicates.increment(1);
        tracing::debug!("duplicate: already handled, acknowledging");
        self.ack(d).await;
    }

    /// Record this delivery's effect as done in the runtime's inbox, if there is one.
    pub(super) async fn complete_claim(&self, d: &Delivery) {
        if let Some(inbox) = &self.inbox
            && let Err(e) = inbox.complete(&self.name, d.id()).await
        {
            tracing::warn!(error = %crate::classify::ErrorChain(&e), id = %d.id(), "inbox complete failed");
        }
    }

    /// Forget this delivery's inbox claim: its effect did not happen.
    pub(super) async fn abandon_claim(&self, d: &Delivery) {
        if let Some(inbox) = &self.inbox
            && let Err(e) = inbox.abandon(&self.name, d.id()).await
        {
            tracing::warn!(error = %crate::classify::ErrorChain(&e), "inbox abandon failed");
        }
    }

    pub(super) async fn settle(&self, d: &Delivery, outcome: Outcome) {
        let (class, text, counts) = match outcome {
            // The one success path: the same as a group's or a batch's successes.
            Outcome::Done => return self.ack_done(std::slice::from_ref(d)).await,
            Outcome::Duplicate => {
                if let Some(breaker) = &self.breaker {
                    breaker.neutral();
                }
                tracing::Span::current().record("reliq.decision", "duplicate");
                // A duplicate's effect exists too (an earlier delivery made it).
                self.complete_claim(d).await;
                self.skip_duplicate(d).await;
                return;
            }
            Outcome::Failed {
                class,
                reason,
                counts_for_breaker,
            } => (class, reason, counts_for_breaker),
        };
        if let Some(breaker) = &self.breaker {
            // Only a transient failure (that its `counting` accepts) is news about the
            // downstream.
            if counts {
                breaker.failed();
            } else {
                breaker.neutral();
            }
        }
        // Boxed: the failure path's state (copies, headers, the dead-letter record) would
        // otherwise make every message's task as large as a failing one's.
        Box::pin(self.settle_failure(d, class, text)).await;
    }

    /// Retry, dead-letter or discard a failed delivery, as the policy decides.
    pub(super) async fn settle_failure(&self, d: &Delivery, class: ErrorClass, text: String) {
        let now = self.clock.now();
        // Brokers that retry in place (no copy, so no failure headers) report when the
        // message was published; that bounds the first failure from below.
        let first_failure = d
            .headers()
            .get(headers::FIRST_FAILURE_AT)
            .and_then(|v| headers::parse_time(v).ok())
            .or_else(|| (d.attempt() > 1).then(|| d.published_at()).flatten())
            .unwrap_or(now);
        let origin_time = d
            .headers()
            .get(headers::OCCURRED_AT)
            .and_then(|v| headers::parse_time(v).ok())
            .unwrap_or(first_failure);
        let failure = Failure {
            class,
            attempt: d.attempt(),
            age: now.duration_since(origin_time).unwrap_or_default(),
        };
        let process = tracing::Span::current();
        process.record("reliq.error.class", class.as_str());
        process.record("error.type", class.as_str());
        match self.policy.decide(&failure, fastrand::f64()) {
            Decision::Retry {
                delay,
                tier,
                next_attempt,
            } => {
                let request = || {
                    let mut copy = d.message().clone();
                    let h = copy.headers_mut();
                    h.insert(headers::ATTEMPT, next_attempt.to_string());
                    h.insert(
                        headers::FIRST_FAILURE_AT,
                        headers::format_time(first_failure),
                    );
                    h.insert(headers::LAST_FAILURE_AT, headers::format_time(now));
                    h.insert(headers::LAST_ERROR, headers::sanitize_error(&text));
                    h.insert(headers::ERROR_CLASS, class.as_str());
                    RetryRequest {
                        message: copy,
                        delay,
                        tier,
                    }
                };
                tracing::info!(class = %class, error = %text, ?delay, next_attempt, "retrying");
                process.record("reliq.decision", "retry");
                let sent = self
                    .until_confirmed(d, SettleOp::Retry, || self.receiver.retry(d, request()))
                    .await;
                if sent {
                    Stats::bump(&self.stats.retried);
                    self.metrics.retried(class).increment(1);
                }
            }
            Decision::DeadLetter(reason) => {
                let record = DeadLetter {
                    reason,
                    error_class: Some(class),
                    error: Some(text.clone()),
                    attempts: d.attempt(),
                    first_failure_at: Some(first_failure),
                    dead_lettered_at: now,
                    consumer: self.name.to_string(),
                    origin: d.origin().clone(),
                };
                let dead = || {
                    let mut copy = d.message().clone();
                    record.write(copy.headers_mut());
                    copy
                };
                tracing::warn!(%reason, class = %class, error = %text, "dead-lettering");
                process.record("reliq.decision", "dead_letter");
                process.record("reliq.dead_letter.reason", reason.as_str());
                let sent = self
                    .until_confirmed(d, SettleOp::DeadLetter, || {
                        self.receiver.dead_letter(d, dead())
                    })
                    .await;
                if sent {
                    Stats::bump(&self.stats.dead_lettered);
                    self.metrics.dead_lettered(reason).increment(1);
                }
            }
            Decision::Discard(reason) => {
                process.record("reliq.decision", "discard");
                process.record("reliq.dead_letter.reason", reason.as_str());
                tracing::warn!(%reason, class = %class, error = %text, "discarding (final route = discard)");
                if self.ack(d).await {
                    Stats::bump(&self.stats.discarded);
                    self.metrics.discarded(reason).increment(1);
                }
            }
        }
    }

    pub(super) async fn ack(&self, d: &Delivery) -> bool {
        match self.receiver.ack(d).await {
            Ok(()) => true,
            Err(e) => {
                self.ack_failed(&e, d.id().as_str());
                false
            }
        }
    }

    pub(super) fn ack_failed(&self, e: &BrokerError, id: &str) {
        // The effect is done; the broker will redeliver and the inbox absorbs it.
        Stats::bump(&self.stats.settle_failures);
        self.metrics.settle_failures[SettleOp::Ack as usize].increment(1);
        tracing::warn!(error = %crate::classify::ErrorChain(e), id, "ack failed; the message may be delivered again");
    }

    /// Send a retry or dead-letter copy (`send`: the receiver's `retry` / `dead_letter`)
    /// until the broker confirms it. The policy has decided; a copy the broker did not
    /// confirm (the DLQ or retry route unavailable, a node lost) is sent again after the
    /// settle back-off with the delivery *held* — still leased (the backends renew a
    /// lease until the delivery is settled), its handler not called again. Releasing it
    /// instead would run the handler once more per try and, where every delivery counts
    /// as an attempt (NATS), spend the message's attempts on the outage: a message
    /// decided `permanent` could end parked as `exhausted`.
    ///
    /// Stops without a copy when the receiver no longer holds the delivery (the broker
    /// delivers it again), when the backend cannot ever send it (released), and at a
    /// hard stop (released). True: confirmed and settled. Each try runs in the
    /// operation's settle span.
    async fn until_confirmed<'a, F>(&self, d: &Delivery, op: SettleOp, mut send: F) -> bool
    where
        F: FnMut() -> BoxFuture<'a, Result<(), BrokerError>>,
    {
        let span = &self.settle_span(op.as_str());
        span.record("messaging.message.id", d.id().as_str());
        loop {
            let Err(e) = send().instrument(span.clone()).await else {
                self.backoff.succeeded();
                return true;
            };
            span.record("error.type", e.kind());
            Stats::bump(&self.stats.settle_failures);
            self.metrics.settle_failures[op as usize].increment(1);
            let (op_name, id, attempt) = (op.as_str(), d.id(), d.attempt());
            match &e {
                BrokerError::ForeignDelivery => {
                    // Not a broker failure: releasing on this receiver would be refused
                    // the same way. The owner's lease returns it.
                    tracing::error!(operation = op_name, %id, "a delivery of another receiver reached this consumer; left to its owner");
                    return false;
                }
                BrokerError::NotHeld(_) => {
                    tracing::warn!(operation = op_name, %id, attempt, error = %crate::classify::ErrorChain(&e),
                        "settlement failed; the delivery is no longer held here and the broker delivers it again");
                    return false;
                }
                BrokerError::Closed
                | BrokerError::Unsupported { .. }
                | BrokerError::Config { .. } => {
                    // No later try can succeed on this receiver.
                    let wait = self.backoff.failed();
                    tracing::error!(operation = op_name, %id, attempt, error = %crate::classify::ErrorChain(&e), release_delay = ?wait,
                        "settlement failed; the source message is released, not acknowledged");
                    self.release(d, wait).await;
                    return false;
                }
                _ => {}
            }
            let wait = self.backoff.failed();
            tracing::error!(operation = op_name, %id, attempt, error = %crate::classify::ErrorChain(&e), retry_in = ?wait,
                "settlement failed; the delivery is held and its copy sent again");
            if self
                .hard_stop
                .unless_fired(tokio::time::sleep(wait))
                .await
                .is_none()
            {
                tracing::warn!(operation = op_name, %id, "stopping: the held delivery is released unsettled");
                self.release(d, Duration::ZERO).await;
                return false;
            }
        }
    }

    pub(super) async fn release(&self, d: &Delivery, delay: Duration) {
        let span = self.settle_span("release");
        if !span.is_disabled() {
            // Reading the id may decode the message: only for a span that records it.
            span.record("messaging.message.id", d.id().as_str());
        }
        match self
            .receiver
            .release(d, delay)
            .instrument(span.clone())
            .await
        {
            Ok(()) => Stats::bump(&self.stats.released),
            Err(e) => {
                span.record("error.type", e.kind());
                Stats::bump(&self.stats.settle_failures);
                self.metrics.settle_failures[SettleOp::Release as usize].increment(1);
                tracing::warn!(error = %crate::classify::ErrorChain(&e), "release failed; the broker redelivers after the lease");
            }
        }
    }
}

/// A consumer span (`process` or `settle`) with the messaging attributes every one
/// carries, the ones recorded later left empty, and `$extra` fields of its own.
macro_rules! consumer_span {
    ($shared:expr, $span:literal, $name:expr, $kind:literal, $operation:expr, $($extra:tt)*) => {
        tracing::info_span!(
            $span,
            otel.name = %$name,
            otel.kind = $kind,
            messaging.system = $shared.spans.system,
            messaging.destination.name = %$shared.spans.source,
            messaging.consumer.group.name = %$shared.name,
            messaging.operation.type = $span,
            messaging.operation.name = $operation,
            messaging.message.id = tracing::field::Empty,
            messaging.batch.message_count = tracing::field::Empty,
            error.type = tracing::field::Empty,
            $($extra)*
        )
    };
}

impl Settler {
    /// A `process <source>` span: one delivery (its id, attempt and decision recorded on
    /// it) or one batch (its size).
    pub(super) fn process_span(&self) -> tracing::Span {
        consumer_span!(
            self,
            "process",
            self.spans.process,
            "consumer",
            "process",
            reliq.attempt = tracing::field::Empty,
            reliq.decision = tracing::field::Empty,
            reliq.error.class = tracing::field::Empty,
            reliq.dead_letter.reason = tracing::field::Empty,
            trace_id = tracing::field::Empty,
            parent_span_id = tracing::field::Empty,
        )
    }

    /// A `settle <source>` span for `operation` (`ack`, `retry`, `dead_letter`,
    /// `release`), a child of the current (process) span.
    pub(super) fn settle_span(&self, operation: &'static str) -> tracing::Span {
        consumer_span!(self, "settle", self.spans.settle, "client", operation,)
    }
}

impl Settler {
    /// Count `n` deliveries as received and held.
    pub(super) fn count_received(&self, n: usize) {
        let n = n as u64;
        let stats = &self.stats;
        stats.received.fetch_add(n, AtomicOrdering::Relaxed);
        self.metrics.received.increment(n);
        let held = stats.in_flight.fetch_add(n, AtomicOrdering::Relaxed) + n;
        stats.max_in_flight.fetch_max(held, AtomicOrdering::Relaxed);
        self.metrics.in_flight.increment(n as f64);
    }

    /// Count `n` deliveries as no longer held (settled or released).
    pub(super) fn count_settled(&self, n: usize) {
        self.stats
            .in_flight
            .fetch_sub(n as u64, AtomicOrdering::Relaxed);
        self.metrics.in_flight.decrement(n as f64);
    }
}

/// The error and its sources, `outer: inner: innermost`.
pub(super) fn chain_text(e: &(dyn std::error::Error + 'static)) -> String {
    crate::classify::ErrorChain(e).to_string()
}

pub(super) fn panic_text(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-text panic payload".to_owned()
    }
}
