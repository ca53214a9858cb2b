//! The Amazon SQS backend's conformance factory (the moto server from scripts/brokers).

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use reliq_conformance::Backend;
use reliq_core::{Broker, Subscription};
use reliq_sqs::{Faults, SqsBroker, SqsOptions};

use crate::settings;

/// Connections to the local SQS endpoint; fault switches shared by all of them.
#[derive(Default)]
pub struct SqsBackend {
    faults: Arc<Faults>,
}

impl SqsBackend {
    /// A fresh backend.
    pub fn new() -> Self {
        Self::default()
    }

    /// A typed connection (for SQS-specific tests).
    pub async fn connect_sqs(&self) -> anyhow::Result<SqsBroker> {
        let url = settings::get("RELIQ_SQS_URL");
        let options = SqsOptions {
            faults: Some(self.faults.clone()),
            ..SqsOptions::default()
        };
        Ok(SqsBroker::connect_with(&url, options).await?)
    }
}

#[async_trait]
impl Backend for SqsBackend {
    fn schema_registry(&self) -> String {
        crate::settings::get("RELIQ_SCHEMA_REGISTRY_URL")
    }

    fn name(&self) -> &'static str {
        "sqs"
    }

    async fn connect(&self) -> anyhow::Result<Arc<dyn Broker>> {
        Ok(Arc::new(self.connect_sqs().await?))
    }

    fn tiers(&self) -> [Duration; 2] {
        // Visibility timeouts are whole seconds, and the single-process emulator re-checks
        // a long poll about once a second: 6 s leaves room for the receive round trips
        // between a failure and its retry (the non-blocking scenario handles 10 messages,
        // one at a time, in that window — 4 s was too short on a moto loaded by the rest
        // of the suite).
        [Duration::from_secs(6), Duration::from_secs(12)]
    }

    fn tolerance(&self) -> Duration {
        // Up to 1 s from rounding the delay (with jitter) up to whole seconds, and up to
        // 1 s from moto, whose long poll re-checks messages that became visible once a
        // second.
        Duration::from_millis(2500)
    }

    fn quiet_period(&self) -> Duration {
        Duration::from_secs(2)
    }

    fn failure_burst(&self) -> usize {
        // moto fails 1,100 messages once (receive + visibility change each) in well over a
        // minute. A retry waits as the message's visibility timeout, in the queue, so no
        // window of the consumer's fills up: 300 is still ~20x the scenario's prefetch.
        300
    }

    fn backpressure_backlog(&self) -> u32 {
        // moto takes ~3.5 ms per message even in batches and slows down with queue depth:
        // 10,000 messages alone would outlast the per-test limit. 1,500 still queues far
        // more than the prefetch bound being checked.
        1_500
    }

    fn crash_lease(&self) -> Duration {
        // A crashed consumer's messages come back when the visibility timeout runs out.
        // 3 s, not 2: the dead consumer's last long poll (half a lease) must end before
        // the message is visible again, or it takes the message (SQS counts that receive
        // towards maxReceiveCount though no handler saw it) — on a loaded moto a 1 s poll
        // can run late by more than a second.
        Duration::from_secs(3)
    }

    async fn declare_source(&self, _broker: &Arc<dyn Broker>, _topic: &str) -> anyhow::Result<()> {
        // SQS has no topics: a topic is the set of consumer queues subscribed to it, and
        // every scenario subscribes before it publishes.
        Ok(())
    }

    async fn set_dead_letter_available(
        &self,
        _broker: &Arc<dyn Broker>,
        sub: &Subscription,
        available: bool,
    ) -> anyhow::Result<()> {
        let sqs = self.connect_sqs().await?;
        if available {
            sqs.declare_dead_letters(sub).await?;
        } else {
            sqs.delete_dead_letters(sub).await?;
        }
        Ok(())
    }

    async fn set_retry_available(
        &self,
        _broker: &Arc<dyn Broker>,
        sub: &Subscription,
        available: bool,
    ) -> anyhow::Result<()> {
        self.faults.set_retry_available(&sub.consumer, available);
        Ok(())
    }

    async fn unsettled(&self, _broker: &Arc<dyn Broker>, sub: &Subscription) -> Option<usize> {
        self.connect_sqs().await.ok()?.not_visible(sub).await.ok()
    }

    async fn objects(
        &self,
        _broker: &Arc<dyn Broker>,
        fragment: &str,
    ) -> anyhow::Result<Vec<String>> {
        // Every queue name of a test starts with its (sanitized) source name.
        let mut names = self.connect_sqs().await?.queue_names(fragment).await?;
        names.retain(|n| n.contains(fragment));
        Ok(names)
    }
}
