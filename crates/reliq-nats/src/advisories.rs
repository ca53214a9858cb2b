//! The advisory watcher: messages the consumer gave up on, moved to the DLQ.

use std::time::{Duration, SystemTime};

use futures::StreamExt;
use reliq_core::{BrokerError, DeadLetter, DeadLetterReason, Origin, Subscription, seam::headers};

use crate::client::NatsBroker;
use crate::codec::{copy_origin, from_nats, route_of};
use crate::error::api;
use crate::names::{consumer_name, stream_name};

/// Turns `MAX_DELIVERIES` advisories of one consumer into DLQ entries.
pub(crate) struct AdvisoryWatcher {
    pub(crate) broker: NatsBroker,
    pub(crate) sub: Subscription,
}

/// The advisories the watcher handles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Advisory {
    /// `MAX_DELIVERIES`: the server will not deliver the message again.
    MaxDeliveries,
    /// `MSG_TERMINATED`: a client terminated it (`+TERM`); reliq's own carry reason `reliq`.
    Terminated,
}

#[derive(serde::Deserialize)]
struct ConsumerAdvisory {
    stream_seq: u64,
    #[serde(default)]
    deliveries: u64,
    #[serde(default)]
    reason: String,
}

impl AdvisoryWatcher {
    pub(crate) async fn run(self) {
        let stream = stream_name(&self.sub.source);
        let consumer = consumer_name(&self.sub.consumer);
        let client = &self.broker.inner.client;
        let max_subject = format!("$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{stream}.{consumer}");
        let term_subject =
            format!("$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.{stream}.{consumer}");
        let (mut max_deliveries, mut terminated) = match tokio::try_join!(
            client.subscribe(max_subject.clone()),
            client.subscribe(term_subject)
        ) {
            Ok(subs) => subs,
            Err(e) => {
                tracing::error!(%max_subject, error = %e, "cannot subscribe to consumer advisories");
                return;
            }
        };
        loop {
            let (msg, kind) = tokio::select! {
                Some(m) = max_deliveries.next() => (m, Advisory::MaxDeliveries),
                Some(m) = terminated.next() => (m, Advisory::Terminated),
                else => return,
            };
            let advisory: ConsumerAdvisory = match serde_json::from_slice(&msg.payload) {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(error = %e, "unreadable consumer advisory");
                    continue;
                }
            };
            if kind == Advisory::Terminated && advisory.reason.starts_with("reliq") {
                // reliq terminated it after dead-lettering it itself.
                continue;
            }
            let mut wait = Duration::from_millis(100);
            // Never give up on a message the broker will not deliver again.
            while let Err(e) = self.move_to_dlq(&advisory, kind).await {
                tracing::warn!(seq = advisory.stream_seq, error = %e, retry_in = ?wait,
                    "moving a message the consumer gave up on to the DLQ failed");
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(Duration::from_secs(10));
            }
        }
    }

    async fn move_to_dlq(
        &self,
        advisory: &ConsumerAdvisory,
        kind: Advisory,
    ) -> Result<(), BrokerError> {
        let stream = self
            .broker
            .inner
            .js
            .get_stream(stream_name(&self.sub.source))
            .await
            .map_err(api(format!(
                "reading source stream `{}`",
                stream_name(&self.sub.source)
            )))?;
        let raw = match stream.get_raw_message(advisory.stream_seq).await {
            Ok(raw) => raw,
            Err(e) => {
                tracing::error!(seq = advisory.stream_seq, error = %e,
                    "max-deliveries message is gone from the stream; nothing to dead-letter");
                return Ok(());
            }
        };
        // A retry copy names the message first consumed; an original is its own origin.
        let copied = copy_origin(Some(&raw.headers));
        let is_copy = copied.is_some();
        let (origin_seq, origin_subject) =
            copied.unwrap_or_else(|| (advisory.stream_seq, raw.subject.to_string()));
        let mut message = from_nats(
            Some(&raw.headers),
            raw.payload.clone(),
            format!("{}:{}", stream_name(&self.sub.source), advisory.stream_seq),
        );
        // As the receiver counts: a copy goes on from the attempt it was retried at.
        let before = if is_copy {
            u64::from(headers::attempt(message.headers())).saturating_sub(1)
        } else {
            0
        };
        let attempts = u32::try_from(before + advisory.deliveries).unwrap_or(u32::MAX);
        let (reason, error) = match kind {
            Advisory::MaxDeliveries => (DeadLetterReason::MaxDeliveries, None),
            // Terminated by a client outside reliq: parked so it is not lost.
            Advisory::Terminated => (
                DeadLetterReason::Permanent,
                Some(format!(
                    "terminated outside reliq (reason `{}`)",
                    advisory.reason
                )),
            ),
        };
        DeadLetter {
            reason,
            error_class: None,
            error,
            attempts,
            first_failure_at: None,
            dead_lettered_at: SystemTime::now(),
            consumer: self.sub.consumer.clone(),
            origin: Origin {
                destination: self.sub.source.as_str().into(),
                route: route_of(&origin_subject, &self.sub.source),
                sequence: Some(origin_seq),
                ..Origin::default()
            },
        }
        .write(message.headers_mut());
        // One entry per message, whichever path parks it: the receiver's and this one.
        self.broker
            .publish_dead_letter(&self.sub, origin_seq, message)
            .await?;
        tracing::warn!(seq = advisory.stream_seq, consumer = %self.sub.consumer, %reason,
            "the consumer gave up on a message; moved to the DLQ");
        Ok(())
    }
}
