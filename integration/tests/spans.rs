//! Spans after OpenTelemetry's messaging conventions (`reliq_core::metrics`), exported
//! through `tracing-opentelemetry` to the SDK's in-memory exporter, on the embedded
//! broker and on RabbitMQ: one message published and failing transiently until its
//! budget runs out makes the chain `send` (producer) → `process` attempt 1 (consumer,
//! child of the send through the message's `traceparent`) → `settle` retry → `process`
//! attempt 2 (the retry copy carries the same context) → `settle` dead_letter, all in one
//! trace, with the conventions' names, kinds and attributes and reliq's own.

use std::time::Duration;

use anyhow::{Context as _, ensure};
use opentelemetry::trace::{SpanKind, TracerProvider as _};
use opentelemetry::{KeyValue, Value};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use reliq::{BoxError, Consumer, Delivery, Destination, Message, RetryPolicy, Transient};
use reliq_integration::settings;
use tracing_subscriber::prelude::*;

/// Every span of the process goes to an in-memory exporter (one test per process:
/// nextest runs each test in its own).
fn export_to_memory() -> (InMemorySpanExporter, SdkTracerProvider) {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("reliq-spans-test"));
    let _ = tracing_subscriber::registry().with(layer).try_init();
    (exporter, provider)
}

fn attr<'a>(span: &'a SpanData, key: &str) -> Option<&'a Value> {
    span.attributes
        .iter()
        .find(|KeyValue { key: k, .. }| k.as_str() == key)
        .map(|kv| &kv.value)
}

fn text(span: &SpanData, key: &str) -> String {
    attr(span, key)
        .map(|v| v.as_str().into_owned())
        .unwrap_or_default()
}

async fn chain(url: &str, system: &str) -> anyhow::Result<()> {
    let (exporter, provider) = export_to_memory();
    let broker = reliq::connect(url).await?;
    let topic = format!("spans-{}", reliq::MessageId::generate());
    let handle = Consumer::builder(broker.clone(), "billing")
        .subscribe(topic.clone())
        .retry(RetryPolicy::tiers([Duration::from_millis(200)]).max_attempts(2))
        .start(|_d: Delivery| async {
            Err::<(), BoxError>(Transient::msg("inventory service unavailable").into())
        })
        .await?;
    let message = Message::new("order-1");
    let id = message.id().to_string();
    broker
        .publish(&Destination::new(topic.clone()), message)
        .await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while handle.stats().dead_lettered < 1 {
        ensure!(
            tokio::time::Instant::now() < deadline,
            "{:?}",
            handle.stats()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    handle.shutdown().await;
    provider.force_flush()?;
    let spans = exporter.get_finished_spans()?;
    let named =
        |name: String| -> Vec<&SpanData> { spans.iter().filter(|s| s.name == name).collect() };

    let sends = named(format!("send {topic}"));
    ensure!(sends.len() == 1, "send spans: {sends:?}");
    let send = sends[0];
    ensure!(send.span_kind == SpanKind::Producer);
    for (key, want) in [
        ("messaging.system", system),
        ("messaging.destination.name", topic.as_str()),
        ("messaging.operation.type", "send"),
        ("messaging.message.id", id.as_str()),
    ] {
        ensure!(text(send, key) == want, "send {key}: {:?}", attr(send, key));
    }
    let trace = send.span_context.trace_id();

    let mut processes = named(format!("process {topic}"));
    processes.sort_by_key(|s| s.start_time);
    ensure!(processes.len() == 2, "process spans: {processes:#?}");
    for (attempt, (p, decision)) in processes.iter().zip(["retry", "dead_letter"]).enumerate() {
        ensure!(p.span_kind == SpanKind::Consumer, "{p:?}");
        ensure!(
            p.span_context.trace_id() == trace && p.parent_span_id == send.span_context.span_id(),
            "attempt {} is not a child of the send span: {p:?}",
            attempt + 1
        );
        for (key, want) in [
            ("messaging.system", system),
            ("messaging.destination.name", topic.as_str()),
            ("messaging.consumer.group.name", "billing"),
            ("messaging.operation.type", "process"),
            ("messaging.message.id", id.as_str()),
            ("reliq.decision", decision),
            ("reliq.error.class", "transient"),
            ("error.type", "transient"),
        ] {
            ensure!(text(p, key) == want, "process {key}: {:?}", attr(p, key));
        }
        ensure!(
            attr(p, "reliq.attempt") == Some(&Value::I64(attempt as i64 + 1)),
            "reliq.attempt: {:?}",
            attr(p, "reliq.attempt")
        );
    }
    ensure!(text(processes[1], "reliq.dead_letter.reason") == "exhausted");

    let settles = named(format!("settle {topic}"));
    for (p, operation) in processes.iter().zip(["retry", "dead_letter"]) {
        let s = settles
            .iter()
            .find(|s| s.parent_span_id == p.span_context.span_id())
            .with_context(|| {
                format!("no settle span under the {operation} attempt: {settles:#?}")
            })?;
        ensure!(s.span_kind == SpanKind::Client, "{s:?}");
        ensure!(s.span_context.trace_id() == trace);
        for (key, want) in [
            ("messaging.operation.type", "settle"),
            ("messaging.operation.name", operation),
            ("messaging.message.id", id.as_str()),
            ("messaging.consumer.group.name", "billing"),
        ] {
            ensure!(text(s, key) == want, "settle {key}: {:?}", attr(s, key));
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_failure_chain_is_one_trace_on_the_embedded_broker() -> anyhow::Result<()> {
    chain("memory://spans", "reliq_memory").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_failure_chain_is_one_trace_on_rabbitmq() -> anyhow::Result<()> {
    chain(&settings::get("RELIQ_RABBIT_URL"), "rabbitmq").await
}
