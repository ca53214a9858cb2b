//! A consumer's backlog read from the broker: the lag of its group on the source and of
//! each relay group on its retry topic (end offset − committed offset, per partition),
//! read without joining any group.

use std::sync::Arc;
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::producer::Producer as _;
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use reliq_core::{Backlog, BrokerError, Subscription, TierBacklog};

use crate::client::Inner;
use crate::names::relay_group;
use crate::oauth::TokenContext;
use crate::options::RetryMode;

/// How long one metadata, offsets or watermarks answer may take.
pub(crate) const LAG_WAIT: Duration = Duration::from_secs(10);

/// `sub`'s backlog: the source group's lag, and each tier's relay lag (Topics mode; in
/// Blocking mode a retry waits in the consumer process, where the broker cannot see it).
pub(crate) async fn backlog(
    inner: &Arc<Inner>,
    sub: &Subscription,
) -> Result<Backlog, BrokerError> {
    let inner = inner.clone();
    let sub = sub.clone();
    tokio::task::spawn_blocking(move || {
        let waiting = group_lag(&inner, &sub.consumer, &sub.source)?;
        let backlog = Backlog::waiting(waiting);
        if inner.config.retry_mode == RetryMode::Blocking {
            return Ok(backlog);
        }
        let tiers = sub
            .retry_tiers
            .iter()
            .map(|delay| {
                let topic = sub.retry_name(*delay);
                Ok(TierBacklog {
                    delay: *delay,
                    waiting: group_lag(&inner, &relay_group(&sub, *delay), &topic)?,
                })
            })
            .collect::<Result<Vec<_>, BrokerError>>()?;
        Ok(backlog.with_tiers(tiers))
    })
    .await
    .map_err(|e| BrokerError::Other(Box::new(e)))?
}

/// Records of `topic` that `group` has not committed past, over every partition (a
/// partition the group never committed on counts from its low watermark). Blocking.
pub(crate) fn group_lag(inner: &Inner, group: &str, topic: &str) -> Result<u64, BrokerError> {
    let failed = |what: &str, e: rdkafka::error::KafkaError| {
        BrokerError::connection(format!(
            "reading {what} of `{topic}` for group `{group}`: {e}"
        ))
        .caused_by(e)
    };
    let metadata = inner
        .route_producer
        .client()
        .fetch_metadata(Some(topic), LAG_WAIT)
        .map_err(|e| failed("the metadata", e))?;
    let Some(meta) = metadata.topics().iter().find(|t| t.name() == topic) else {
        return Err(BrokerError::Unroutable(topic.to_owned()));
    };
    if meta.error().is_some() || meta.partitions().is_empty() {
        return Err(BrokerError::Unroutable(format!(
            "topic `{topic}` does not exist (subscribe once to declare it)"
        )));
    }
    let partitions: Vec<i32> = meta.partitions().iter().map(|p| p.id()).collect();
    let consumer: BaseConsumer<TokenContext> = inner
        .config
        .consumer(group, 1)
        .create_with_context(TokenContext(inner.tokens.clone()))
        .map_err(|e| failed("a consumer", e))?;
    // Never polled: its token comes from here (MSK IAM; see `oauth`).
    inner
        .tokens
        .renew(consumer.client(), &mut crate::oauth::SignIn::default());
    let mut tpl = TopicPartitionList::new();
    for p in &partitions {
        tpl.add_partition(topic, *p);
    }
    let committed = consumer
        .committed_offsets(tpl, LAG_WAIT)
        .map_err(|e| failed("the committed offsets", e))?;
    let mut lag = 0u64;
    for p in partitions {
        let (low, high) = consumer
            .fetch_watermarks(topic, p, LAG_WAIT)
            .map_err(|e| failed("the watermarks", e))?;
        let done = match committed.find_partition(topic, p).map(|e| e.offset()) {
            Some(Offset::Offset(o)) => o.max(low),
            _ => low,
        };
        lag += u64::try_from(high - done).unwrap_or(0);
    }
    Ok(lag)
}
