//! Reading a consumer's dead-letter queue.

use std::collections::VecDeque;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use aws_sdk_sqs::types::MessageSystemAttributeName;
use reliq_core::headers::{self, DeadLetter, DeadLetterReason, Origin};
use reliq_core::{
    BrokerError, Delivery, DeliveryToken, Message, Receiver, ReceiverId, RetryRequest, Subscription,
};
use tokio_util::sync::CancellationToken;

use crate::broker::whole_seconds;
use crate::error::sdk_error;
use crate::receiver::{change_visibility, system_attributes};
use crate::{SqsBroker, codec};

/// Reads a DLQ queue. `ack` deletes the dead letter; `release` makes it visible again.
/// A message moved here by the redrive policy carries no dead-letter record: it is read
/// as `max-deliveries` with `attempts` = the delivery limit (the redrive policy moves a
/// message once it was received `maxReceiveCount` times).
pub(crate) struct DeadLetterReader {
    owner: ReceiverId,
    broker: SqsBroker,
    sub: Subscription,
    url: String,
    buffer: tokio::sync::Mutex<VecDeque<Delivery>>,
    closed: CancellationToken,
}

impl DeadLetterReader {
    pub(crate) fn new(broker: SqsBroker, sub: Subscription, url: String) -> Self {
        Self {
            owner: ReceiverId::next(),
            broker,
            sub,
            url,
            buffer: tokio::sync::Mutex::new(VecDeque::new()),
            closed: CancellationToken::new(),
        }
    }

    fn convert(&self, m: &aws_sdk_sqs::types::Message) -> Option<Delivery> {
        let receipt = m.receipt_handle()?.to_owned();
        let (_, sent) = system_attributes(m);
        let decoded = codec::decode(
            m.body(),
            m.message_attributes(),
            m.message_id().unwrap_or(&receipt),
        );
        let mut message = decoded.message;
        if message
            .headers()
            .get(headers::DEAD_LETTER_VERSION)
            .is_none()
        {
            DeadLetter {
                reason: DeadLetterReason::MaxDeliveries,
                error_class: None,
                error: None,
                attempts: self.sub.delivery_limit,
                first_failure_at: None,
                dead_lettered_at: SystemTime::now(),
                consumer: self.sub.consumer.clone(),
                origin: Origin {
                    destination: self.sub.source.as_str().into(),
                    route: decoded.route,
                    ..Origin::default()
                },
            }
            .write(message.headers_mut());
        }
        let attempt = headers::attempt(message.headers());
        let origin = Origin {
            destination: crate::names::dead_letter_queue_name(
                &self.sub,
                crate::names::is_fifo(&self.url),
            )
            .into(),
            ..Origin::default()
        };
        let token = DeliveryToken::new(self.owner, 0).with_extra(receipt);
        Some(match sent {
            Some(sent) => Delivery::with_published_at(message, attempt, origin, token, sent),
            None => Delivery::new(message, attempt, origin, token),
        })
    }

    fn receipt<'d>(&self, d: &'d Delivery) -> Result<&'d str, BrokerError> {
        d.token()
            .check(self.owner)?
            .extra::<String>()
            .map(String::as_str)
            .ok_or(BrokerError::ForeignDelivery)
    }
}

#[async_trait]
impl Receiver for DeadLetterReader {
    async fn receive(&self) -> Result<Delivery, BrokerError> {
        let mut buffer = self.buffer.lock().await;
        loop {
            if let Some(d) = buffer.pop_front() {
                return Ok(d);
            }
            if self.closed.is_cancelled() {
                return Err(BrokerError::Closed);
            }
            let lease = whole_seconds(self.broker.inner.options.dead_letter_lease).max(1);
            let out = self
                .broker
                .inner
                .client
                .receive_message()
                .queue_url(&self.url)
                .max_number_of_messages(10)
                .wait_time_seconds(1)
                .visibility_timeout(lease)
                .message_attribute_names("All")
                .message_system_attribute_names(MessageSystemAttributeName::ApproximateReceiveCount)
                .message_system_attribute_names(MessageSystemAttributeName::SentTimestamp)
                .send()
                .await
                .map_err(|e| sdk_error("ReceiveMessage", e))?;
            buffer.extend(out.messages().iter().filter_map(|m| self.convert(m)));
        }
    }

    async fn ack(&self, delivery: &Delivery) -> Result<(), BrokerError> {
        self.broker
            .inner
            .client
            .delete_message()
            .queue_url(&self.url)
            .receipt_handle(self.receipt(delivery)?)
            .send()
            .await
            .map_err(|e| sdk_error("DeleteMessage", e))?;
        Ok(())
    }

    async fn retry(&self, _: &Delivery, _: RetryRequest) -> Result<(), BrokerError> {
        Err(BrokerError::Unsupported {
            backend: "sqs",
            what: "retrying a dead letter (replay it instead)",
        })
    }

    async fn dead_letter(&self, _: &Delivery, _: Message) -> Result<(), BrokerError> {
        Err(BrokerError::Unsupported {
            backend: "sqs",
            what: "dead-lettering a dead letter",
        })
    }

    async fn release(&self, delivery: &Delivery, delay: Duration) -> Result<(), BrokerError> {
        change_visibility(
            &self.broker,
            &self.url,
            self.receipt(delivery)?,
            whole_seconds(delay),
        )
        .await
    }

    async fn close(&self) -> Result<(), BrokerError> {
        self.closed.cancel();
        let left: Vec<Delivery> = self.buffer.lock().await.drain(..).collect();
        for d in left {
            let _ = self.release(&d, Duration::ZERO).await;
        }
        Ok(())
    }
}
