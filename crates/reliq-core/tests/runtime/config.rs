//! Startup validation: a bad setting fails at start, naming the field.

use std::sync::Arc;

use reliq_core::{Batch, BatchError, BoxError, Consumer, ConsumerError, Delivery, RetryPolicy};
use reliq_memory::MemoryBroker;

use crate::support::secs;

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
            Consumer::builder(broker.clone(), "../../etc").subscribe("t"),
            "name",
        ),
        (
            Consumer::builder(broker.clone(), "c").subscribe("orders.>"),
            "subscribe",
        ),
        (
            Consumer::builder(broker.clone(), "c".repeat(101)).subscribe("t"),
            "name",
        ),
        (
            Consumer::builder(broker.clone(), "c")
                .subscribe("t")
                .rate_limit(0, 5),
            "rate_limit",
        ),
        (
            Consumer::builder(broker.clone(), "c")
                .subscribe("t")
                .rate_limit(10, 0),
            "rate_limit",
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
        let err = builder.start_batch(ok).await.expect_err("accepted");
        assert!(matches!(err, ConsumerError::Config { .. }), "{err:?}");
        assert!(
            err.to_string().contains(field),
            "`{err}` does not name `{field}`"
        );
    }
}

/// The start-up topology check: a group the broker keeps with a delivery limit of 5
/// (its first subscription's), started again with 9. `Refuse` fails `start` naming the
/// delivery limit (and handles nothing); `Warn` starts; both set
/// `reliq_topology_drift{severity="breaking"}` to 1; `Off` starts without checking.
#[tokio::test(start_paused = true)]
async fn startup_topology_check_refuses_or_warns_on_drift() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};
    use reliq_core::{ConsumerError, StartupCheck};
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder.install().unwrap();
    let broker = Arc::new(reliq_memory::MemoryBroker::new());
    let start = |limit: u32, check: StartupCheck| {
        Consumer::builder(broker.clone(), "drifted")
            .subscribe("t")
            .delivery_limit(limit)
            .check_topology(check)
            .start(|_d: Delivery| async { Ok::<(), BoxError>(()) })
    };
    let first = start(5, StartupCheck::Refuse).await.expect("as planned");
    first.shutdown().await;

    let Err(refused) = start(9, StartupCheck::Refuse).await else {
        panic!("a breaking difference refuses the start");
    };
    let ConsumerError::Topology(report) = &refused else {
        panic!("a topology refusal: {refused}");
    };
    assert_eq!(report.drift.len(), 1, "{report}");
    assert_eq!(report.drift[0].setting(), Some("delivery limit"));
    assert!(
        refused
            .to_string()
            .contains("delivery limit wanted = 9, found 5"),
        "{refused}"
    );

    let warned = start(9, StartupCheck::Warn).await.expect("warn starts");
    warned.shutdown().await;
    start(9, StartupCheck::Off)
        .await
        .expect("off")
        .shutdown()
        .await;

    let breaking = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .find_map(|(key, _, _, v)| {
            let k = key.key();
            let labelled = k
                .labels()
                .any(|l| l.key() == "consumer" && l.value() == "drifted")
                && k.labels()
                    .any(|l| l.key() == "severity" && l.value() == "breaking");
            match v {
                DebugValue::Gauge(g) if k.name() == "reliq_topology_drift" && labelled => {
                    Some(g.into_inner())
                }
                _ => None,
            }
        });
    assert_eq!(breaking, Some(1.0));
}
