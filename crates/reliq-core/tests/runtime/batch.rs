//! Batch handlers: batch sizes, whole-batch and per-index failures, panics and timeouts,
//! the inbox, and the batch metrics.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use reliq_core::{
    Batch, BatchError, Consumer, DeadLetterReason, Destination, Message, RetryPolicy,
};
use reliq_memory::MemoryBroker;

use crate::support::{dead_letters, secs, wait_for};

/// A batch consumer on `t` with `handler`, after `n` messages were published (so the
/// first receive finds a backlog).
async fn batch_consumer<F, Fut>(
    broker: &MemoryBroker,
    n: usize,
    configure: impl FnOnce(reliq_core::ConsumerBuilder) -> reliq_core::ConsumerBuilder,
    handler: F,
) -> (reliq_core::ConsumerHandle, Vec<reliq_core::MessageId>)
where
    F: Fn(Batch) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<(), BatchError>> + Send + 'static,
{
    use reliq_core::Broker;
    let builder = Consumer::builder(Arc::new(broker.clone()), "c")
        .subscribe("t")
        .retry(RetryPolicy::tiers([secs(5)]).max_attempts(3))
        .max_in_flight(64);
    // Declare the consumer's queue before publishing, so the backlog waits for it.
    drop(
        broker
            .subscribe(&builder.subscription().unwrap())
            .await
            .unwrap(),
    );
    let mut ids = Vec::new();
    for i in 0..n {
        let m = Message::new(format!("m{i}"));
        ids.push(m.id().clone());
        broker.publish(&Destination::new("t"), m).await.unwrap();
    }
    let h = configure(builder).start_batch(handler).await.unwrap();
    (h, ids)
}

#[tokio::test(start_paused = true)]
async fn batch_handler_gets_the_backlog_in_batches_of_at_most_batch_size() {
    let broker = MemoryBroker::new();
    let sizes = Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = Arc::new(std::sync::Mutex::new(std::collections::HashSet::new()));
    let (s2, seen2) = (sizes.clone(), seen.clone());
    let (h, ids) = batch_consumer(
        &broker,
        500,
        |b| b.batch_size(50),
        move |batch: Batch| {
            s2.lock().unwrap().push(batch.len());
            let mut seen = seen2.lock().unwrap();
            for d in &batch {
                assert!(seen.insert(d.id().clone()), "{} handled twice", d.id());
            }
            async { Ok(()) }
        },
    )
    .await;
    wait_for("500 processed", || h.stats().processed == 500).await;
    let s = h.shutdown().await.stats;
    assert_eq!(
        (s.received, s.processed, s.retried, s.in_flight),
        (500, 500, 0, 0)
    );
    let sizes = sizes.lock().unwrap().clone();
    assert_eq!(sizes.iter().sum::<usize>(), 500);
    assert!(sizes.iter().all(|n| (1..=50).contains(n)), "{sizes:?}");
    assert!(
        sizes.len() <= 500 / 10,
        "a backlog should come in batches, got {} calls: {sizes:?}",
        sizes.len()
    );
    let seen = seen.lock().unwrap();
    assert!(ids.iter().all(|id| seen.contains(id)));
}

#[tokio::test(start_paused = true)]
async fn batch_error_all_retries_every_delivery_of_the_batch() {
    let broker = MemoryBroker::new();
    let (h, _) = batch_consumer(
        &broker,
        100,
        |b| b,
        |batch: Batch| {
            let first_try = batch.iter().any(|d| d.attempt() == 1);
            async move {
                if first_try {
                    return Err(BatchError::all(reliq_core::Transient::msg("db down")));
                }
                Ok(())
            }
        },
    )
    .await;
    wait_for("100 processed", || h.stats().processed == 100).await;
    let s = h.shutdown().await.stats;
    assert_eq!((s.retried, s.processed, s.dead_lettered), (100, 100, 0));
    assert!(dead_letters(&broker, "c", "t").await.is_empty());
}

#[tokio::test(start_paused = true)]
async fn batch_failures_by_index_take_the_failure_path_the_rest_is_acked() {
    let broker = MemoryBroker::new();
    // Every 10th message is permanent (DLQ); the handler also names an index outside the
    // batch and one index twice, which must change nothing.
    let (h, ids) = batch_consumer(
        &broker,
        100,
        |b| b,
        |batch: Batch| {
            let mut failed = BatchError::new();
            for (i, d) in batch.iter().enumerate() {
                let n: usize = d.text().unwrap()[1..].parse().unwrap();
                if n.is_multiple_of(10) {
                    failed.fail(i, reliq_core::Permanent::msg("bad sku"));
                    failed.fail(i, reliq_core::Transient::msg("named twice"));
                }
            }
            let failed = failed.with(batch.len() + 3, reliq_core::Permanent::msg("no such"));
            async move { Err(failed) }
        },
    )
    .await;
    wait_for("90 processed", || h.stats().processed == 90).await;
    wait_for("10 dead-lettered", || h.stats().dead_lettered == 10).await;
    let s = h.shutdown().await.stats;
    assert_eq!((s.retried, s.processed, s.dead_lettered), (0, 90, 10));
    let dead = dead_letters(&broker, "c", "t").await;
    let mut dead_ids: Vec<_> = dead.iter().map(|(d, _)| d.id().clone()).collect();
    let mut expected: Vec<_> = ids.iter().step_by(10).cloned().collect();
    dead_ids.sort();
    expected.sort();
    assert_eq!(dead_ids, expected);
    assert!(
        dead.iter()
            .all(|(_, r)| r.reason == DeadLetterReason::Permanent)
    );
}

#[tokio::test(start_paused = true)]
async fn batch_handler_panic_or_timeout_fails_the_whole_batch() {
    let broker = MemoryBroker::new();
    let (h, _) = batch_consumer(
        &broker,
        30,
        |b| b.handler_timeout(secs(1)),
        |batch: Batch| {
            let first = batch[0].attempt() == 1;
            let panics = batch[0].text().unwrap() == "m0";
            async move {
                if first && panics {
                    panic!("bug in batch code");
                }
                if first {
                    tokio::time::sleep(secs(60)).await; // past the handler timeout
                }
                Ok(())
            }
        },
    )
    .await;
    // The batch starting at m0 panics (panic → DLQ by default); every other batch times
    // out once (transient → retried) and then succeeds.
    wait_for("all settled", || {
        let s = h.stats();
        s.processed + s.dead_lettered == 30
    })
    .await;
    let s = h.shutdown().await.stats;
    let dead = dead_letters(&broker, "c", "t").await;
    assert_eq!(s.panics, 1);
    assert!(!dead.is_empty());
    assert!(
        dead.iter()
            .all(|(_, r)| r.reason == DeadLetterReason::Panic)
    );
    assert_eq!(s.dead_lettered as usize, dead.len());
    assert_eq!(
        s.retried, s.processed,
        "every other message timed out once: {s:?}"
    );
    assert_eq!(s.processed + s.dead_lettered, 30);
}

#[tokio::test(start_paused = true)]
async fn batch_handler_with_an_inbox_skips_duplicates() {
    use reliq_core::Broker;
    let broker = MemoryBroker::new();
    let inbox = Arc::new(reliq_core::MemoryInbox::new());
    let handled = Arc::new(AtomicU32::new(0));
    let h2 = handled.clone();
    let (h, ids) = batch_consumer(
        &broker,
        20,
        |b| b.inbox(inbox.clone()),
        move |batch: Batch| {
            h2.fetch_add(batch.len() as u32, Ordering::Relaxed);
            async { Ok(()) }
        },
    )
    .await;
    wait_for("20 processed", || h.stats().processed == 20).await;
    // The same 20 ids again (a producer retry, a replay): acknowledged, not handled.
    for id in &ids {
        broker
            .publish(
                &Destination::new("t"),
                Message::with_id_and_payload(id.clone(), "again"),
            )
            .await
            .unwrap();
    }
    wait_for("20 duplicates", || h.stats().duplicates == 20).await;
    let s = h.shutdown().await.stats;
    assert_eq!((s.processed, s.duplicates), (20, 20));
    assert_eq!(handled.load(Ordering::Relaxed), 20);
    assert_eq!(inbox.completed("c"), 20);
}

#[tokio::test(start_paused = true)]
async fn batch_calls_record_their_size_and_one_duration_each() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder.install().unwrap();
    let broker = MemoryBroker::new();
    let calls = Arc::new(AtomicU32::new(0));
    let c = calls.clone();
    let (h, _) = batch_consumer(
        &broker,
        300,
        |b| b.batch_size(40),
        move |_batch: Batch| {
            c.fetch_add(1, Ordering::Relaxed);
            async { Ok(()) }
        },
    )
    .await;
    wait_for("300 processed", || h.stats().processed == 300).await;
    h.shutdown().await;
    let snapshot = snapshotter.snapshot().into_vec();
    let observations = |name: &str| -> Vec<f64> {
        snapshot
            .iter()
            .find_map(|(key, _, _, v)| match v {
                DebugValue::Histogram(xs) if key.key().name() == name => {
                    Some(xs.iter().map(|x| x.into_inner()).collect())
                }
                _ => None,
            })
            .unwrap_or_default()
    };
    let sizes = observations("reliq_batch_size");
    let calls = calls.load(Ordering::Relaxed) as usize;
    assert_eq!(sizes.len(), calls, "one size per call");
    assert_eq!(sizes.iter().sum::<f64>(), 300.0);
    assert!(sizes.iter().all(|n| (1.0..=40.0).contains(n)), "{sizes:?}");
    assert_eq!(observations("reliq_handler_duration_seconds").len(), calls);
}
