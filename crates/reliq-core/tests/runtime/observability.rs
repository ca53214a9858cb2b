//! The metrics contract and the delivery span.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use reliq_core::{BoxError, Consumer, Delivery, Destination, Message, RetryPolicy};
use reliq_memory::MemoryBroker;

use crate::support::{secs, wait_for};

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

/// Every delivery's `process <source>` span carries the messaging attributes, its message
/// id, attempt and decision, and the W3C trace context of its `traceparent` header, for a subscriber that records spans (the id and the headers are
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
            if attrs.metadata().name() == "process" {
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
        reliq_core::seam::headers::TRACEPARENT,
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    );
    let id = m.id().to_string();
    broker.publish(&Destination::new("t"), m).await.unwrap();
    wait_for("handled", || done.load(Ordering::SeqCst) == 1).await;
    h.shutdown().await;
    let fields = fields.lock().unwrap().clone();
    assert_eq!(fields.get("messaging.message.id"), Some(&id), "{fields:?}");
    assert_eq!(
        fields.get("reliq.attempt").map(String::as_str),
        Some("1"),
        "{fields:?}"
    );
    for (key, want) in [
        ("otel.name", "process t"),
        ("otel.kind", "consumer"),
        ("messaging.system", "reliq_memory"),
        ("messaging.destination.name", "t"),
        ("messaging.consumer.group.name", "c"),
        ("messaging.operation.type", "process"),
        ("reliq.decision", "ack"),
    ] {
        assert_eq!(
            fields.get(key).map(String::as_str),
            Some(want),
            "{key}: {fields:?}"
        );
    }
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
