//! The DLQ stream read by sequence.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_nats::jetstream;
use async_trait::async_trait;
use reliq_core::headers::{self, Origin};
use reliq_core::{
    BrokerError, Delivery, DeliveryToken, Message, Receiver, ReceiverId, RetryRequest,
};
use tokio_util::sync::CancellationToken;

use crate::codec::from_nats;
use crate::error::other;

/// Reads a DLQ stream like a log: a cursor over stream sequences. `ack` deletes the dead
/// letter from the stream; `release` leaves it where it is (the cursor moves on), so a
/// dry run or a filtered replay never disturbs what it does not take.
pub(crate) struct DeadLetterReader {
    pub(crate) owner: ReceiverId,
    pub(crate) stream: jetstream::stream::Stream,
    pub(crate) next: AtomicU64,
    pub(crate) cursor: tokio::sync::Mutex<()>,
    pub(crate) closed: CancellationToken,
}

#[async_trait]
impl Receiver for DeadLetterReader {
    async fn receive(&self) -> Result<Delivery, BrokerError> {
        let _cursor = self.cursor.lock().await;
        loop {
            if self.closed.is_cancelled() {
                return Err(BrokerError::Closed);
            }
            let state = self.stream.get_info().await.map_err(other)?.state;
            let seq = self.next.load(Ordering::Relaxed).max(state.first_sequence);
            if state.messages == 0 || seq > state.last_sequence {
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(200)) => continue,
                    _ = self.closed.cancelled() => return Err(BrokerError::Closed),
                }
            }
            self.next.store(seq + 1, Ordering::Relaxed);
            let raw = match self.stream.get_raw_message(seq).await {
                Ok(raw) => raw,
                // Deleted (already replayed): skip.
                Err(_) => continue,
            };
            let message = from_nats(
                Some(&raw.headers),
                raw.payload.clone(),
                format!("dlq:{seq}"),
            );
            let attempt = headers::attempt(message.headers());
            let origin = Origin {
                destination: raw.subject.as_str().into(),
                sequence: Some(seq),
                ..Origin::default()
            };
            return Ok(Delivery::with_published_at(
                message,
                attempt,
                origin,
                DeliveryToken::new(self.owner, seq),
                raw.time.into(),
            ));
        }
    }

    async fn ack(&self, delivery: &Delivery) -> Result<(), BrokerError> {
        self.stream
            .delete_message(delivery.token().check(self.owner)?.tag())
            .await
            .map_err(other)?;
        Ok(())
    }

    async fn retry(&self, _: &Delivery, _: RetryRequest) -> Result<(), BrokerError> {
        Err(BrokerError::Unsupported {
            backend: "nats",
            what: "retrying a dead letter (replay it instead)",
        })
    }

    async fn dead_letter(&self, _: &Delivery, _: Message) -> Result<(), BrokerError> {
        Err(BrokerError::Unsupported {
            backend: "nats",
            what: "dead-lettering a dead letter",
        })
    }

    async fn release(&self, _: &Delivery, _: Duration) -> Result<(), BrokerError> {
        Ok(())
    }

    async fn close(&self) -> Result<(), BrokerError> {
        self.closed.cancel();
        Ok(())
    }
}
