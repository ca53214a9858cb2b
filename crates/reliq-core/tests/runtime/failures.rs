//! Failure handling: handler timeouts, unknown errors, custom classification, the discard
//! route, replay filters, and a handler's duplicate marker.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use reliq_core::{
    BoxError, Classifier, Consumer, DeadLetterReason, Delivery, Destination, ErrorClass,
    FinalRoute, Message, RetryPolicy, Subscription,
};
use reliq_memory::MemoryBroker;

use crate::support::{dead_letters, secs, wait_for};

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

#[tokio::test(start_paused = true)]
async fn replay_filters_by_class_reason_time_and_limit() {
    use reliq_core::{Broker, DeadLetterFilter, ErrorClass, Replay};
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
        .filter(DeadLetterFilter::default().since(later))
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
            DeadLetterFilter::default()
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
            DeadLetterFilter::default()
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

/// A replay cancelled midway stops sending, still removes what was confirmed, says it was
/// cancelled, and leaves every other dead letter in the DLQ: replayed + left = all.
#[tokio::test]
async fn a_cancelled_replay_removes_what_went_and_leaves_the_rest() {
    use reliq_core::Replay;
    let (broker, shared, sub) = parked(300).await;
    let cancel = tokio_util::sync::CancellationToken::new();
    let stop = cancel.clone();
    let seen = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let progress = seen.clone();
    // 100/s: cancelled after about half a second, some 50 copies in.
    let run = Replay::new(shared.clone(), sub.clone())
        .rate_limit(100)
        .cancel_on(cancel)
        .on_progress(move |p| progress.store(p.done, std::sync::atomic::Ordering::Relaxed))
        .execute();
    let started = std::time::Instant::now();
    let canceller = async {
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        stop.cancel();
        started.elapsed()
    };
    let (report, cancelled_at) = tokio::join!(run, canceller);
    let report = report.unwrap();
    assert!(report.cancelled, "{report:?}");
    let replayed = report.replayed.len();
    // What the rate let through until the cancel (its burst is a tenth of a second's
    // worth), and a few copies in flight — not one more copy per lane waiting on the
    // rate limit (there are 256 lanes).
    let allowed = (cancelled_at.as_secs_f64() * 100.0) as usize + 10 + 5;
    assert!(
        (10..=allowed).contains(&replayed),
        "{replayed} replayed before the cancel at {cancelled_at:?} (at most {allowed})"
    );
    assert!(report.failed.is_empty(), "{:?}", report.failed);
    assert_eq!(
        broker.dead_letter_depth(&sub) + replayed,
        300,
        "what was not replayed is still in the DLQ"
    );
    assert_eq!(
        seen.load(std::sync::atomic::Ordering::Relaxed),
        replayed,
        "the last progress"
    );
}

/// `n` dead letters of consumer `c` on `t` in a fresh embedded broker (the consumer shut
/// down): the broker, as the engine takes it, and the subscription.
async fn parked(n: usize) -> (MemoryBroker, Arc<dyn reliq_core::Broker>, Subscription) {
    use reliq_core::Broker;
    let broker = MemoryBroker::new();
    let shared: Arc<dyn Broker> = Arc::new(broker.clone());
    let h = Consumer::builder(shared.clone(), "c")
        .subscribe("t")
        .start(|_d: Delivery| async move {
            Err::<(), BoxError>(reliq_core::Permanent::msg("rejected").into())
        })
        .await
        .unwrap();
    for i in 0..n {
        shared
            .publish(&Destination::new("t"), Message::new(format!("m{i}")))
            .await
            .unwrap();
    }
    wait_for("the dead letters", || h.stats().dead_lettered == n as u64).await;
    h.shutdown().await;
    (broker, shared, Subscription::new("c", "t"))
}

/// A ramp from 10/s to 200/s over 2 s: 100 copies take about 1.35 s (10t + 47.5t² =
/// 100) — far less than 10 s at the starting rate, more than 0.5 s at the top one.
#[tokio::test]
async fn a_ramped_replay_starts_slow_and_speeds_up() {
    use reliq_core::Replay;
    let (broker, shared, sub) = parked(100).await;
    let report = Replay::new(shared, sub.clone())
        .rate_limit(200)
        .ramp(10, std::time::Duration::from_secs(2))
        .execute()
        .await
        .unwrap();
    assert_eq!(report.replayed.len(), 100, "{report:?}");
    assert_eq!(broker.dead_letter_depth(&sub), 0);
    let took = report.publishing.as_secs_f64();
    assert!(
        (1.0..3.0).contains(&took),
        "100 copies ramped 10→200/s over 2 s took {took:.2} s (about 1.35 s expected)"
    );
}

/// A guard that says no on its third check stops the run: the report says why, the run
/// is cancelled, and what it did not send is still in the DLQ.
#[tokio::test]
async fn a_replay_stops_when_its_guard_says_no() {
    use reliq_core::{Replay, ReplayGuard};
    struct ThirdTime(AtomicU32);
    #[async_trait::async_trait]
    impl ReplayGuard for ThirdTime {
        async fn check(&self) -> Result<(), String> {
            if self.0.fetch_add(1, Ordering::SeqCst) >= 2 {
                Err("the consumer fails again".into())
            } else {
                Ok(())
            }
        }
    }
    let (broker, shared, sub) = parked(300).await;
    let report = Replay::new(shared, sub.clone())
        .rate_limit(100)
        .guard(
            std::time::Duration::from_millis(200),
            Arc::new(ThirdTime(AtomicU32::new(0))),
        )
        .execute()
        .await
        .unwrap();
    assert_eq!(report.stopped.as_deref(), Some("the consumer fails again"));
    assert!(report.cancelled, "{report:?}");
    let replayed = report.replayed.len();
    // Stopped at the third check, 0.6 s in: some 60 copies at 100/s.
    assert!((20..150).contains(&replayed), "{replayed} replayed");
    assert_eq!(broker.dead_letter_depth(&sub) + replayed, 300);
}

/// One breaker shared by two consumers that call the same downstream: the failures of
/// one open it, and the other stops receiving too — its messages wait in the broker (no
/// handler call) until the cool-down ends; both handle everything once it closes.
#[tokio::test(start_paused = true)]
async fn a_shared_breaker_stops_every_consumer_that_uses_it() {
    use reliq_core::{Broker, CircuitBreaker, CircuitState};
    use std::sync::atomic::AtomicBool;
    let broker = MemoryBroker::new();
    let down = Arc::new(AtomicBool::new(true));
    let breaker = CircuitBreaker::new("shared-db")
        .minimum_calls(5)
        .cool_down(secs(30))
        .probes(1);
    let start = |name: &'static str, topic: &'static str, fails: bool| {
        let calls = Arc::new(AtomicU32::new(0));
        let (c, down) = (calls.clone(), down.clone());
        let consumer = Consumer::builder(Arc::new(broker.clone()), name)
            .subscribe(topic)
            .retry(RetryPolicy::tiers([secs(1)]).max_attempts(5))
            .max_in_flight(2)
            .circuit_breaker(breaker.clone())
            .start(move |_d: Delivery| {
                let (c, down) = (c.clone(), down.clone());
                async move {
                    c.fetch_add(1, Ordering::SeqCst);
                    if fails && down.load(Ordering::SeqCst) {
                        return Err::<(), BoxError>(reliq_core::Transient::msg("db down").into());
                    }
                    Ok(())
                }
            });
        (consumer, calls)
    };
    let (a, a_calls) = start("writer", "a", true);
    let (b, b_calls) = start("reader", "b", false);
    let (a, b) = (a.await.unwrap(), b.await.unwrap());
    for i in 0..10 {
        broker
            .publish(&Destination::new("a"), Message::new(format!("a-{i}")))
            .await
            .unwrap();
    }
    wait_for("the breaker opens", || {
        breaker.state() == CircuitState::Open
    })
    .await;
    assert_eq!(
        b.circuit_state(),
        Some(CircuitState::Open),
        "the same breaker"
    );
    for i in 0..10 {
        broker
            .publish(&Destination::new("b"), Message::new(format!("b-{i}")))
            .await
            .unwrap();
    }
    tokio::time::sleep(secs(20)).await;
    assert_eq!(
        b_calls.load(Ordering::SeqCst),
        0,
        "the other consumer waits too"
    );
    down.store(false, Ordering::SeqCst);
    wait_for("both handled everything", || {
        a.stats().processed == 10 && b.stats().processed == 10
    })
    .await;
    assert_eq!(breaker.state(), CircuitState::Closed);
    assert_eq!(b_calls.load(Ordering::SeqCst), 10);
    assert!(
        a_calls.load(Ordering::SeqCst) >= 15,
        "5 failures opened it, then 10 successes"
    );
    a.shutdown().await;
    b.shutdown().await;
}

/// A breaker `counting` only its downstream's errors: a handler whose every delivery
/// fails transiently with another downstream's error (a partner API timing out) leaves
/// it closed — those retry as usual — while the same share of its own downstream's
/// errors opens it.
#[tokio::test(start_paused = true)]
async fn a_breaker_counts_only_the_failures_it_is_told_to() {
    use reliq_core::{Broker, CircuitBreaker, CircuitState};
    let run = |error: &'static str| async move {
        let broker = MemoryBroker::new();
        let breaker = CircuitBreaker::new("db")
            .minimum_calls(5)
            .cool_down(secs(30))
            .probes(1)
            .counting(|e| e.to_string().contains("db down"));
        let consumer = Consumer::builder(Arc::new(broker.clone()), "c")
            .subscribe("t")
            .retry(RetryPolicy::tiers([secs(1)]).max_attempts(3))
            .max_in_flight(2)
            .circuit_breaker(breaker.clone())
            .start(move |_d: Delivery| async move {
                Err::<(), BoxError>(reliq_core::Transient::msg(error).into())
            })
            .await
            .unwrap();
        for i in 0..10 {
            broker
                .publish(&Destination::new("t"), Message::new(format!("m-{i}")))
                .await
                .unwrap();
        }
        wait_for("the retries are spent or the breaker opens", || {
            let st = consumer.stats();
            st.dead_lettered == 10 || breaker.state() == CircuitState::Open
        })
        .await;
        let state = breaker.state();
        let dead = consumer.stats().dead_lettered;
        consumer.shutdown().await;
        (state, dead)
    };
    assert_eq!(
        run("partner api timed out").await,
        (CircuitState::Closed, 10),
        "another downstream's failures: closed, every message retried and parked"
    );
    let (state, dead) = run("db down").await;
    assert_eq!(
        state,
        CircuitState::Open,
        "its own downstream's failures open it"
    );
    assert!(
        dead < 10,
        "opened before the retries were spent ({dead} parked)"
    );
}
