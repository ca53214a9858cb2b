//! The crash-loop counter (the delivery limit): a partition's first record handed out is
//! counted in the commit metadata of its committed position, and moved to the DLQ once
//! the count passes the limit (see the crate docs).

use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use reliq_core::{BrokerError, Clock, DeadLetter, DeadLetterReason, Delivery, seam::lock};

use super::shared::{Ctx, Record, Shared};
use crate::client::route_produce;

/// Prefix of the commit metadata that carries the crash-loop counter.
const COUNTER_PREFIX: &str = "reliq-deliveries";

impl Shared {
    /// Count the head record (crash-loop guard), then push the delivery to the stream.
    pub(super) fn hand_out(
        &self,
        client: usize,
        consumer: &BaseConsumer<Ctx>,
        partition: i32,
        offset: i64,
        delivery: Delivery,
        out: &mut Vec<Record>,
    ) {
        let mut s = lock(&self.state);
        let Some(part) = s.parts.get_mut(&(client, partition)) else {
            return;
        };
        if part.counted {
            // Every record after the partition's first: one lock, no counter.
            let tracked = self.track(
                &mut s,
                client,
                partition,
                offset,
                Record::Ready(Box::new(delivery)),
            );
            drop(s);
            out.extend(tracked);
            return;
        }
        part.counted = true;
        let count = part.head.is_none_or(|h| h == offset).then(|| {
            let before = part
                .head_count
                .filter(|(o, _)| *o == offset)
                .map_or(0, |(_, n)| n);
            before.saturating_add(1)
        });
        drop(s);
        if let Some(n) = count {
            let topic = &self.clients[client].topic;
            let mut tpl = TopicPartitionList::new();
            let mut e = tpl.add_partition(topic, partition);
            let set = e.set_offset(Offset::Offset(offset));
            e.set_metadata(format!("{COUNTER_PREFIX}:{offset}:{n}"));
            if set.is_ok()
                && let Err(err) = consumer.commit(&tpl, CommitMode::Sync)
            {
                tracing::warn!(error = %err, "storing the delivery counter failed");
            }
            if n > self.sub.delivery_limit {
                match self.dead_letter_max_deliveries(&delivery) {
                    Ok(()) => {
                        tracing::warn!(topic = %topic, partition, offset, deliveries = n - 1,
                            id = %delivery.id(), "delivery limit reached; moved to the dead-letter topic");
                        let mut s = lock(&self.state);
                        if let Some(part) = s.parts.get_mut(&(client, partition)) {
                            part.tracker.handed_out(offset);
                            part.tracker.complete(offset);
                        }
                        return;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "delivery limit reached but the DLQ refuses; handing the record out");
                    }
                }
            }
        }
        let tracked = self.track(
            &mut lock(&self.state),
            client,
            partition,
            offset,
            Record::Ready(Box::new(delivery)),
        );
        out.extend(tracked);
    }

    fn dead_letter_max_deliveries(&self, d: &Delivery) -> Result<(), BrokerError> {
        let mut dead = d.message().clone();
        DeadLetter {
            reason: DeadLetterReason::MaxDeliveries,
            error_class: None,
            error: None,
            attempts: d.attempt(),
            first_failure_at: None,
            dead_lettered_at: Clock::new().now(),
            consumer: self.sub.consumer.clone(),
            origin: d.origin().clone(),
        }
        .write(dead.headers_mut());
        let topic = self.sub.dead_letter_name();
        self.runtime
            .block_on(route_produce(&self.inner, &topic, &dead, &[]))
    }
}

pub(super) fn parse_counter(metadata: &str) -> Option<(i64, u32)> {
    let mut it = metadata
        .strip_prefix(COUNTER_PREFIX)?
        .strip_prefix(':')?
        .split(':');
    let offset = it.next()?.parse().ok()?;
    let n = it.next()?.parse().ok()?;
    Some((offset, n))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counter_metadata_round_trips() {
        assert_eq!(parse_counter("reliq-deliveries:42:3"), Some((42, 3)));
        assert_eq!(parse_counter(""), None);
        assert_eq!(parse_counter("other:1:2"), None);
        assert_eq!(parse_counter("reliq-deliveries:x:2"), None);
    }
}
