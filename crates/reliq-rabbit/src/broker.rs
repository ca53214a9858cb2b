//! [`Broker`] for [`RabbitBroker`]: each operation mapped onto the connection
//! (`client.rs`), the topology, the receiver and the dead-letter stream.

use async_trait::async_trait;
use reliq_core::{
    Broker, BrokerError, Capabilities, Destination, Message, Subscription, seam::Receiver,
};

use crate::client::{RabbitBroker, Target};
use crate::dead_letters::{RabbitDeadLetters, declaring};
use crate::names::Names;
use crate::receiver::RabbitReceiver;
use crate::{options::QueueType, topology};

#[async_trait]
impl Broker for RabbitBroker {
    fn kind(&self) -> &'static str {
        "rabbit"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            rejects_unroutable: true,
            exact_retry_delay: false,
            delivery_limit: self.inner.opts.queue_type == QueueType::Quorum,
            consumer_redelivery: true,
            // The attempt travels in the `reliq-attempt` header of the retry copy.
            attempts_count_every_delivery: false,
            deduplicates_publishes: false,
            filters: true,
            retries_counted_apart: true,
        }
    }

    async fn publish(
        &self,
        destination: &Destination,
        message: Message,
    ) -> Result<(), BrokerError> {
        let route = destination.route.as_deref().unwrap_or("");
        self.inner
            .publish_to(
                &destination.topic,
                route,
                &message,
                Target::Exchange(&destination.topic, route),
            )
            .await
    }

    async fn subscribe(
        &self,
        subscription: &Subscription,
    ) -> Result<Box<dyn Receiver>, BrokerError> {
        Ok(Box::new(
            RabbitReceiver::start(self.inner.clone(), subscription).await?,
        ))
    }

    async fn dead_letters(
        &self,
        subscription: &Subscription,
    ) -> Result<Box<dyn reliq_core::DeadLetters>, BrokerError> {
        Ok(Box::new(
            RabbitDeadLetters::open(self.inner.clone(), subscription).await?,
        ))
    }

    /// Configure / write / read regexes for the URL's vhost and user (see the crate's
    /// `permissions` notes); the tag `policymaker` too when policies hold the queue
    /// settings.
    async fn permissions(
        &self,
        access: &reliq_core::Access,
    ) -> Result<reliq_core::Permissions, BrokerError> {
        let user = self
            .inner
            .url
            .parse::<lapin::uri::AMQPUri>()
            .ok()
            .map(|u| u.authority.userinfo.username);
        let policies = matches!(self.inner.store, topology::SettingsStore::Policies { .. });
        Ok(crate::permissions::permissions(
            access,
            &self.inner.vhost(),
            user.as_deref(),
            policies,
        ))
    }

    async fn plan(&self, subscription: &Subscription) -> Result<reliq_core::Plan, BrokerError> {
        Ok(topology::plan(subscription, &self.inner.opts))
    }

    /// Through the management API (a config error naming `reliq.management` without
    /// one), and a passive declare for what a stale retry queue holds.
    async fn inspect(
        &self,
        subscription: &Subscription,
        plan: &reliq_core::Plan,
    ) -> Result<reliq_core::LiveTopology, BrokerError> {
        crate::inspect::inspect(&self.inner, subscription, plan).await
    }

    /// Opens a channel and closes it (two round trips on the connection, reconnecting
    /// first when it was lost).
    async fn ping(&self) -> Result<(), BrokerError> {
        self.inner.ping().await
    }

    /// Ready messages of the consumer queue and each TTL queue; unacknowledged ones from
    /// the management API when [`RabbitOptions::management_url`](crate::options::RabbitOptions::management_url) is set.
    async fn backlog(
        &self,
        subscription: &Subscription,
    ) -> Result<reliq_core::Backlog, BrokerError> {
        crate::backlog::backlog(&self.inner, subscription).await
    }

    async fn send_to_consumer(
        &self,
        subscription: &Subscription,
        message: Message,
    ) -> Result<(), BrokerError> {
        let queue = crate::names::queue_name(subscription);
        self.inner
            .publish_to("", &queue, &message, Target::Queue("queue", &queue))
            .await
    }
}

/// Declaring: in this module rather than `client`, since a declare that creates the
/// removal ledger also writes its first record (`dead_letters::declaring`).
impl RabbitBroker {
    /// Declare `sub`'s whole topology (idempotent); [`Broker::subscribe`] does this too.
    pub async fn declare(&self, sub: &Subscription) -> Result<Names, BrokerError> {
        let inner = &self.inner;
        let ch = inner.channel().await?;
        let names = Names::of(sub);
        declaring(
            inner,
            &names,
            topology::declare_all(&ch, sub, &inner.opts, &inner.store),
        )
        .await?;
        inner.known_exchange(&names.exchange);
        let _ = ch.close(200, "ok".into()).await;
        Ok(names)
    }

    /// Declare only `sub`'s dead-letter objects: the stream, its removal ledger and the
    /// landing queue (e.g. to restore a deleted stream).
    pub async fn declare_dead_letter_queue(&self, sub: &Subscription) -> Result<(), BrokerError> {
        let inner = &self.inner;
        let ch = inner.channel().await?;
        declaring(
            inner,
            &Names::of(sub),
            topology::declare_dead_letters(&ch, sub, &inner.opts, &inner.store),
        )
        .await?;
        let _ = ch.close(200, "ok".into()).await;
        Ok(())
    }
}
