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
