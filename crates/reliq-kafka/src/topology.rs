//! The topics reliq creates (the source, the retry tiers, the DLQ and its removal ledger,
//! with the admin API) and the metadata look-up that tells whether a topic exists.

use std::time::Duration;

use rdkafka::admin::{AdminOptions, NewTopic, TopicReplication};
use rdkafka::error::RDKafkaErrorCode;
use rdkafka::producer::Producer as _;
use reliq_core::{
    BrokerError, ExtraObject, Found, LiveObject, LiveTopology, ObjectKind, Plan, Severity,
};

use crate::client::Inner;
use crate::error::{KafkaError, authorization_resource};
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
        let options = AdminOptions::new().operation_timeout(Some(ADMIN_TIMEOUT));
        let results = self
            .refusals
            .or_refused(
                &self.config.bootstrap,
                self.admin.create_topics(new, &options),
            )
            .await
            .map_err(|e| KafkaError::Refused(Box::new(e)))??;
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
        let options = AdminOptions::new().operation_timeout(Some(ADMIN_TIMEOUT));
        let results = self
            .refusals
            .or_refused(
                &self.config.bootstrap,
                self.admin.delete_topics(&names, &options),
            )
            .await
            .map_err(|e| KafkaError::Refused(Box::new(e)))??;
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
        let lookup = tokio::task::spawn_blocking(move || {
            producer
                .client()
                .fetch_metadata(Some(&name), Duration::from_secs(10))
        });
        let metadata = self
            .refusals
            .or_refused(&self.config.bootstrap, lookup)
            .await
            .map_err(|e| KafkaError::Refused(Box::new(e)))?
            .map_err(|e| KafkaError::Admin {
                topic: topic.to_owned(),
                reason: format!("looking the topic up: the metadata task failed: {e}"),
                source: Some(Box::new(e)),
            })??;
        let Some(found) = metadata.topics().iter().find(|t| t.name() == topic) else {
            return Ok(false);
        };
        if let Some(code) = found.error().map(RDKafkaErrorCode::from)
            && authorization_resource(code).is_some()
        {
            return Err(KafkaError::Admin {
                topic: topic.to_owned(),
                reason: format!("looking the topic up: {code}"),
                source: Some(Box::new(code)),
            });
        }
        Ok(found.error().is_none() && !found.partitions().is_empty())
    }
}

/// Kafka's own `cleanup.policy`, `retention.ms`, … as `DescribeConfigs` names them; the
/// partition count and the replication factor (`partitions`, `replication.factor`) come
/// from the metadata.
mod plan {
    use std::time::Duration;

    use reliq_core::{
        Channel, ObjectKind, Plan, PlannedObject, Severity, Subscription, Traffic, Wanted,
    };
    use serde_json::json;

    use crate::names::{ledger_topic, relay_group};
    use crate::options::{KafkaConfig, RetryMode};

    pub(crate) const PARTITIONS: &str = "partitions";
    pub(crate) const REPLICATION: &str = "replication.factor";
    /// The topic configs a plan may name (what `DescribeConfigs` is asked for).
    pub(crate) const CONFIGS: &[&str] = &["cleanup.policy", "retention.ms", "retention.bytes"];

    fn millis(d: Duration) -> i64 {
        i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
    }

    fn replicated(object: PlannedObject, config: &KafkaConfig) -> PlannedObject {
        object.with(
            REPLICATION,
            Wanted::AtLeast(i64::from(config.replication)),
            Severity::Breaking,
            "a confirmed record lives on fewer brokers than `reliq.replication` asks for",
        )
    }

    /// A topic as an AsyncAPI channel: its Kafka binding (with the partitions and
    /// replicas reliq creates it with, `created`; a source's are its owner's), and the
    /// group that reads it.
    fn kafka_channel(
        traffic: Traffic,
        topic: &str,
        created: Option<&KafkaConfig>,
        reader: Option<&str>,
    ) -> Channel {
        let mut binding = json!({ "topic": topic, "bindingVersion": "0.5.0" });
        if let Some(config) = created {
            binding["partitions"] = json!(config.partitions);
            binding["replicas"] = json!(config.replication);
        }
        let channel = Channel::new(traffic, topic).binding("kafka", binding);
        match reader {
            Some(group) => channel.read_binding(
                "kafka",
                json!({ "groupId": { "type": "string", "const": group }, "bindingVersion": "0.5.0" }),
            ),
            None => channel,
        }
    }

    fn deleted_not_compacted(object: PlannedObject, what: &str) -> PlannedObject {
        object.with(
            "cleanup.policy",
            Wanted::equals("delete"),
            Severity::Breaking,
            format!("compaction keeps only the last {what} of each key"),
        )
    }

    /// What a consumer of `sub` needs: the source, a retry topic per tier (non-blocking
    /// retries), the DLQ and its removal ledger; the group and the relay groups are made
    /// when they first join.
    pub(crate) fn plan(sub: &Subscription, config: &KafkaConfig) -> Plan {
        let group = |g: &str| format!("{}{g}", config.group_prefix);
        let mut plan = Plan::new("kafka", sub)
            .with(replicated(
                PlannedObject::new(ObjectKind::Topic, &sub.source, "source topic").carrying(
                    kafka_channel(
                        Traffic::Source,
                        &sub.source,
                        None,
                        Some(&group(&sub.consumer)),
                    ),
                ),
                config,
            ))
            .with(
                PlannedObject::new(
                    ObjectKind::ConsumerGroup,
                    group(&sub.consumer),
                    "the consumer's group",
                )
                .made_on_first_use(),
            );
        if config.retry_mode == RetryMode::Topics {
            for delay in &sub.retry_tiers {
                let tier = reliq_core::seam::duration_text(*delay);
                let topic = PlannedObject::new(
                    ObjectKind::Topic,
                    sub.retry_name(*delay),
                    format!("retry tier {tier}"),
                )
                .with(
                    "retention.ms",
                    Wanted::AtLeast(millis(*delay)),
                    Severity::Breaking,
                    format!("retries are deleted before their {tier} delay is over"),
                )
                .with(
                    PARTITIONS,
                    Wanted::equals(config.partitions),
                    Severity::Cosmetic,
                    "the tier's relay runs on another number of partitions than `reliq.partitions`",
                )
                .carrying(kafka_channel(
                    Traffic::retry([*delay]),
                    &sub.retry_name(*delay),
                    Some(config),
                    Some(&group(&relay_group(sub, *delay))),
                ));
                plan = plan
                    .with(replicated(deleted_not_compacted(topic, "retry"), config))
                    .with(
                        PlannedObject::new(
                            ObjectKind::ConsumerGroup,
                            group(&relay_group(sub, *delay)),
                            format!("relay of retry tier {tier}"),
                        )
                        .made_on_first_use(),
                    );
            }
        }
        let dlq = sub.dead_letter_name();
        let forever = "dead letters are deleted before anyone replays them";
        let dead_letters = PlannedObject::new(ObjectKind::Topic, &dlq, "the DLQ")
            .carrying(kafka_channel(
                Traffic::DeadLetters,
                &dlq,
                Some(config),
                None,
            ))
            .with(
                "retention.ms",
                Wanted::equals(-1),
                Severity::Breaking,
                forever,
            )
            .with(
                "retention.bytes",
                Wanted::equals(-1),
                Severity::Breaking,
                forever,
            );
        let ledger = PlannedObject::new(
            ObjectKind::Topic,
            ledger_topic(&dlq),
            "removal ledger of the DLQ",
        )
        .with(
            "cleanup.policy",
            Wanted::equals("compact"),
            Severity::Breaking,
            "removal records are deleted by retention: removed dead letters are listed and replayed again",
        );
        plan.with(replicated(
            deleted_not_compacted(dead_letters, "dead letter"),
            config,
        ))
        .with(replicated(ledger, config))
        .not_checking(
            "the source topic's partitions and retention (its owner's choice), ACLs, and \
             the brokers' min.insync.replicas",
        )
    }
}

pub(crate) use plan::plan;

use crate::backlog::{LAG_WAIT, group_lag};
use crate::names::{relay_group, retry_tier};
use crate::options::RetryMode;

fn config_source(source: &rdkafka::admin::ConfigSource) -> Option<String> {
    use rdkafka::admin::ConfigSource as S;
    match source {
        S::DynamicTopic => None,
        S::Default => Some("Kafka's default".into()),
        S::StaticBroker => Some("broker config (server.properties)".into()),
        S::DynamicBroker | S::DynamicDefaultBroker => Some("dynamic broker config".into()),
        S::Unknown => Some("unknown source".into()),
    }
}

/// A topic as the metadata has it.
struct TopicShape {
    name: String,
    partitions: usize,
    replication: usize,
}

impl Inner {
    /// The planned topics and groups as the cluster has them, and this consumer's retry
    /// topics the plan has no tier for (with the records their relay group has not
    /// consumed).
    pub(crate) async fn inspect(
        self: &std::sync::Arc<Self>,
        sub: &reliq_core::Subscription,
        plan: &Plan,
    ) -> Result<LiveTopology, BrokerError> {
        let planned_groups: Vec<String> = plan
            .objects
            .iter()
            .filter(|o| o.kind == ObjectKind::ConsumerGroup)
            .map(|o| o.name.clone())
            .collect();
        let inner = self.clone();
        let (topics, groups) =
            tokio::task::spawn_blocking(move || inner.topics_and_groups(planned_groups))
                .await
                .map_err(|e| BrokerError::Other(Box::new(e)))??;

        let mut live = LiveTopology::default();
        for g in groups {
            live.push(ObjectKind::ConsumerGroup, g, LiveObject::default());
        }
        let planned: Vec<&TopicShape> = topics
            .iter()
            .filter(|t| plan.object(ObjectKind::Topic, &t.name).is_some())
            .collect();
        let configs = self.topic_configs(&planned).await?;
        for (t, object) in planned.iter().zip(configs) {
            live.push(
                ObjectKind::Topic,
                &t.name,
                object
                    .with(plan::PARTITIONS, Found::own(t.partitions))
                    .with(plan::REPLICATION, Found::own(t.replication)),
            );
        }
        for t in &topics {
            if let Some(delay) = retry_tier(sub, &t.name)
                && plan.object(ObjectKind::Topic, &t.name).is_none()
            {
                live.extra.push(self.stale_tier(sub, delay, &t.name).await?);
            }
        }
        Ok(live)
    }

    /// Every topic's shape (by metadata), and which of `planned_groups` the cluster knows
    /// (blocking: librdkafka's metadata and group calls).
    fn topics_and_groups(
        &self,
        planned_groups: Vec<String>,
    ) -> Result<(Vec<TopicShape>, Vec<String>), BrokerError> {
        let client = self.route_producer.client();
        let metadata = client.fetch_metadata(None, LAG_WAIT).map_err(|e| {
            BrokerError::connection(format!("reading the cluster's topics: {e}")).caused_by(e)
        })?;
        let topics: Vec<TopicShape> = metadata
            .topics()
            .iter()
            .filter(|t| t.error().is_none() && !t.partitions().is_empty())
            .map(|t| TopicShape {
                name: t.name().to_owned(),
                partitions: t.partitions().len(),
                replication: t
                    .partitions()
                    .iter()
                    .map(|p| p.replicas().len())
                    .min()
                    .unwrap_or(0),
            })
            .collect();
        let mut groups = Vec::new();
        for g in planned_groups {
            let list = client.fetch_group_list(Some(&g), LAG_WAIT).map_err(|e| {
                BrokerError::connection(format!("describing group `{g}`: {e}")).caused_by(e)
            })?;
            // An unknown group is described as `Dead`.
            if list
                .groups()
                .iter()
                .any(|i| i.name() == g && i.state() != "Dead")
            {
                groups.push(g);
            }
        }
        Ok((topics, groups))
    }

    /// A retry topic of an earlier policy: the records its relay group has not consumed,
    /// and whether this consumer still drains them.
    async fn stale_tier(
        self: &std::sync::Arc<Self>,
        sub: &reliq_core::Subscription,
        delay: std::time::Duration,
        topic: &str,
    ) -> Result<ExtraObject, BrokerError> {
        let inner = self.clone();
        let (group, topic_) = (relay_group(sub, delay), topic.to_owned());
        let lag = tokio::task::spawn_blocking(move || group_lag(&inner, &group, &topic_))
            .await
            .map_err(|e| BrokerError::Other(Box::new(e)))??;
        let drained = self.config.retry_mode == RetryMode::Topics;
        let (severity, note) = match (lag, drained) {
            (0, _) => (
                Severity::Cosmetic,
                "a retry tier of an earlier policy, empty: delete it".to_owned(),
            ),
            (_, true) => (
                Severity::Cosmetic,
                "a retry tier of an earlier policy: the consumer relays what it holds \
                 until it is empty, then it can be deleted"
                    .to_owned(),
            ),
            (_, false) => (
                Severity::Breaking,
                "a retry tier of an earlier policy: blocking retries run no relay, so \
                 what it holds is never delivered"
                    .to_owned(),
            ),
        };
        Ok(ExtraObject {
            kind: ObjectKind::Topic,
            name: topic.to_owned(),
            messages: Some(lag),
            severity,
            note,
        })
    }

    /// The planned configs of `topics`, each with who set it.
    async fn topic_configs(&self, topics: &[&TopicShape]) -> Result<Vec<LiveObject>, BrokerError> {
        use rdkafka::admin::ResourceSpecifier;
        if topics.is_empty() {
            return Ok(Vec::new());
        }
        let specifiers: Vec<ResourceSpecifier<'_>> = topics
            .iter()
            .map(|t| ResourceSpecifier::Topic(&t.name))
            .collect();
        let results = self
            .admin
            .describe_configs(
                &specifiers,
                &AdminOptions::new().request_timeout(Some(ADMIN_TIMEOUT)),
            )
            .await
            .map_err(|e| {
                BrokerError::connection(format!("describing topic configs: {e}")).caused_by(e)
            })?;
        topics
            .iter()
            .zip(results)
            .map(|(t, r)| {
                let resource = r.map_err(|code| {
                    BrokerError::connection(format!(
                        "describing the configs of topic `{}`: {code}",
                        t.name
                    ))
                })?;
                let mut object = LiveObject::default();
                for entry in resource
                    .entries
                    .iter()
                    .filter(|e| plan::CONFIGS.contains(&e.name.as_str()))
                {
                    if let Some(value) = &entry.value {
                        object = object.with(
                            entry.name.clone(),
                            Found {
                                value: value.clone().into(),
                                set_by: config_source(&entry.source),
                            },
                        );
                    }
                }
                Ok(object)
            })
            .collect()
    }
}
