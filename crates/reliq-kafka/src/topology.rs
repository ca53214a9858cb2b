//! The topics reliq creates (the source, the retry tiers, the DLQ and its removal ledger,
//! with the admin API) and the metadata look-up that tells whether a topic exists.

use std::time::Duration;

use rdkafka::admin::{AdminOptions, NewTopic, TopicReplication};
use rdkafka::error::RDKafkaErrorCode;
use rdkafka::producer::Producer as _;
use reliq_core::BrokerError;

use crate::broker::Inner;
use crate::error::KafkaError;
use crate::names::ledger_topic;

const ADMIN_TIMEOUT: Duration = Duration::from_secs(30);

impl Inner {
    pub(crate) async fn ensure_topics(&self, topics: &[String]) -> Result<(), KafkaError> {
        let new: Vec<NewTopic<'_>> = topics
            .iter()
            .map(|t| self.new_topic(t, self.config.partitions))
            .collect();
        self.create_topics(&new).await
    }

    fn new_topic<'a>(&self, name: &'a str, partitions: i32) -> NewTopic<'a> {
        NewTopic::new(
            name,
            partitions,
            TopicReplication::Fixed(self.config.replication),
        )
    }

    /// Create `sub`'s DLQ topic `dlq` where missing — kept until removed (no retention
    /// limit: a dead letter leaves only through the reader's `remove`) — and its removal
    /// ledger `<dlq>.removed` (one partition, compacted; see `dead_letters`).
    pub(crate) async fn ensure_dead_letter_topics(&self, dlq: &str) -> Result<(), KafkaError> {
        let ledger = ledger_topic(dlq);
        let new = [
            self.new_topic(dlq, self.config.partitions)
                .set("retention.ms", "-1")
                .set("retention.bytes", "-1"),
            self.new_topic(&ledger, 1)
                .set("cleanup.policy", "compact")
                // Compaction skips the active segment: roll it hourly so tombstoned
                // keys really go.
                .set("segment.ms", "3600000"),
        ];
        self.create_topics(&new).await
    }

    async fn create_topics(&self, new: &[NewTopic<'_>]) -> Result<(), KafkaError> {
        let results = self
            .admin
            .create_topics(
                new,
                &AdminOptions::new().operation_timeout(Some(ADMIN_TIMEOUT)),
            )
            .await?;
        for r in results {
            if let Err((topic, code)) = r
                && code != RDKafkaErrorCode::TopicAlreadyExists
            {
                return Err(KafkaError::Admin {
                    topic,
                    reason: format!("creating the topic: {code}"),
                    source: Some(Box::new(code)),
                });
            }
        }
        Ok(())
    }

    /// Delete `topics` (missing topics are not an error).
    pub(crate) async fn delete_topics(&self, topics: &[String]) -> Result<(), KafkaError> {
        let names: Vec<&str> = topics.iter().map(String::as_str).collect();
        let results = self
            .admin
            .delete_topics(
                &names,
                &AdminOptions::new().operation_timeout(Some(ADMIN_TIMEOUT)),
            )
            .await?;
        for r in results {
            if let Err((topic, code)) = r
                && code != RDKafkaErrorCode::UnknownTopicOrPartition
            {
                return Err(KafkaError::Admin {
                    topic,
                    reason: format!("deleting the topic: {code}"),
                    source: Some(Box::new(code)),
                });
            }
        }
        Ok(())
    }

    /// Wait until freshly created `topics` show up with partitions in the metadata.
    pub(crate) async fn wait_visible(&self, topics: &[String]) -> Result<(), BrokerError> {
        let deadline = tokio::time::Instant::now() + ADMIN_TIMEOUT;
        for t in topics {
            while !self.topic_exists(t).await.map_err(BrokerError::from)? {
                if tokio::time::Instant::now() >= deadline {
                    return Err(BrokerError::Timeout(ADMIN_TIMEOUT));
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        Ok(())
    }

    pub(crate) async fn topic_exists(&self, topic: &str) -> Result<bool, KafkaError> {
        let producer = self.route_producer.clone();
        let name = topic.to_owned();
        let metadata = tokio::task::spawn_blocking(move || {
            producer
                .client()
                .fetch_metadata(Some(&name), Duration::from_secs(10))
        })
        .await
        .map_err(|e| KafkaError::Admin {
            topic: topic.to_owned(),
            reason: format!("looking the topic up: the metadata task failed: {e}"),
            source: Some(Box::new(e)),
        })??;
        Ok(metadata
            .topics()
            .iter()
            .any(|t| t.name() == topic && t.error().is_none() && !t.partitions().is_empty()))
    }
}
