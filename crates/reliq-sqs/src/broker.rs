//! The [`Broker`] implementation of [`SqsBroker`]: the seam the consumer runtime and the
//! operator tools use, mapped onto the connection (`client`), the receiver, the
//! dead-letter reader and the topology modules.

use async_trait::async_trait;
use aws_sdk_sqs::types::QueueAttributeName;
use reliq_core::{
    Broker, BrokerError, Capabilities, Destination, Message, Subscription, seam::Receiver,
};

use crate::client::{SqsBroker, config};
use crate::error::sdk_error;
use crate::{codec, names, permissions, receiver};

#[async_trait]
impl Broker for SqsBroker {
    fn kind(&self) -> &'static str {
        "sqs"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            rejects_unroutable: true,
            exact_retry_delay: true,
            delivery_limit: true,
            consumer_redelivery: true,
            attempts_count_every_delivery: true,
            // FIFO queues drop a second publish of an id within 5 minutes.
            deduplicates_publishes: self.inner.options.fifo,
            filters: true,
            retries_counted_apart: false,
        }
    }

    async fn publish(
        &self,
        destination: &Destination,
        message: Message,
    ) -> Result<(), BrokerError> {
        let encoded = codec::encode(&message, destination.route.as_deref())?;
        match self.publish_once(destination, &encoded, &message).await {
            // A cached queue was deleted: list again once.
            Err(BrokerError::Unroutable(_)) => {
                self.forget_topic(&destination.topic);
                self.publish_once(destination, &encoded, &message).await
            }
            other => other,
        }
    }

    async fn subscribe(
        &self,
        subscription: &Subscription,
    ) -> Result<Box<dyn Receiver>, BrokerError> {
        let declared = self.declare(subscription).await?;
        Ok(Box::new(receiver::SqsReceiver::start(
            self.clone(),
            subscription.clone(),
            declared,
        )))
    }

    async fn dead_letters(
        &self,
        subscription: &Subscription,
    ) -> Result<Box<dyn reliq_core::DeadLetters>, BrokerError> {
        // Looked up, never declared: a look at an unknown consumer's DLQ creates nothing.
        let name = names::dead_letter_queue_name(subscription, self.inner.options.fifo);
        let url = self
            .queue_url(&name)
            .await?
            .ok_or_else(|| subscription.missing_dead_letters(format_args!("queue `{name}`")))?;
        Ok(Box::new(crate::dead_letters::SqsDeadLetters::new(
            self.clone(),
            subscription.clone(),
            url,
        )))
    }

    async fn plan(&self, subscription: &Subscription) -> Result<reliq_core::Plan, BrokerError> {
        self.plan_topology(subscription).await
    }

    /// An IAM policy on the consumers' queue ARNs (see the `permissions` module). Reads
    /// nothing from SQS; the account id is the URL's `account=`, else one STS
    /// `GetCallerIdentity`, else `*`.
    async fn permissions(
        &self,
        access: &reliq_core::Access,
    ) -> Result<reliq_core::Permissions, BrokerError> {
        let region = self
            .inner
            .client
            .config()
            .region()
            .map(|r| r.to_string())
            .ok_or_else(|| config("url region", "no region: the queue ARNs need one"))?;
        let scope = permissions::Scope::new(
            &region,
            self.policy_account().await,
            self.inner.options.fifo,
        );
        Ok(permissions::permissions(&scope, access))
    }

    async fn inspect(
        &self,
        _subscription: &Subscription,
        plan: &reliq_core::Plan,
    ) -> Result<reliq_core::LiveTopology, BrokerError> {
        self.inspect_topology(plan).await
    }

    /// One `ListQueues` call (at most one name back).
    async fn ping(&self) -> Result<(), BrokerError> {
        self.list_one_queue().await
    }

    /// The consumer queue's approximate counts: visible and delayed are waiting, not
    /// visible is in flight (a retry waits there too: its visibility timeout is its delay).
    async fn backlog(
        &self,
        subscription: &Subscription,
    ) -> Result<reliq_core::Backlog, BrokerError> {
        let name = names::queue_name(subscription, self.inner.options.fifo);
        let url = self
            .queue_url(&name)
            .await?
            .ok_or_else(|| BrokerError::Unroutable(format!("queue `{name}` does not exist")))?;
        let out = self
            .inner
            .client
            .get_queue_attributes()
            .queue_url(&url)
            .attribute_names(QueueAttributeName::ApproximateNumberOfMessages)
            .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesDelayed)
            .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesNotVisible)
            .send()
            .await
            .map_err(|e| sdk_error("GetQueueAttributes", e))?;
        let count = |attribute: QueueAttributeName| -> u64 {
            out.attributes()
                .and_then(|a| a.get(&attribute))
                .and_then(|v| v.parse().ok())
                .unwrap_or(0)
        };
        let waiting = count(QueueAttributeName::ApproximateNumberOfMessages)
            + count(QueueAttributeName::ApproximateNumberOfMessagesDelayed);
        Ok(
            reliq_core::Backlog::waiting(waiting).with_in_flight(Some(count(
                QueueAttributeName::ApproximateNumberOfMessagesNotVisible,
            ))),
        )
    }

    async fn send_to_consumer(
        &self,
        subscription: &Subscription,
        message: Message,
    ) -> Result<(), BrokerError> {
        let name = names::queue_name(subscription, self.inner.options.fifo);
        let url = self
            .queue_url(&name)
            .await?
            .ok_or(BrokerError::Unroutable(name))?;
        let encoded = codec::encode(&message, None)?;
        // Replay delivers again on purpose: not the original's deduplication id.
        let dedup = format!("{}-replay-{}", message.id(), receiver::unique_suffix());
        self.send(&url, &encoded, &message, &dedup).await
    }
}
