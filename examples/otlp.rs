//! reliq's spans exported over OTLP/HTTP to an OpenTelemetry collector (Jaeger, Tempo,
//! the Collector; `http://127.0.0.1:4318` by default, or `OTEL_EXPORTER_OTLP_ENDPOINT`).
//!
//! A consumer on the embedded broker (or `--url`) receives a few orders; one fails
//! transiently until its budget runs out. The collector then shows, per order, one trace:
//! `send orders` (producer) → `process orders` (consumer, a child through the message's
//! `traceparent`) → `settle orders` — and for the failing one both attempts, the retry and
//! the dead-lettering, with the messaging attributes and reliq's own (`reliq.attempt`,
//! `reliq.decision`, …). The span names and attributes are listed in
//! `reliq_core::metrics`.
//!
//! Run: `cargo run -p reliq-examples --example otlp --features otel`.

use std::time::Duration;

use anyhow::Context as _;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{WithExportConfig as _, WithHttpConfig as _};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::SdkTracerProvider;
use reliq::{BoxError, Consumer, Delivery, Destination, Message, RetryPolicy, Transient};
use tracing_subscriber::prelude::*;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let url = std::env::args()
        .skip_while(|a| a != "--url")
        .nth(1)
        .unwrap_or_else(|| "memory://otlp".to_owned());
    let endpoint = std::env::var("OTEL_EXPORTER_OTLP_ENDPOINT")
        .unwrap_or_else(|_| "http://127.0.0.1:4318".to_owned());

    // The exporter runs on the batch processor's own thread: a blocking HTTP client.
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_endpoint(format!("{endpoint}/v1/traces"))
        .with_timeout(Duration::from_secs(5))
        .with_headers(Default::default())
        .build()
        .context("the OTLP exporter")?;
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(
            Resource::builder()
                .with_service_name("reliq-otlp-example")
                .build(),
        )
        .build();
    tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("reliq")))
        .with(tracing_subscriber::fmt::layer().with_writer(std::io::stderr))
        .with(tracing_subscriber::EnvFilter::new("info"))
        .init();

    let broker = reliq::connect(&url).await?;
    let handle = Consumer::builder(broker.clone(), "billing")
        .subscribe("orders")
        .retry(RetryPolicy::tiers([Duration::from_millis(200)]).max_attempts(2))
        .start(|d: Delivery| async move {
            if d.payload() == b"order-3" {
                return Err::<(), BoxError>(Transient::msg("inventory service unavailable").into());
            }
            Ok(())
        })
        .await?;
    for i in 1..=5 {
        broker
            .publish(
                &Destination::new("orders"),
                Message::new(format!("order-{i}")),
            )
            .await?;
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while handle.stats().processed < 4 || handle.stats().dead_lettered < 1 {
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "{:?}",
            handle.stats()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let report = handle.shutdown().await;
    println!("{:?}", report.stats);
    // Flush what the batch processor holds before the process ends.
    provider.shutdown().context("flushing the spans")?;
    Ok(())
}
