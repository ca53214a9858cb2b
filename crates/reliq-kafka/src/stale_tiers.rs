//! Stale retry tiers, for a redeploy: retry topics of this consumer that its current
//! policy has no tier for (left by an earlier policy) and that still hold records, found
//! by metadata. The receiver runs a tier relay for each (a consumer of the retry topic
//! that hands each record back when due — the only thing "relay" names in this crate),
//! with that tier's delay, so no waiting retry is stranded.

use std::sync::Arc;
use std::time::Duration;

use rdkafka::producer::Producer as _;
use reliq_core::{BrokerError, Subscription};

use crate::backlog::{LAG_WAIT, group_lag};
use crate::client::Inner;
use crate::names::{relay_group, retry_tier};

/// A retry topic of this consumer that its current policy has no tier for.
pub(crate) struct StaleTier {
    pub(crate) delay: Duration,
    pub(crate) topic: String,
    /// Records its relay group has not consumed.
    pub(crate) lag: u64,
}

/// This consumer's retry topics on the broker (`<source>.<consumer>.retry.<ms>ms`, by
/// metadata) other than `current` that still hold records their relay group has not
/// consumed: retries a redeploy with another policy would strand.
pub(crate) async fn stale_tiers(
    inner: &Arc<Inner>,
    sub: &Subscription,
    current: &[String],
) -> Result<Vec<StaleTier>, BrokerError> {
    let inner = inner.clone();
    let sub = sub.clone();
    let current = current.to_vec();
    tokio::task::spawn_blocking(move || {
        let metadata = inner
            .route_producer
            .client()
            .fetch_metadata(None, LAG_WAIT)
            .map_err(|e| {
                BrokerError::connection(format!("listing topics for old retry tiers: {e}"))
                    .caused_by(e)
            })?;
        let mut stale = Vec::new();
        for t in metadata.topics() {
            let Some(delay) = retry_tier(&sub, t.name()) else {
                continue;
            };
            if current.iter().any(|c| c == t.name()) || t.partitions().is_empty() {
                continue;
            }
            let lag = group_lag(&inner, &relay_group(&sub, delay), t.name())?;
            if lag > 0 {
                stale.push(StaleTier {
                    delay,
                    topic: t.name().to_owned(),
                    lag,
                });
            }
        }
        Ok(stale)
    })
    .await
    .map_err(|e| BrokerError::Other(Box::new(e)))?
}
