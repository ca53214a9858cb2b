//! The [`Broker`] implementation of [`KafkaBroker`]: the seam the consumer runtime and the
//! operator tools use, mapped onto the clients (`client`), the receiver, the dead-letter
//! reader, the topology and backlog modules.

use async_trait::async_trait;
use reliq_core::{
    Broker, BrokerError, Capabilities, Destination, Message, Subscription, seam::Receiver,
};

use crate::client::{KafkaBroker, now_millis_ceil, route_produce};
use crate::codec::DUE_AT_HEADER;
use crate::dead_letters::KafkaDeadLetters;
use crate::options::RetryMode;
use crate::receiver::KafkaReceiver;
use crate::{backlog, permissions, topology};

#[async_trait]
impl Broker for KafkaBroker {
    fn kind(&self) -> &'static str {
        "kafka"
    }

    fn capabilities(&self) -> Capabilities {
        let blocking = self.inner.config.retry_mode == RetryMode::Blocking;
        Capabilities {
            rejects_unroutable: false,
            // Blocking mode waits exactly the policy's delay (jitter included).
            exact_retry_delay: blocking,
            delivery_limit: true,
            // Replay to one consumer goes through its first retry topic.
            consumer_redelivery: !blocking,
            // The attempt travels in the `reliq-attempt` header of the retry copy.
            attempts_count_every_delivery: false,
            deduplicates_publishes: false,
            filters: false,
            retries_counted_apart: !blocking,
        }
    }

    async fn publish(
        &self,
        destination: &Destination,
        message: Message,
    ) -> Result<(), BrokerError> {
        if let Some(route) = &destination.route {
            tracing::debug!(%route, "Kafka has no routing keys; the route is ignored (use the key)");
        }
        self.inner
            .produce(false, &destination.topic, &message, &[])
            .await
            .map(drop)
    }

    async fn subscribe(
        &self,
        subscription: &Subscription,
    ) -> Result<Box<dyn Receiver>, BrokerError> {
        subscription.refuse_filter("Kafka")?;
        let receiver = KafkaReceiver::subscribe(self.inner.clone(), subscription).await?;
        Ok(Box::new(receiver))
    }

    async fn dead_letters(
        &self,
        subscription: &Subscription,
    ) -> Result<Box<dyn reliq_core::DeadLetters>, BrokerError> {
        let reader = KafkaDeadLetters::open(self.inner.clone(), subscription).await?;
        Ok(Box::new(reader))
    }

    async fn permissions(
        &self,
        access: &reliq_core::Access,
    ) -> Result<reliq_core::Permissions, BrokerError> {
        Ok(permissions::permissions(&self.inner.config, access))
    }

    async fn plan(&self, subscription: &Subscription) -> Result<reliq_core::Plan, BrokerError> {
        Ok(topology::plan(subscription, &self.inner.config))
    }

    async fn inspect(
        &self,
        subscription: &Subscription,
        plan: &reliq_core::Plan,
    ) -> Result<reliq_core::LiveTopology, BrokerError> {
        self.inner.inspect(subscription, plan).await
    }

    /// A metadata request answered by a broker of the cluster (librdkafka's cached
    /// metadata is not enough: it outlives the cluster).
    async fn ping(&self) -> Result<(), BrokerError> {
        self.topic_names().await.map(drop)
    }

    /// The group's lag on the source and each relay group's on its retry topic.
    async fn backlog(
        &self,
        subscription: &Subscription,
    ) -> Result<reliq_core::Backlog, BrokerError> {
        backlog::backlog(&self.inner, subscription).await
    }

    async fn send_to_consumer(
        &self,
        subscription: &Subscription,
        message: Message,
    ) -> Result<(), BrokerError> {
        let Some(first) = subscription.retry_tiers.first() else {
            return Err(BrokerError::Unsupported {
                backend: "kafka",
                what: "send_to_consumer without a retry tier (no per-consumer topic)",
            });
        };
        let topic = subscription.retry_name(*first);
        let due = [(DUE_AT_HEADER, now_millis_ceil().to_string())];
        route_produce(&self.inner, &topic, &message, &due).await
    }
}
