//! How an application exposes reliq's metrics to Prometheus: install
//! `metrics-exporter-prometheus` as the process's recorder, with reliq's histogram
//! buckets, serving `/metrics` on its own listener. Every counter the runtime, the outbox
//! relay and publishes record, and the gauges a [`reliq::BacklogGauges`] poller sets,
//! then appear in a scrape.

use std::net::SocketAddr;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

/// The recorder builder with reliq's buckets (`*_seconds` histograms: 1 ms to 60 s;
/// `reliq_batch_size`), so `histogram_quantile` works in the alert rules.
pub fn builder() -> anyhow::Result<PrometheusBuilder> {
    Ok(PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Suffix("_seconds".into()),
            reliq::metrics::DURATION_BUCKETS,
        )?
        .set_buckets_for_metric(
            Matcher::Full(reliq::metrics::BATCH_SIZE.into()),
            reliq::metrics::BATCH_SIZE_BUCKETS,
        )?)
}

/// Install the recorder and serve `http://addr/metrics` (call inside a tokio runtime).
pub fn serve(addr: SocketAddr) -> anyhow::Result<()> {
    builder()?.with_http_listener(addr).install()?;
    Ok(())
}

/// Install the recorder without a listener (the caller renders the handle itself, e.g.
/// behind its own HTTP server).
pub fn recorder() -> anyhow::Result<PrometheusHandle> {
    Ok(builder()?.install_recorder()?)
}
