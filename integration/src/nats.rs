//! The NATS JetStream backend's conformance factory (real server from scripts/brokers).

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use reliq_conformance::Backend;
use reliq_core::{Broker, Subscription};
use reliq_nats::{Faults, NatsBroker, NatsOptions};

use crate::settings;

/// Connections to the local NATS server; fault switches shared by all of them.
#[derive(Default)]
pub struct NatsBackend {
    faults: Arc<Faults>,
    /// The server's URL (default: `RELIQ_NATS_URL`).
    url: Option<String>,
}

impl NatsBackend {
    /// A fresh backend.
    pub fn new() -> Self {
        Self::default()
    }

    /// A fresh backend on the server (and with the credentials) `url` names.
    pub fn on(url: String) -> Self {
        Self {
            url: Some(url),
            ..Self::default()
        }
    }

    /// A typed connection (for NATS-specific tests).
    pub async fn connect_nats(&self) -> anyhow::Result<NatsBroker> {
        let url = self
            .url
            .clone()
            .unwrap_or_else(|| settings::get("RELIQ_NATS_URL"));
        let options = NatsOptions {
            faults: Some(self.faults.clone()),
            ..NatsOptions::default()
        };
        Ok(NatsBroker::connect_with(&url, options).await?)
    }
}

#[async_trait]
impl Backend for NatsBackend {
    fn schema_registry(&self) -> String {
        crate::settings::get("RELIQ_SCHEMA_REGISTRY_URL")
    }

    fn name(&self) -> &'static str {
        "nats"
    }

    async fn connect(&self) -> anyhow::Result<Arc<dyn Broker>> {
        Ok(Arc::new(self.connect_nats().await?))
    }

    fn tiers(&self) -> [Duration; 2] {
        [Duration::from_secs(1), Duration::from_secs(2)]
    }

    fn tolerance(&self) -> Duration {
        Duration::from_millis(1500)
    }

    fn quiet_period(&self) -> Duration {
        Duration::from_secs(2)
    }

    fn crash_lease(&self) -> Duration {
        // A crashed consumer's messages come back when ack_wait runs out.
        Duration::from_secs(2)
    }

    async fn declare_source(&self, _broker: &Arc<dyn Broker>, topic: &str) -> anyhow::Result<()> {
        self.connect_nats().await?.declare_source(topic).await?;
        Ok(())
    }

    async fn set_dead_letter_available(
        &self,
        _broker: &Arc<dyn Broker>,
        sub: &Subscription,
        available: bool,
    ) -> anyhow::Result<()> {
        let nats = self.connect_nats().await?;
        if available {
            nats.declare_dead_letters(sub).await?;
        } else {
            nats.delete_dead_letters(sub).await?;
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
        self.connect_nats().await.ok()?.ack_pending(sub).await.ok()
    }

    async fn objects(
        &self,
        _broker: &Arc<dyn Broker>,
        fragment: &str,
    ) -> anyhow::Result<Vec<String>> {
        let mut names = self.connect_nats().await?.object_names().await?;
        names.retain(|n| n.contains(fragment));
        Ok(names)
    }
}
