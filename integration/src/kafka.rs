//! The Kafka backend's conformance factory, against the broker `scripts/brokers` starts
//! (`RELIQ_KAFKA_URL` in `brokers.env`).

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, bail};
use async_trait::async_trait;
use reliq_conformance::Backend;
use reliq_core::{Broker, Subscription};
use reliq_kafka::KafkaBroker;

use crate::settings;

/// Client settings for tests: notice recreated topics quickly (the fault hooks delete and
/// recreate retry / DLQ topics while relays are subscribed to them).
pub(crate) const TEST_PARAMS: &str = "topic.metadata.refresh.interval.ms=2000";

/// The broker URL with the test parameters appended.
pub fn url() -> String {
    let base = settings::get("RELIQ_KAFKA_URL");
    let sep = if base.contains('?') { '&' } else { '?' };
    format!("{base}{sep}{TEST_PARAMS}")
}

/// The broker URL with the test parameters and a consumer-group prefix (`<prefix>.`), so
/// that consumers of different runs and tests never join each other's groups.
pub fn url_with_group_prefix(prefix: &str) -> String {
    format!("{}&reliq.group.prefix={prefix}.", url())
}

/// Connections to the real broker; fault hooks delete and recreate topics.
///
/// Kafka consumer group ids are global to the cluster, while the scenarios name their
/// consumers `c`, `a`, `b`… on per-test topics. Each backend instance (one per test)
/// therefore connects with its own `reliq.group.prefix`, so parallel tests (and earlier
/// runs) never join each other's groups.
pub struct KafkaBackend {
    admin: KafkaBroker,
    url: String,
}

impl KafkaBackend {
    /// A backend on the broker named by `RELIQ_KAFKA_URL`.
    ///
    /// # Panics
    /// When the URL is invalid (a configuration error in the test setup).
    pub fn new() -> Self {
        Self::on(&url(), None)
    }

    /// A backend whose consumers and publishes connect with `client_url` (default:
    /// `admin_url`) while the fault hooks and declarations use `admin_url`; both get a
    /// fresh consumer-group prefix.
    ///
    /// # Panics
    /// When a URL is invalid (a configuration error in the test setup).
    pub fn on(admin_url: &str, client_url: Option<&str>) -> Self {
        let prefix = reliq_conformance::support::unique("t");
        let with_prefix = |u: &str| format!("{u}&reliq.group.prefix={prefix}.");
        let admin = KafkaBroker::connect(&with_prefix(admin_url)).expect("a valid kafka:// URL");
        let url = with_prefix(client_url.unwrap_or(admin_url));
        Self { admin, url }
    }

    /// The URL consumers and publishes connect with.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The broker the fault hooks and declarations use.
    pub fn admin(&self) -> &KafkaBroker {
        &self.admin
    }

    async fn wait_exists(&self, topics: &[String], exists: bool) -> anyhow::Result<()> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        for t in topics {
            while self.admin.topic_exists(t).await? != exists {
                if tokio::time::Instant::now() >= deadline {
                    bail!(
                        "topic {t} did not become {}",
                        if exists { "visible" } else { "gone" }
                    );
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        Ok(())
    }

    async fn set_available(&self, topics: Vec<String>, available: bool) -> anyhow::Result<()> {
        if available {
            self.admin
                .ensure_topics(&topics)
                .await
                .context("recreating topics")?;
        } else {
            self.admin
                .delete_topics(&topics)
                .await
                .context("deleting topics")?;
        }
        self.wait_exists(&topics, available).await
    }
}

impl Default for KafkaBackend {
    fn default() -> Self {
        Self::new()
    }
}

#[async_trait]
impl Backend for KafkaBackend {
    fn schema_registry(&self) -> String {
        crate::settings::get("RELIQ_SCHEMA_REGISTRY_URL")
    }

    fn name(&self) -> &'static str {
        "kafka"
    }

    async fn connect(&self) -> anyhow::Result<Arc<dyn Broker>> {
        Ok(Arc::new(KafkaBroker::connect(&self.url)?))
    }

    fn tiers(&self) -> [Duration; 2] {
        [Duration::from_secs(1), Duration::from_secs(2)]
    }

    fn tolerance(&self) -> Duration {
        // Relay fetch wait (100 ms) + poll slice + produce/commit round trips, with room
        // for a loaded 2-core CI machine.
        Duration::from_millis(1500)
    }

    fn quiet_period(&self) -> Duration {
        Duration::from_secs(3)
    }

    async fn declare_source(&self, _broker: &Arc<dyn Broker>, topic: &str) -> anyhow::Result<()> {
        let topics = [topic.to_owned()];
        self.admin.ensure_topics(&topics).await?;
        self.wait_exists(&topics, true).await
    }

    async fn set_dead_letter_available(
        &self,
        _broker: &Arc<dyn Broker>,
        sub: &Subscription,
        available: bool,
    ) -> anyhow::Result<()> {
        self.set_available(vec![sub.dead_letter_name()], available)
            .await
    }

    async fn set_retry_available(
        &self,
        _broker: &Arc<dyn Broker>,
        sub: &Subscription,
        available: bool,
    ) -> anyhow::Result<()> {
        let topics = sub.retry_tiers.iter().map(|d| sub.retry_name(*d)).collect();
        self.set_available(topics, available).await
    }

    async fn unsettled(&self, _broker: &Arc<dyn Broker>, _sub: &Subscription) -> Option<usize> {
        // Kafka has no per-record lease to count; the runtime's own bound is checked.
        None
    }

    async fn objects(
        &self,
        _broker: &Arc<dyn Broker>,
        fragment: &str,
    ) -> anyhow::Result<Vec<String>> {
        let mut names = self.admin.topic_names().await?;
        names.retain(|n| n.contains(fragment));
        Ok(names)
    }
}
