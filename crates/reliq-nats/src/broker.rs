//! The [`Broker`] implementation of [`NatsBroker`]: the seam the consumer runtime and the
//! operator tools use, mapped onto the connection (`client`), the receiver, the advisory
//! watcher, the dead-letter reader and the topology modules.

use reliq_core::{
    Broker, BrokerError, Capabilities, Destination, Message, Subscription,
    seam::{Receiver, ReceiverId, lock},
};
use std::sync::Arc;
use std::sync::atomic::AtomicU32;

use async_nats::jetstream::{self, consumer::pull};
use async_trait::async_trait;
use tokio_util::sync::CancellationToken;

use crate::advisories::AdvisoryWatcher;
use crate::client::{NatsBroker, through_election};
use crate::codec::to_nats_headers;
use crate::dead_letters::NatsDeadLetters;
use crate::error::{api, stream_not_found};
use crate::names::{consumer_name, dead_letter_stream, dead_letter_subject, stream_name, subject};
use crate::receiver::{NatsReceiver, Pulls};

#[async_trait]
impl Broker for NatsBroker {
    fn kind(&self) -> &'static str {
        "nats"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            rejects_unroutable: true,
            exact_retry_delay: true,
            delivery_limit: true,
            consumer_redelivery: false,
            attempts_count_every_delivery: true,
            deduplicates_publishes: true,
            filters: true,
            retries_counted_apart: true,
        }
    }

    async fn publish(
        &self,
        destination: &Destination,
        message: Message,
    ) -> Result<(), BrokerError> {
        let headers = to_nats_headers(&message);
        let (_, _, payload, _) = message.into_parts();
        self.publish_raw(subject(destination), headers, payload)
            .await
    }

    async fn subscribe(
        &self,
        subscription: &Subscription,
    ) -> Result<Box<dyn Receiver>, BrokerError> {
        let consumer = through_election("subscribing", || self.declare_all(subscription)).await?;
        self.ensure_advisory_watcher(subscription);
        Ok(Box::new(self.pull_receiver(consumer, subscription).await?))
    }

    /// A JetStream account-info request: the server and its JetStream both answered.
    async fn ping(&self) -> Result<(), BrokerError> {
        self.ping_jetstream().await
    }

    async fn backlog(
        &self,
        subscription: &Subscription,
    ) -> Result<reliq_core::Backlog, BrokerError> {
        self.read_backlog(subscription).await
    }

    async fn permissions(
        &self,
        access: &reliq_core::Access,
    ) -> Result<reliq_core::Permissions, BrokerError> {
        Ok(crate::permissions::permissions(access))
    }

    async fn plan(&self, subscription: &Subscription) -> Result<reliq_core::Plan, BrokerError> {
        Ok(crate::topology::plan(subscription, &self.inner.options))
    }

    async fn inspect(
        &self,
        subscription: &Subscription,
        _plan: &reliq_core::Plan,
    ) -> Result<reliq_core::LiveTopology, BrokerError> {
        crate::topology::inspect(&self.inner.js, subscription).await
    }

    async fn dead_letters(
        &self,
        subscription: &Subscription,
    ) -> Result<Box<dyn reliq_core::DeadLetters>, BrokerError> {
        // Opened, never declared: a look at an unknown consumer's DLQ creates nothing.
        let name = dead_letter_stream(subscription);
        let stream = through_election("opening the DLQ", || async {
            match self.inner.js.get_stream(&name).await {
                Err(e) if stream_not_found(&e) => {
                    Err(subscription.missing_dead_letters(format_args!("stream `{name}`")))
                }
                found => found.map_err(api(format!("opening DLQ stream `{name}`"))),
            }
        })
        .await?;
        Ok(Box::new(NatsDeadLetters::new(
            stream,
            dead_letter_subject(subscription),
        )))
    }
}

/// The receiver and advisory watcher a subscription starts.
impl NatsBroker {
    fn ensure_advisory_watcher(&self, sub: &Subscription) {
        let key = (stream_name(&sub.source), consumer_name(&sub.consumer));
        let mut advisory_watchers = lock(&self.inner.advisory_watchers);
        if advisory_watchers
            .get(&key)
            .is_some_and(|h| !h.is_finished())
        {
            return;
        }
        let watcher = AdvisoryWatcher {
            broker: self.clone(),
            sub: sub.clone(),
        };
        advisory_watchers.insert(key, tokio::spawn(watcher.run()));
    }

    async fn pull_receiver(
        &self,
        consumer: jetstream::consumer::Consumer<pull::Config>,
        sub: &Subscription,
    ) -> Result<NatsReceiver, BrokerError> {
        Ok(NatsReceiver {
            owner: ReceiverId::next(),
            broker: self.clone(),
            sub: sub.clone(),
            consumer,
            pulls: tokio::sync::Mutex::new(Pulls::subscribe(&self.inner.client).await?),
            outstanding: Arc::new(AtomicU32::new(0)),
            closed: CancellationToken::new(),
        })
    }
}
