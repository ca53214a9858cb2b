//! Runtime behaviour beyond the portable suite, on the memory backend (virtual time):
//! handler timeouts, unknown errors, custom classification, the discard route, startup
//! validation that names the bad setting, the metrics contract, a backend breaking the
//! `receive_batch` contract, batch handlers, and the acks of deliveries handled together.

// Test code: a failed unwrap is a failed test, in helpers as in #[test] functions.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use reliq_core::{
    Batch, BatchError, BoxError, Classifier, Consumer, ConsumerError, DeadLetter, DeadLetterReason,
    Delivery, Destination, ErrorClass, FinalRoute, Message, RetryPolicy, Subscription,
};
use reliq_memory::MemoryBroker;

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

async fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + secs(600);
    while !cond() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn dead_letters(
    broker: &MemoryBroker,
    consumer: &str,
    topic: &str,
) -> Vec<(reliq_core::Message, DeadLetter)> {
    use reliq_core::Broker;
    let dlq = broker
        .dead_letters(&Subscription::new(consumer, topic))
        .await
        .unwrap();
    let entries = reliq_conformance::browse_all(dlq.as_ref()).await.unwrap();
    let ids: Vec<_> = entries.iter().map(|e| e.id().clone()).collect();
    assert_eq!(dlq.remove(&ids).await.unwrap().len(), ids.len());
    entries
        .into_iter()
        .map(|e| {
            let r = e.record().unwrap();
            (e.message, r)
        })
        .collect()
}

#[tokio::test(start_paused = true)]
async fn handler_timeout_is_transient_and_retried() {
    use reliq_core::Broker;
    let broker = MemoryBroker::new();
    let calls = Arc::new(AtomicU32::new(0));
    let c = calls.clone();
    let h = Consumer::builder(Arc::new(broker.clone()), "c")
        .subscribe("t")
        .retry(RetryPolicy::tiers([secs(5)]).max_attempts(3))
        .handler_timeout(secs(1))
        .start(move |d: Delivery| {
            let c = c.clone();
            async move {
                c.fetch_add(1, Ordering::Relaxed);
                if d.attempt() == 1 {
                    tokio::time::sleep(secs(60)).await; // hangs past the timeout
                }
                Ok::<(), BoxError>(())
            }
        })
        .await
        .unwrap();
    broker
        .publish(&Destination::new("t"), Message::new("x"))
        .await
        .unwrap();
    wait_for("processed on the retry", || h.stats().processed == 1).await;
    let s = h.shutdown().await.stats;
    assert_eq!(
        (s.retried, s.processed, calls.load(Ordering::Relaxed)),
        (1, 1, 2)
    );
}

#[tokio::test(start_paused = true)]
async fn unknown_errors_get_the_small_budget_then_park() {
    use reliq_core::Broker;
    let broker = MemoryBroker::new();
    let h = Consumer::builder(Arc::new(broker.clone()), "c")
        .subscribe("t")
        .retry(
            RetryPolicy::tiers([secs(1)])
                .max_attempts(10)
                .unknown_max_attempts(2),
        )
        .start(|_d: Delivery| async move { Err::<(), BoxError>("something odd".into()) })
        .await
        .unwrap();
    broker
        .publish(&Destination::new("t"), Message::new("x"))
        .await
        .unwrap();
    wait_for("dead-lettered", || h.stats().dead_lettered == 1).await;
    h.shutdown().await;
    let dead = dead_letters(&broker, "c", "t").await;
    assert_eq!(dead.len(), 1);
    let r = &dead[0].1;
    assert_eq!(
        (r.reason, r.error_class, r.attempts),
        (DeadLetterReason::Exhausted, Some(ErrorClass::Unknown), 2)
    );
}

#[derive(Debug)]
struct NotFound;
impl std::fmt::Display for NotFound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("row not found")
    }
}
impl std::error::Error for NotFound {}

#[tokio::test(start_paused = true)]
async fn registered_rules_classify_library_errors() {
    use reliq_core::Broker;
    let broker = MemoryBroker::new();
    let calls = Arc::new(AtomicU32::new(0));
    let c = calls.clone();
    let h = Consumer::builder(Arc::new(broker.clone()), "c")
        .subscribe("t")
        .classifier(Classifier::default().on::<NotFound>(|_| ErrorClass::Permanent))
        .start(move |_d: Delivery| {
            let c = c.clone();
            async move {
                c.fetch_add(1, Ordering::Relaxed);
                Err::<(), BoxError>(Box::new(NotFound))
            }
        })
        .await
        .unwrap();
    broker
        .publish(&Destination::new("t"), Message::new("x"))
        .await
        .unwrap();
    wait_for("dead-lettered", || h.stats().dead_lettered == 1).await;
    h.shutdown().await;
    assert_eq!(calls.load(Ordering::Relaxed), 1, "permanent: no retry");
    assert_eq!(
        dead_letters(&broker, "c", "t").await[0].1.reason,
        DeadLetterReason::Permanent
    );
}

#[tokio::test(start_paused = true)]
async fn discard_route_acks_and_counts_without_a_dlq_copy() {
    use reliq_core::Broker;
    let broker = MemoryBroker::new();
    let h = Consumer::builder(Arc::new(broker.clone()), "c")
        .subscribe("t")
        .retry(RetryPolicy::no_retry().final_route(FinalRoute::Discard))
        .start(|d: Delivery| async move {
            let _: u32 = d.json()?;
            Ok::<(), BoxError>(())
        })
        .await
        .unwrap();
    broker
        .publish(&Destination::new("t"), Message::new("not json"))
        .await
        .unwrap();
    wait_for("discarded", || h.stats().discarded == 1).await;
    h.shutdown().await;
    assert!(dead_letters(&broker, "c", "t").await.is_empty());
    assert_eq!(
        broker.depth(&Subscription::new("c", "t")),
        (0, 0),
        "acked, not left behind"
    );
}

#[tokio::test]
async fn bad_config_fails_at_startup_naming_the_field() {
    let broker = Arc::new(MemoryBroker::new());
    let ok = |_d: Delivery| async move { Ok::<(), BoxError>(()) };
    let cases: Vec<(reliq_core::ConsumerBuilder, &str)> = vec![
        (Consumer::builder(broker.clone(), "c"), "subscribe"),
        (
            Consumer::builder(broker.clone(), "c")
                .subscribe("t")
                .max_in_flight(0),
            "max_in_flight",
        ),
        (
            Consumer::builder(broker.clone(), "c")
                .subscribe("t")
                .concurrency(0),
            "concurrency",
        ),
        (
            Consumer::builder(broker.clone(), " ").subscribe("t"),
            "name",
        ),
        (
            Consumer::builder(broker.clone(), "c")
                .subscribe("t")
                .retry(RetryPolicy::tiers([secs(1)]).max_attempts(5))
                .delivery_limit(5),
            "delivery_limit",
        ),
        (
            Consumer::builder(broker.clone(), "c")
                .subscribe("t")
                .retry(RetryPolicy::tiers([secs(13 * 3600)])),
            "retry.tiers",
        ),
        (
            Consumer::builder(broker.clone(), "c")
                .subscribe("t")
                .retry(RetryPolicy::default().jitter(1.5)),
            "retry.jitter",
        ),
    ];
    for (builder, field) in cases {
        let err = builder
            .start(ok)
            .await
            .err()
            .unwrap_or_else(|| panic!("{field}: accepted"));
        assert!(
            matches!(err, ConsumerError::Config { .. } | ConsumerError::Policy(_)),
            "{err:?}"
        );
        assert!(
            err.to_string().contains(field),
            "`{err}` does not name `{field}`"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn metrics_follow_the_documented_names() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};
    use reliq_core::Broker;
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder.install().unwrap();

    let broker = MemoryBroker::new();
    let h = Consumer::builder(Arc::new(broker.clone()), "metered")
        .subscribe("t")
        .retry(RetryPolicy::tiers([secs(1)]).max_attempts(2))
        .start(|d: Delivery| async move {
            match d.payload() {
                b"poison" => Err(reliq_core::Poison::msg("bad").into()),
                b"flaky" if d.attempt() == 1 => Err(reliq_core::Transient::msg("later").into()),
                _ => Ok::<(), BoxError>(()),
            }
        })
        .await
        .unwrap();
    for p in ["ok", "poison", "flaky"] {
        broker
            .publish(&Destination::new("t"), Message::new(p))
            .await
            .unwrap();
    }
    wait_for("all settled", || {
        let s = h.stats();
        s.processed == 2 && s.dead_lettered == 1
    })
    .await;
    h.shutdown().await;

    // One snapshot: taking one resets the debugging recorder's counters.
    let snapshot = snapshotter.snapshot().into_vec();
    let value = |name: &str, label: Option<(&str, &str)>| -> Option<u64> {
        snapshot.iter().find_map(|(key, _, _, v)| {
            let k = key.key();
            let labels_ok = k
                .labels()
                .any(|l| l.key() == "consumer" && l.value() == "metered")
                && label
                    .is_none_or(|(lk, lv)| k.labels().any(|l| l.key() == lk && l.value() == lv));
            match v {
                DebugValue::Counter(n) if k.name() == name && labels_ok => Some(*n),
                _ => None,
            }
        })
    };
    assert_eq!(value("reliq_messages_received_total", None), Some(4));
    assert_eq!(value("reliq_messages_processed_total", None), Some(2));
    assert_eq!(
        value("reliq_messages_retried_total", Some(("class", "transient"))),
        Some(1)
    );
    assert_eq!(
        value(
            "reliq_messages_dead_lettered_total",
            Some(("reason", "poison"))
        ),
        Some(1)
    );
    assert_eq!(
        value(
            "reliq_settle_failures_total",
            Some(("operation", "dead_letter"))
        ),
        Some(0)
    );
}

#[tokio::test(start_paused = true)]
async fn replay_filters_by_class_reason_time_and_limit() {
    use reliq_core::{Broker, ErrorClass, Replay, ReplayFilter};
    let broker = MemoryBroker::new();
    let shared: Arc<dyn Broker> = Arc::new(broker.clone());
    let h = Consumer::builder(shared.clone(), "c")
        .subscribe("t")
        .start(|d: Delivery| async move {
            match d.payload() {
                b"bad" => Err::<(), BoxError>(reliq_core::Poison::msg("undecodable").into()),
                _ => Err(reliq_core::Permanent::msg("rejected").into()),
            }
        })
        .await
        .unwrap();
    for p in ["p1", "p2", "p3", "bad", "bad"] {
        shared
            .publish(&Destination::new("t"), Message::new(p))
            .await
            .unwrap();
    }
    wait_for("five dead letters", || h.stats().dead_lettered == 5).await;
    h.shutdown().await;
    let sub = Subscription::new("c", "t");
    let later = reliq_core::Clock::new().now() + secs(3600);

    let nothing = Replay::new(shared.clone(), sub.clone())
        .filter(ReplayFilter::default().since(later))
        .dry_run()
        .await
        .unwrap();
    assert_eq!(
        (nothing.scanned, nothing.matched.len()),
        (5, 0),
        "since excludes all"
    );

    let plan = Replay::new(shared.clone(), sub.clone())
        .filter(
            ReplayFilter::default()
                .classes([ErrorClass::Permanent])
                .until(later),
        )
        .dry_run()
        .await
        .unwrap();
    assert_eq!(plan.matched.len(), 3);
    assert!(
        plan.matched
            .iter()
            .all(|e| e.record.reason == DeadLetterReason::Permanent)
    );
    assert_eq!(broker.dead_letter_depth(&sub), 5, "a dry run moves nothing");

    let done = Replay::new(shared.clone(), sub.clone())
        .filter(
            ReplayFilter::default()
                .reasons([DeadLetterReason::Poison])
                .limit(1),
        )
        .execute()
        .await
        .unwrap();
    assert_eq!((done.matched.len(), done.replayed.len()), (1, 1), "limit 1");
    assert_eq!(
        broker.dead_letter_depth(&sub),
        4,
        "only the replayed copy left the DLQ"
    );
    assert_eq!(
        broker.depth(&sub).0,
        1,
        "the replayed copy waits in the consumer's queue"
    );
}

#[derive(Debug, thiserror::Error)]
#[error("reserving stock")]
struct Reserve(#[source] reliq_core::Duplicate);

#[tokio::test(start_paused = true)]
async fn handler_duplicate_marker_acks_skips_and_counts() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};
    use reliq_core::Broker;
    use std::collections::HashSet;
    use std::sync::Mutex;
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder.install().unwrap();

    // The handler's own "transactional" store: a set of applied ids.
    let applied = Arc::new(Mutex::new(HashSet::new()));
    let calls = Arc::new(AtomicU32::new(0));
    let broker = MemoryBroker::new();
    let (a, c) = (applied.clone(), calls.clone());
    let h = Consumer::builder(Arc::new(broker.clone()), "dedup")
        .subscribe("t")
        .retry(RetryPolicy::tiers([secs(1)]).max_attempts(3))
        .start(move |d: Delivery| {
            let (a, c) = (a.clone(), c.clone());
            async move {
                c.fetch_add(1, Ordering::SeqCst);
                let first = a.lock().unwrap().insert(d.id().clone());
                let claim = if first {
                    reliq_core::Claim::First
                } else {
                    reliq_core::Claim::Duplicate
                };
                match (claim.first_or_skip(), d.payload()) {
                    (Ok(()), _) => Ok(()),
                    // Wrapped in the handler's own error: found through `source()`.
                    (Err(dup), b"wrapped") => Err(Box::new(Reserve(dup)) as BoxError),
                    (Err(dup), _) => Err(dup.into()),
                }
            }
        })
        .await
        .unwrap();
    for payload in ["plain", "plain", "wrapped"] {
        let m = Message::with_id_and_payload("same-id", payload);
        broker.publish(&Destination::new("t"), m).await.unwrap();
    }
    wait_for("all settled", || {
        let s = h.stats();
        s.processed + s.duplicates == 3
    })
    .await;
    let stats = h.shutdown().await.stats;
    assert_eq!((stats.processed, stats.duplicates), (1, 2), "{stats:?}");
    assert_eq!(
        (stats.retried, stats.dead_lettered, stats.released),
        (0, 0, 0)
    );
    assert_eq!(calls.load(Ordering::SeqCst), 3, "no retry of a duplicate");
    let sub = Subscription::new("dedup", "t");
    assert_eq!(broker.depth(&sub), (0, 0), "duplicates were acknowledged");
    assert_eq!(broker.dead_letter_depth(&sub), 0);

    let snapshot = snapshotter.snapshot().into_vec();
    let duplicates = snapshot.iter().find_map(|(key, _, _, v)| {
        let k = key.key();
        let ours = k
            .labels()
            .any(|l| l.key() == "consumer" && l.value() == "dedup");
        match v {
            DebugValue::Counter(n) if k.name() == "reliq_messages_duplicate_total" && ours => {
                Some(*n)
            }
            _ => None,
        }
    });
    assert_eq!(duplicates, Some(2));
}

/// A backend that breaks the `receive_batch` contract (returns more deliveries than
/// asked for): the runtime still handles and acknowledges every one — a delivery is never
/// dropped for lack of an in-flight permit.
#[tokio::test(start_paused = true)]
async fn a_backend_returning_more_than_asked_loses_nothing() {
    use reliq_core::Broker;
    let memory = Arc::new(MemoryBroker::new());
    let broker = Arc::new(Misbehaving {
        inner: memory.clone(),
        how: How::Greedy,
    });
    let builder = Consumer::builder(broker.clone(), "greedy")
        .subscribe("orders")
        .max_in_flight(4)
        // A dropped delivery would come back only after its lease: far past the wait.
        .lease(Duration::from_secs(3600));
    // Declare the queue, then fill it: the first batch finds 20 waiting.
    drop(
        broker
            .subscribe(&builder.subscription().unwrap())
            .await
            .unwrap(),
    );
    for i in 0..20 {
        broker
            .publish(&Destination::new("orders"), Message::new(format!("{i}")))
            .await
            .unwrap();
    }
    let handled = Arc::new(AtomicU32::new(0));
    let h = handled.clone();
    let consumer = builder
        .start(move |_d: Delivery| {
            let h = h.clone();
            async move {
                h.fetch_add(1, Ordering::Relaxed);
                Ok::<(), BoxError>(())
            }
        })
        .await
        .unwrap();
    wait_for("20 handled", || handled.load(Ordering::Relaxed) >= 20).await;
    let report = consumer.shutdown().await;
    assert_eq!(report.stats.processed, 20, "{:?}", report.stats);
    assert_eq!(report.stats.in_flight, 0, "{:?}", report.stats);
}

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

#[tokio::test]
async fn batch_config_errors_name_the_field() {
    let broker = Arc::new(MemoryBroker::new());
    let ok = |_b: Batch| async move { Ok::<(), BatchError>(()) };
    let base = || {
        Consumer::builder(broker.clone(), "c")
            .subscribe("t")
            .max_in_flight(32)
    };
    for (builder, field) in [
        (base().batch_size(0), "batch_size"),
        (base().batch_size(33), "batch_size"),
        (
            base().ordering(reliq_core::DeliveryOrder::PerKey),
            "ordering",
        ),
    ] {
        let err = builder.start_batch(ok).await.err().expect("accepted");
        assert!(matches!(err, ConsumerError::Config { .. }), "{err:?}");
        assert!(
            err.to_string().contains(field),
            "`{err}` does not name `{field}`"
        );
    }
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

/// Deliveries handled together (one group of the per-message runtime) are acknowledged
/// as each pass over them finishes: one slow handler holds back neither the acks nor the
/// in-flight slots of the deliveries that finished beside it.
#[tokio::test(start_paused = true)]
async fn a_slow_delivery_does_not_hold_back_the_acks_of_its_group() {
    use reliq_core::Broker;
    let broker = MemoryBroker::new();
    let sub = Subscription::new("c", "t");
    // The backlog exists before the consumer starts, so one receive takes all ten and
    // they run side by side.
    drop(broker.subscribe(&sub).await.unwrap());
    for i in 0..10 {
        broker
            .publish(&Destination::new("t"), Message::new(format!("{i}")))
            .await
            .unwrap();
    }
    let t0 = tokio::time::Instant::now();
    let h = Consumer::builder(Arc::new(broker.clone()), "c")
        .subscribe("t")
        .max_in_flight(64)
        .start(|d: Delivery| async move {
            // Shorter than the memory broker's lease (30 s), past which it redelivers.
            if d.payload() == b"0" {
                tokio::time::sleep(secs(20)).await;
            }
            Ok::<(), BoxError>(())
        })
        .await
        .unwrap();
    wait_for("the nine fast deliveries acknowledged", || {
        h.stats().processed == 9
    })
    .await;
    assert!(
        t0.elapsed() < secs(1),
        "acknowledged only after {:?}: held back by the slow delivery",
        t0.elapsed()
    );
    assert_eq!(
        broker.depth(&sub),
        (0, 1),
        "only the slow delivery is still unacknowledged"
    );
    assert_eq!(
        h.stats().in_flight,
        1,
        "the nine freed their in-flight slots"
    );
    wait_for("the slow delivery acknowledged", || {
        h.stats().processed == 10
    })
    .await;
    assert!(t0.elapsed() >= secs(20));
    assert_eq!(h.stats().received, 10, "nothing redelivered");
    h.shutdown().await;
}

/// Every delivery's span carries its message id, attempt and the W3C trace context of its
/// `traceparent` header, for a subscriber that records spans (the id and the headers are
/// read only then: reading them may decode the message).
#[tokio::test]
async fn a_delivery_span_records_id_attempt_and_trace_context() {
    use std::collections::HashMap;
    use std::sync::Mutex;
    use tracing_subscriber::layer::{Context, SubscriberExt};

    type Fields = Arc<Mutex<HashMap<String, String>>>;
    struct Recording(Fields);
    impl tracing::field::Visit for Recording {
        fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
            let text = format!("{value:?}");
            let text = text.trim_matches('"').to_owned();
            self.0.lock().unwrap().insert(field.name().to_owned(), text);
        }
    }
    struct MessageSpans(Fields);
    impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for MessageSpans {
        fn on_new_span(
            &self,
            attrs: &tracing::span::Attributes<'_>,
            _: &tracing::span::Id,
            _: Context<'_, S>,
        ) {
            if attrs.metadata().name() == "reliq.message" {
                attrs.record(&mut Recording(self.0.clone()));
            }
        }
        fn on_record(
            &self,
            _: &tracing::span::Id,
            values: &tracing::span::Record<'_>,
            _: Context<'_, S>,
        ) {
            values.record(&mut Recording(self.0.clone()));
        }
    }

    let fields: Fields = Arc::default();
    let _guard = tracing::subscriber::set_default(
        tracing_subscriber::registry().with(MessageSpans(fields.clone())),
    );
    use reliq_core::Broker;
    let broker = MemoryBroker::new();
    let done = Arc::new(AtomicU32::new(0));
    let d2 = done.clone();
    let h = Consumer::builder(Arc::new(broker.clone()), "c")
        .subscribe("t")
        .start(move |_: Delivery| {
            d2.fetch_add(1, Ordering::SeqCst);
            async { Ok::<(), BoxError>(()) }
        })
        .await
        .unwrap();
    let m = Message::new("x").with_header(
        reliq_core::headers::TRACEPARENT,
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    );
    let id = m.id().to_string();
    broker.publish(&Destination::new("t"), m).await.unwrap();
    wait_for("handled", || done.load(Ordering::SeqCst) == 1).await;
    h.shutdown().await;
    let fields = fields.lock().unwrap().clone();
    assert_eq!(fields.get("message_id"), Some(&id), "{fields:?}");
    assert_eq!(
        fields.get("attempt").map(String::as_str),
        Some("1"),
        "{fields:?}"
    );
    assert_eq!(
        fields.get("trace_id").map(String::as_str),
        Some("4bf92f3577b34da6a3ce929d0e0e4736"),
        "{fields:?}"
    );
    assert_eq!(
        fields.get("parent_span_id").map(String::as_str),
        Some("00f067aa0ba902b7"),
        "{fields:?}"
    );
}

/// An inbox whose first `failures` claims fail (a database outage), then works.
struct OutageInbox {
    failures: AtomicU32,
    inner: reliq_core::MemoryInbox,
}

#[async_trait::async_trait]
impl reliq_core::Inbox for OutageInbox {
    async fn claim(
        &self,
        consumer: &str,
        id: &reliq_core::MessageId,
    ) -> Result<reliq_core::Claim, reliq_core::InboxError> {
        let down = self
            .failures
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if down {
            return Err(reliq_core::InboxError("database unavailable".into()));
        }
        self.inner.claim(consumer, id).await
    }
    async fn complete(
        &self,
        consumer: &str,
        id: &reliq_core::MessageId,
    ) -> Result<(), reliq_core::InboxError> {
        self.inner.complete(consumer, id).await
    }
    async fn abandon(
        &self,
        consumer: &str,
        id: &reliq_core::MessageId,
    ) -> Result<(), reliq_core::InboxError> {
        self.inner.abandon(consumer, id).await
    }
}

/// Six failed inbox claims, then 2,000 messages whose handlers all succeed: the settle
/// back-off ends with the first success, so the run takes about what the six released
/// deliveries' back-off needs (virtual seconds), not a pause before every receive (102 s
/// before the fix, with the back-off never reset by a plain success).
#[tokio::test(start_paused = true)]
async fn a_success_ends_the_settle_back_off() {
    let broker = Arc::new(MemoryBroker::new());
    let inbox = Arc::new(OutageInbox {
        failures: AtomicU32::new(6),
        inner: reliq_core::MemoryInbox::new(),
    });
    let builder = Consumer::builder(broker.clone(), "c")
        .subscribe("t")
        .inbox(inbox.clone())
        .settle_backoff(Duration::from_millis(100), secs(10));
    use reliq_core::Broker as _;
    drop(
        broker
            .subscribe(&builder.subscription().unwrap())
            .await
            .unwrap(),
    );
    let started = tokio::time::Instant::now();
    let h = builder
        .start(|_d: Delivery| async { Ok::<(), BoxError>(()) })
        .await
        .unwrap();
    for i in 0..2000 {
        broker
            .publish(&Destination::new("t"), Message::new(format!("{i}")))
            .await
            .unwrap();
        // Messages arrive over time, as they do in production: each receive finds a few.
        if i % 10 == 0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
    wait_for("2,000 processed", || h.stats().processed == 2000).await;
    let took = started.elapsed();
    let s = h.shutdown().await.stats;
    assert_eq!(inbox.failures.load(Ordering::SeqCst), 0);
    assert!(s.released >= 6, "{s:?}");
    assert!(
        took < secs(10),
        "2,000 healthy messages after 6 failed claims took {took:?} (virtual)"
    );
    assert!(s.throttled <= 12, "receives held back: {s:?}");
}

/// A receive the stop cuts short after it took a delivery from the broker: the runtime
/// releases that delivery at once instead of leaving it leased (on a broker with leases
/// it would wait for the lease to run out, and on NATS spend a delivery attempt).
#[tokio::test(start_paused = true)]
async fn shutdown_releases_what_a_cut_short_receive_took() {
    use reliq_core::Broker;
    let memory = Arc::new(MemoryBroker::new());
    let broker = Arc::new(Misbehaving {
        inner: memory.clone(),
        how: How::TakeOneThenHang,
    });
    let builder = Consumer::builder(broker.clone(), "c")
        .subscribe("t")
        .lease(Duration::from_secs(3600));
    let sub = builder.subscription().unwrap();
    drop(memory.subscribe(&sub).await.unwrap());
    memory
        .publish(&Destination::new("t"), Message::new("taken"))
        .await
        .unwrap();
    let h = builder
        .start(|_d: Delivery| async { Ok::<(), BoxError>(()) })
        .await
        .unwrap();
    wait_for("the delivery taken", || memory.depth(&sub) == (0, 1)).await;
    let s = h.shutdown().await.stats;
    assert_eq!((s.received, s.processed, s.released), (0, 0, 1), "{s:?}");
    assert_eq!(
        memory.depth(&sub),
        (1, 0),
        "released at shutdown, not left leased"
    );
}

/// How a [`Misbehaving`] backend's receivers bend the `receive_batch` contract.
#[derive(Clone, Copy)]
enum How {
    /// Ask the broker for three more than the runtime asked for (with a prefetch three
    /// higher, so it hands them out).
    Greedy,
    /// Take one delivery, then wait for more forever (a receive the stop cuts short).
    TakeOneThenHang,
}

/// The memory broker, with receivers that misbehave as `how` says.
struct Misbehaving {
    inner: Arc<MemoryBroker>,
    how: How,
}

struct MisbehavingReceiver {
    inner: Box<dyn reliq_core::Receiver>,
    how: How,
}

#[async_trait::async_trait]
impl reliq_core::Broker for Misbehaving {
    fn kind(&self) -> &'static str {
        "misbehaving"
    }
    fn capabilities(&self) -> reliq_core::Capabilities {
        self.inner.capabilities()
    }
    async fn publish(&self, d: &Destination, m: Message) -> Result<(), reliq_core::BrokerError> {
        self.inner.publish(d, m).await
    }
    async fn subscribe(
        &self,
        s: &Subscription,
    ) -> Result<Box<dyn reliq_core::Receiver>, reliq_core::BrokerError> {
        let mut s = s.clone();
        if let How::Greedy = self.how {
            // Room for the extra deliveries on the broker's side.
            s.prefetch += 3;
        }
        Ok(Box::new(MisbehavingReceiver {
            inner: self.inner.subscribe(&s).await?,
            how: self.how,
        }))
    }
    async fn dead_letters(
        &self,
        s: &Subscription,
    ) -> Result<Box<dyn reliq_core::DeadLetters>, reliq_core::BrokerError> {
        self.inner.dead_letters(s).await
    }
}

#[async_trait::async_trait]
impl reliq_core::Receiver for MisbehavingReceiver {
    async fn receive(&self) -> Result<Delivery, reliq_core::BrokerError> {
        self.inner.receive().await
    }
    async fn receive_batch(
        &self,
        max: usize,
        into: &mut Vec<Delivery>,
    ) -> Result<(), reliq_core::BrokerError> {
        match self.how {
            How::Greedy => self.inner.receive_batch(max + 3, into).await,
            How::TakeOneThenHang => {
                into.push(self.inner.receive().await?);
                std::future::pending::<()>().await;
                Ok(())
            }
        }
    }
    async fn ack(&self, d: &Delivery) -> Result<(), reliq_core::BrokerError> {
        self.inner.ack(d).await
    }
    async fn retry(
        &self,
        d: &Delivery,
        r: reliq_core::RetryRequest,
    ) -> Result<(), reliq_core::BrokerError> {
        self.inner.retry(d, r).await
    }
    async fn dead_letter(&self, d: &Delivery, m: Message) -> Result<(), reliq_core::BrokerError> {
        self.inner.dead_letter(d, m).await
    }
    async fn release(&self, d: &Delivery, delay: Duration) -> Result<(), reliq_core::BrokerError> {
        self.inner.release(d, delay).await
    }
}
