//! The consumer's failure share, read from its Prometheus metrics: what stops a ramped
//! replay when the consumer it feeds starts failing again.
//!
//! The first check, as the replay starts, is the baseline. Each later one scrapes the
//! consumer's `/metrics` again and takes, since the check before, how
//! many messages it received (`reliq_messages_received_total`) and how many of those
//! failed (`reliq_messages_retried_total` + `reliq_messages_dead_lettered_total`), summed
//! over the series of `consumer="<name>"` (every replica behind the URL counts when it is
//! a federating endpoint). With at least `min_sample` received, a share above the bound
//! stops the replay; a scrape that fails is logged and the replay goes on (the guard
//! watches the consumer, it is not a reason to stop).

use std::sync::Mutex;

use reliq::metrics::{DEAD_LETTERED, RECEIVED, RETRIED};

/// The guard (see the module docs).
pub(crate) struct FailureShareGuard {
    http: reqwest::Client,
    url: String,
    consumer: String,
    max_share: f64,
    min_sample: u64,
    /// (received, failed) at the last check.
    last: Mutex<Option<(f64, f64)>>,
}

impl FailureShareGuard {
    /// The guard of `consumer`, reading `url` (http or https: the platform's roots).
    pub(crate) fn new(
        url: String,
        consumer: String,
        max_share: f64,
        min_sample: u64,
    ) -> Result<Self, String> {
        use rustls_platform_verifier::BuilderVerifierExt;
        let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
        let tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .and_then(|b| b.with_platform_verifier())
            .map_err(|e| format!("--guard-metrics: TLS setup failed: {e}"))?
            .with_no_client_auth();
        let http = reqwest::Client::builder()
            .tls_backend_preconfigured(tls)
            .build()
            .map_err(|e| format!("--guard-metrics: HTTP client setup failed: {e}"))?;
        Ok(Self {
            http,
            url,
            consumer,
            max_share,
            min_sample,
            last: Mutex::new(None),
        })
    }

    /// A scrape's failure, naming the URL without its password (reqwest's own text
    /// carries the URL too: it is left out).
    fn failed(&self, e: reqwest::Error) -> String {
        let why = e.without_url().to_string();
        format!("scraping {}: {why}", reliq::secrets::redact_url(&self.url))
    }

    async fn scrape(&self) -> Result<(f64, f64), String> {
        let text = self
            .http
            .get(&self.url)
            .timeout(std::time::Duration::from_secs(5))
            .send()
            .await
            .and_then(reqwest::Response::error_for_status)
            .map_err(|e| self.failed(e))?
            .text()
            .await
            .map_err(|e| self.failed(e))?;
        Ok(counts(&text, &self.consumer))
    }
}

#[async_trait::async_trait]
impl reliq::ReplayGuard for FailureShareGuard {
    async fn check(&self) -> Result<(), String> {
        let (received, failed) = match self.scrape().await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!("the replay's guard could not read the consumer's metrics: {e}");
                return Ok(());
            }
        };
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        let Some((received_before, failed_before)) = last.replace((received, failed)) else {
            return Ok(()); // the baseline
        };
        let (window, failures) = (received - received_before, failed - failed_before);
        if window < self.min_sample as f64 {
            // Too few to judge: judge them with the next window's.
            *last = Some((received_before, failed_before));
            return Ok(());
        }
        let share = failures / window;
        if share > self.max_share {
            return Err(format!(
                "consumer `{}` failed {failures:.0} of the {window:.0} messages it received since the last check ({:.1}% > --max-failure-share {:.1}%)",
                self.consumer,
                share * 100.0,
                self.max_share * 100.0
            ));
        }
        Ok(())
    }
}

/// (received, failed) of `consumer` in a Prometheus text exposition.
fn counts(text: &str, consumer: &str) -> (f64, f64) {
    let label = format!("consumer=\"{consumer}\"");
    let (mut received, mut failed) = (0.0, 0.0);
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let (name, labels) = series.split_once('{').unwrap_or((series, ""));
        let ours = labels
            .trim_end_matches('}')
            .split(',')
            .any(|l| l.trim() == label);
        let Ok(value) = value.trim().parse::<f64>() else {
            continue;
        };
        if !ours {
            continue;
        }
        if name == RECEIVED {
            received += value;
        } else if name == RETRIED || name == DEAD_LETTERED {
            failed += value;
        }
    }
    (received, failed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_consumers_counts_are_summed_over_its_series_only() {
        let text = "\
# HELP reliq_messages_received_total Messages received.
# TYPE reliq_messages_received_total counter
reliq_messages_received_total{consumer=\"billing\"} 120
reliq_messages_received_total{consumer=\"billing-eu\"} 999
reliq_messages_retried_total{consumer=\"billing\",class=\"transient\"} 7
reliq_messages_retried_total{class=\"panic\",consumer=\"billing\"} 1
reliq_messages_dead_lettered_total{consumer=\"billing\",reason=\"permanent\"} 2
reliq_messages_processed_total{consumer=\"billing\"} 110
";
        assert_eq!(counts(text, "billing"), (120.0, 10.0));
        assert_eq!(counts(text, "nobody"), (0.0, 0.0));
    }
}
