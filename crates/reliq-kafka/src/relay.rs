//! The relays' side of a redeploy: retry topics of this consumer that its current policy
//! has no tier for (left by an earlier policy) and that still hold records, found by
//! metadata. The receiver runs a relay for each, with that tier's delay, so no waiting
//! retry is stranded.

use std::sync::Arc;
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::producer::Producer as _;
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use reliq_core::{BrokerError, Subscription};

use crate::broker::Inner;
use crate::names::{relay_group, retry_tier};

/// A retry topic of this consumer that its current policy has no tier for.
pub(crate) struct StaleTier {
    pub(crate) delay: Duration,
    pub(crate) topic: String,
    /// Records its relay group has not consumed.
    pub(crate) lag: i64,
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
            .fetch_metadata(None, STALE_WAIT)
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
            let lag = relay_lag(&inner, &relay_group(&sub, delay), t)?;
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

/// How long looking for old retry tiers may wait for one answer.
const STALE_WAIT: Duration = Duration::from_secs(10);

/// Records of `topic` that `group` has not committed past (its committed offsets read
/// without joining the group).
fn relay_lag(
    inner: &Inner,
    group: &str,
    topic: &rdkafka::metadata::MetadataTopic,
) -> Result<i64, BrokerError> {
    let name = topic.name();
    let failed = |what: &str, e: rdkafka::error::KafkaError| {
        BrokerError::connection(format!("reading {what} of old retry tier {name}: {e}"))
            .caused_by(e)
    };
    let consumer: BaseConsumer = inner
        .config
        .consumer(group, 1)
        .create()
        .map_err(|e| failed("a consumer", e))?;
    let mut tpl = TopicPartitionList::new();
    for p in topic.partitions() {
        tpl.add_partition(name, p.id());
    }
    let committed = consumer
        .committed_offsets(tpl, STALE_WAIT)
        .map_err(|e| failed("the relay's committed offsets", e))?;
    let mut lag = 0;
    for p in topic.partitions() {
        let (low, high) = consumer
            .fetch_watermarks(name, p.id(), STALE_WAIT)
            .map_err(|e| failed("the watermarks", e))?;
        let done = match committed.find_partition(name, p.id()).map(|e| e.offset()) {
            Some(Offset::Offset(o)) => o.max(low),
            _ => low,
        };
        lag += (high - done).max(0);
    }
    Ok(lag)
}
