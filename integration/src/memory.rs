//! The memory backend's conformance factory.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use reliq_conformance::Backend;
use reliq_core::{Broker, Subscription};
use reliq_memory::MemoryBroker;

/// One fresh in-process broker per test; every `connect` shares it.
#[derive(Default)]
pub struct MemoryBackend {
    broker: MemoryBroker,
}

impl MemoryBackend {
    /// A fresh backend.
    pub fn new() -> Self {
        Self::default()
    }
}

#[async_trait]
impl Backend for MemoryBackend {
    fn schema_registry(&self) -> String {
        crate::settings::get("RELIQ_SCHEMA_REGISTRY_URL")
    }

    fn name(&self) -> &'static str {
        "memory"
    }

    async fn connect(&self) -> anyhow::Result<Arc<dyn Broker>> {
        Ok(Arc::new(self.broker.clone()))
    }

    fn tiers(&self) -> [Duration; 2] {
        // Virtual time: production-like delays cost nothing.
        [Duration::from_secs(5), Duration::from_secs(30)]
    }

    fn tolerance(&self) -> Duration {
        Duration::from_millis(100)
    }

    fn quiet_period(&self) -> Duration {
        Duration::from_secs(2)
    }

    async fn declare_source(&self, _broker: &Arc<dyn Broker>, topic: &str) -> anyhow::Result<()> {
        self.broker.declare_topic(topic);
        Ok(())
    }

    async fn set_dead_letter_available(
        &self,
        _broker: &Arc<dyn Broker>,
        sub: &Subscription,
        available: bool,
    ) -> anyhow::Result<()> {
        self.broker
            .faults()
            .set_dead_letter_available(&sub.consumer, available);
        Ok(())
    }

    async fn set_retry_available(
        &self,
        _broker: &Arc<dyn Broker>,
        sub: &Subscription,
        available: bool,
    ) -> anyhow::Result<()> {
        self.broker
            .faults()
            .set_retry_available(&sub.consumer, available);
        Ok(())
    }

    async fn unsettled(&self, _broker: &Arc<dyn Broker>, sub: &Subscription) -> Option<usize> {
        Some(self.broker.depth(sub).1)
    }

    async fn objects(
        &self,
        _broker: &Arc<dyn Broker>,
        fragment: &str,
    ) -> anyhow::Result<Vec<String>> {
        let mut names = self.broker.object_names();
        names.retain(|n| n.contains(fragment));
        Ok(names)
    }
}
