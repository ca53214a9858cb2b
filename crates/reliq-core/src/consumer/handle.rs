//! The handle stage: run the handler on a delivery (or a batch) — a concurrency slot,
//! the inbox claim, the timeout, a panic caught — and hand the outcome to the settle
//! stage. Successes of a group are acknowledged together ([`ack_handled`]).

use super::settle::{Outcome, Settler, panic_text};
use super::signal::Signal;
use super::stats::Stats;
use crate::batch::{Batch, BatchError, Failed};
use crate::classify::{BoxError, ErrorClass};
use crate::delivery::Delivery;
use crate::telemetry::TraceParent;
use futures::FutureExt as _;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::Ordering as AtomicOrdering;
use std::time::{Duration, Instant};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, SemaphorePermit};
use tracing::Instrument;

/// What handling needs: the handler and its limits, the stop signals, and the settler
/// every outcome goes to.
pub(super) struct Handling<F> {
    pub(super) handler: F,
    pub(super) handler_timeout: Option<Duration>,
    /// Most handlers running at once; `None` when that is no stricter than the in-flight
    /// bound (a handler holds at least one in-flight delivery), which saves a semaphore
    /// per message.
    pub(super) concurrency: Option<Semaphore>,
    /// Fired by a simulated crash: everything stops at once, nothing more is settled.
    pub(super) crash: Signal,
    pub(super) settler: Settler,
}

impl<H> Handling<H> {
    /// Wait for a handler slot, held while the handler runs (`None`: no limit to keep).
    pub(super) async fn concurrency_slot(&self) -> Option<SemaphorePermit<'_>> {
        // The semaphore is never closed.
        self.concurrency.as_ref()?.acquire().await.ok()
    }

    /// One handler call (per message or per batch): counted as running, bounded by the
    /// handler timeout, a panic caught. `Err` is the failure the call itself became.
    pub(super) async fn call<T>(&self, call: impl Future<Output = T>) -> Result<T, Outcome> {
        let running = self
            .settler
            .stats
            .running
            .fetch_add(1, AtomicOrdering::Relaxed)
            + 1;
        self.settler
            .stats
            .max_running
            .fetch_max(running, AtomicOrdering::Relaxed);
        let started = Instant::now();
        let result = AssertUnwindSafe(async {
            match self.handler_timeout {
                Some(limit) => {
                    tokio::time::timeout(limit, call)
                        .await
                        .map_err(|_| Outcome::Failed {
                            class: ErrorClass::Transient,
                            reason: format!("handler timed out after {limit:?}"),
                            counts_for_breaker: true,
                        })
                }
                None => Ok(call.await),
            }
        })
        .catch_unwind()
        .await;
        self.settler
            .stats
            .running
            .fetch_sub(1, AtomicOrdering::Relaxed);
        self.settler
            .metrics
            .handler_duration
            .record(started.elapsed().as_secs_f64());
        result.unwrap_or_else(|panic| {
            Stats::bump(&self.settler.stats.panics);
            let text = panic_text(panic.as_ref());
            tracing::error!(panic = %text, "handler panicked");
            Err(Outcome::Failed {
                class: ErrorClass::Panic,
                reason: format!("panic: {text}"),
                counts_for_breaker: false,
            })
        })
    }
}

/// Handle and settle one delivery.
pub(super) async fn process<F, Fut>(handling: Arc<Handling<F>>, delivery: Delivery)
where
    F: Fn(Delivery) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), BoxError>> + Send + 'static,
{
    if let Some(handled) = handle_one(handling.clone(), delivery).await {
        ack_handled(&handling, std::slice::from_ref(&handled)).await;
    }
}

/// Handle one delivery and settle it — except a success, which is returned for the caller
/// to acknowledge ([`ack_handled`]), so that a group acknowledges its successes together.
pub(super) async fn handle_one<F, Fut>(
    handling: Arc<Handling<F>>,
    delivery: Delivery,
) -> Option<Delivery>
where
    F: Fn(Delivery) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), BoxError>> + Send + 'static,
{
    let span = handling.settler.process_span();
    // Only for a span that records them: reading the headers may decode the message.
    if !span.is_disabled() {
        span.record("messaging.message.id", delivery.id().as_str());
        span.record("reliq.attempt", i64::from(delivery.attempt()));
        if let Some(tp) = delivery.traceparent().and_then(TraceParent::parse) {
            span.record("trace_id", tp.trace_id);
            span.record("parent_span_id", tp.parent_id);
            crate::telemetry::continue_trace(&span, &tp);
        }
    }
    let s = handling;
    let d = delivery;
    let handled = async move {
        // Graceful path: handle, then settle; a hard stop (shutdown deadline) releases
        // a delivery whose handler is still running. Settling itself is not cut short.
        let work = async {
            match s.settler.hard_stop.unless_fired(s.handle(&d)).await {
                None => {
                    s.settler.abandon_claim(&d).await;
                    s.settler.release(&d, Duration::ZERO).await;
                    None
                }
                Some(Some(Outcome::Done)) => {
                    tracing::Span::current().record("reliq.decision", "ack");
                    Some(d.clone())
                }
                Some(Some(outcome)) => {
                    s.settler.settle(&d, outcome).await;
                    None
                }
                Some(None) => None,
            }
        };
        // A crash stops everything at once, a settlement in progress included: nothing
        // more reaches the broker, as when the process dies.
        match s.crash.unless_fired(work).await {
            // A crash rolls back an uncommitted inbox claim, as a transaction would.
            None => {
                s.settler.abandon_claim(&d).await;
                None
            }
            Some(None) => {
                s.settler.count_settled(1);
                None
            }
            Some(handled) => handled,
        }
    };
    // A span nobody records is not entered at every poll: with `tracing`'s `log`
    // feature on (sqlx turns it on) entering even a disabled span asks the logger.
    if span.is_disabled() {
        handled.await
    } else {
        handled.instrument(span).await
    }
}

/// Complete the inbox claims of successfully handled deliveries and acknowledge them
/// together — unless the consumer crashed first (the claims are then rolled back).
pub(super) async fn ack_handled<F, Fut>(handling: &Handling<F>, handled: &[Delivery])
where
    F: Fn(Delivery) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), BoxError>> + Send + 'static,
{
    match handling
        .crash
        .unless_fired(handling.settler.ack_done(handled))
        .await
    {
        None => {
            for d in handled {
                handling.settler.abandon_claim(d).await;
            }
        }
        Some(()) => handling.settler.count_settled(handled.len()),
    }
}

pub(super) async fn process_batch<F, Fut>(
    handling: Arc<Handling<F>>,
    deliveries: Arc<Vec<Delivery>>,
    _permits: OwnedSemaphorePermit,
) where
    F: Fn(Batch) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), BatchError>> + Send + 'static,
{
    let span = handling.settler.process_span();
    span.record("messaging.batch.message_count", deliveries.len());
    // Each message's creation context, as a link (a batch has many parents).
    #[cfg(feature = "otel")]
    if !span.is_disabled() {
        crate::telemetry::link_traces(&span, &deliveries);
    }
    async {
        // As for one message: a crash stops everything at once and settles nothing.
        match handling
            .crash
            .unless_fired(handling.handle_batch(&deliveries))
            .await
        {
            None => {
                for d in deliveries.iter() {
                    handling.settler.abandon_claim(d).await;
                }
            }
            Some(()) => handling.settler.count_settled(deliveries.len()),
        }
    }
    .instrument(span)
    .await;
}

impl<F, Fut> Handling<F>
where
    F: Fn(Delivery) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), BoxError>> + Send + 'static,
{
    /// Run the handler. `None` means the delivery was already settled (duplicate, inbox
    /// failure).
    pub(super) async fn handle(&self, d: &Delivery) -> Option<Outcome> {
        let _slot = self.concurrency_slot().await;
        if !self.settler.claim(d).await {
            return None;
        }
        let outcome = match self.call((self.handler)(d.clone())).await {
            Ok(Ok(())) => Outcome::Done,
            Ok(Err(e)) => self.settler.failure(e),
            Err(outcome) => outcome,
        };
        if let Outcome::Failed { .. } = outcome {
            self.settler.abandon_claim(d).await;
        }
        Some(outcome)
    }
}

impl<F, Fut> Handling<F>
where
    F: Fn(Batch) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), BatchError>> + Send + 'static,
{
    /// Claim (with an inbox), call the batch handler once, settle every delivery.
    pub(super) async fn handle_batch(&self, deliveries: &Arc<Vec<Delivery>>) {
        let slot = self
            .settler
            .hard_stop
            .unless_fired(self.concurrency_slot())
            .await;
        let Some(_slot) = slot else {
            for d in deliveries.iter() {
                self.settler.release(d, Duration::ZERO).await;
            }
            return;
        };
        let batch = match &self.settler.inbox {
            None => deliveries.clone(),
            Some(_) => {
                let mut first = Vec::with_capacity(deliveries.len());
                for d in deliveries.iter() {
                    if self.settler.claim(d).await {
                        first.push(d.clone());
                    }
                }
                if first.is_empty() {
                    return;
                }
                Arc::new(first)
            }
        };
        let call = async {
            self.settler.metrics.batch_size.record(batch.len() as f64);
            self.call((self.handler)(Batch::new(batch.clone()))).await
        };
        let Some(result) = self.settler.hard_stop.unless_fired(call).await else {
            for d in batch.iter() {
                self.settler.abandon_claim(d).await;
                self.settler.release(d, Duration::ZERO).await;
            }
            return;
        };
        let failed: Vec<(usize, Outcome)> = match result {
            Ok(Ok(())) => Vec::new(),
            Ok(Err(BatchError(Failed::All(e)))) => {
                let outcome = self.settler.failure(e);
                (0..batch.len()).map(|i| (i, outcome.clone())).collect()
            }
            Err(outcome) => (0..batch.len()).map(|i| (i, outcome.clone())).collect(),
            Ok(Err(BatchError(Failed::Some(list)))) => {
                let mut named = vec![false; batch.len()];
                let mut failed = Vec::with_capacity(list.len());
                for (i, e) in list {
                    match named.get_mut(i) {
                        None => tracing::error!(
                            index = i,
                            size = batch.len(),
                            "the batch handler named a failed delivery outside the batch; ignored"
                        ),
                        // Named twice: the first error counts.
                        Some(true) => {}
                        Some(seen) => {
                            *seen = true;
                            failed.push((i, self.settler.failure(e)));
                        }
                    }
                }
                failed
            }
        };
        if failed.is_empty() {
            return self.settler.ack_done(&batch).await;
        }
        let mut is_failed = vec![false; batch.len()];
        failed.iter().for_each(|(i, _)| is_failed[*i] = true);
        let done: Vec<Delivery> = batch
            .iter()
            .zip(&is_failed)
            .filter(|(_, failed)| !**failed)
            .map(|(d, _)| d.clone())
            .collect();
        self.settler.ack_done(&done).await;
        // The failures settle concurrently: each may wait for a retry or DLQ confirm.
        let batch = &batch;
        futures::future::join_all(failed.into_iter().map(|(i, outcome)| async move {
            let d = &batch[i];
            if let Outcome::Failed { .. } = outcome {
                self.settler.abandon_claim(d).await;
            }
            self.settler.settle(d, outcome).await;
        }))
        .await;
    }
}
