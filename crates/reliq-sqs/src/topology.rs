//! The plan of a subscription's queues and how SQS has them: the consumer queue (its
//! visibility timeout, redrive policy and tags) and the DLQ (its retention).
//!
//! Settings are named as `GetQueueAttributes` names them, the redrive policy's fields as
//! `RedrivePolicy.<field>` and tags as `tag:<key>`. Retries wait in place (the visibility
//! timeout), so there are no tier queues that an earlier policy could leave behind.

use aws_sdk_sqs::types::QueueAttributeName;
use reliq_core::{
    BrokerError, Channel, Found, LiveObject, LiveTopology, ObjectKind, Plan, PlannedObject,
    Severity, Subscription, Traffic, Wanted,
};
use serde_json::json;

use crate::client::{SqsBroker, whole_seconds};
use crate::error::sdk_error;
use crate::names::{self, FILTER_TAG, ROLE_TAG, SOURCE_TAG};

/// How long the DLQ keeps a message: 14 days, SQS's maximum.
pub(crate) const DEAD_LETTER_RETENTION_SECS: i64 = 14 * 24 * 60 * 60;

/// The redrive policy's `maxReceiveCount` for `sub` (SQS takes 1 to 1000).
pub(crate) fn max_receive_count(sub: &Subscription) -> u32 {
    sub.delivery_limit.clamp(1, 1000)
}

const TARGET: &str = "RedrivePolicy.deadLetterTargetArn";
const MAX_RECEIVES: &str = "RedrivePolicy.maxReceiveCount";

fn tag(key: &str) -> String {
    format!("tag:{key}")
}

/// The DLQ as the SQS binding describes a queue.
fn dead_letter_binding(dlq: &str, fifo: bool) -> serde_json::Value {
    json!({
        "name": dlq,
        "fifoQueue": fifo,
        "messageRetentionPeriod": DEAD_LETTER_RETENTION_SECS,
    })
}

impl SqsBroker {
    /// The plan; the DLQ's ARN is read when the DLQ exists (the redrive target must be
    /// exactly it), else its name stands in (and the DLQ is missing).
    pub(crate) async fn plan_topology(&self, sub: &Subscription) -> Result<Plan, BrokerError> {
        let fifo = self.inner.options.fifo;
        let dlq = names::dead_letter_queue_name(sub, fifo);
        let target = match self.queue_url(&dlq).await? {
            Some(url) => self.queue_arn(&url).await?,
            None => dlq.clone(),
        };
        let filter = match sub.filter.as_deref().filter(|f| *f != "#") {
            Some(f) => Wanted::equals(f),
            None => Wanted::Unset,
        };
        // Producers publish to the topic; reliq sends each message to the queues tagged
        // with it, so the consumer's queue is where its messages (and waiting retries) are.
        let queue_name = names::queue_name(sub, fifo);
        let queue = PlannedObject::new(ObjectKind::Queue, &queue_name, "consumer queue")
        .with(
            TARGET,
            Wanted::equals(target),
            Severity::Breaking,
            "crash-looping messages go to another queue than this consumer's DLQ (or nowhere)",
        )
        .with(
            MAX_RECEIVES,
            Wanted::equals(max_receive_count(sub)),
            Severity::Breaking,
            "a crash loop is dead-lettered at another count",
        )
        .with(
            tag(SOURCE_TAG),
            Wanted::equals(sub.source.clone()),
            Severity::Breaking,
            "publishers of the topic do not find this queue (they keep the queues tagged with it)",
        )
        .with(
            tag(FILTER_TAG),
            filter,
            Severity::Breaking,
            "publishers route other messages to this queue than its subscription asks for",
        )
        .with(
            "VisibilityTimeout",
            Wanted::equals(whole_seconds(sub.lease).max(1)),
            Severity::Cosmetic,
            "a receive is leased for another time than the subscription's lease (reliq keeps long handlers leased)",
        )
        .carrying(Channel::new(Traffic::Source, &queue_name).binding(
            "sqs",
            json!({
                "queue": {
                    "name": queue_name,
                    "fifoQueue": fifo,
                    "visibilityTimeout": whole_seconds(sub.lease).max(1),
                    "redrivePolicy": {
                        "deadLetterQueue": { "name": dlq },
                        "maxReceiveCount": max_receive_count(sub),
                    },
                },
                "deadLetterQueue": dead_letter_binding(&dlq, fifo),
                "bindingVersion": "0.2.0",
            }),
        ));
        let dead_letters = PlannedObject::new(ObjectKind::Queue, &dlq, "the DLQ")
            .carrying(Channel::new(Traffic::DeadLetters, &dlq).binding(
                "sqs",
                json!({ "queue": dead_letter_binding(&dlq, fifo), "bindingVersion": "0.2.0" }),
            ))
            .with(
                "MessageRetentionPeriod",
                Wanted::equals(DEAD_LETTER_RETENTION_SECS),
                Severity::Breaking,
                "SQS deletes dead letters older than the retention before anyone replays them",
            )
            .with(
                tag(ROLE_TAG),
                Wanted::equals("dead-letter"),
                Severity::Cosmetic,
                "the queue is not marked as a DLQ for operators listing queues",
            );
        Ok(Plan::new("sqs", sub)
            .with(dead_letters)
            .with(queue)
            .not_checking(
                "the consumer queue's MessageRetentionPeriod (SQS deletes unconsumed messages \
                 after it; 4 days unless its owner chose otherwise) and access policies",
            ))
    }

    pub(crate) async fn inspect_topology(&self, plan: &Plan) -> Result<LiveTopology, BrokerError> {
        let mut live = LiveTopology::default();
        for object in &plan.objects {
            let Some(url) = self.queue_url(&object.name).await? else {
                continue;
            };
            live.push(
                ObjectKind::Queue,
                &object.name,
                self.live_queue(&url).await?,
            );
        }
        Ok(live)
    }

    async fn live_queue(&self, url: &str) -> Result<LiveObject, BrokerError> {
        let client = &self.inner.client;
        let attributes = client
            .get_queue_attributes()
            .queue_url(url)
            .attribute_names(QueueAttributeName::All)
            .send()
            .await
            .map_err(|e| sdk_error("GetQueueAttributes", e))?;
        let mut object = LiveObject::default();
        let attributes = attributes.attributes.unwrap_or_default();
        for (key, value) in &attributes {
            if *key == QueueAttributeName::RedrivePolicy {
                // A policy that is not JSON is reported as its text under both fields.
                let policy: serde_json::Value = serde_json::from_str(value)
                    .unwrap_or_else(|_| serde_json::Value::String(value.clone()));
                for (name, field) in [
                    (TARGET, "deadLetterTargetArn"),
                    (MAX_RECEIVES, "maxReceiveCount"),
                ] {
                    let found = policy.get(field).cloned().unwrap_or_else(|| policy.clone());
                    object = object.with(name, Found::own(found));
                }
            } else {
                object = object.with(key.as_str(), Found::own(value.clone()));
            }
        }
        let tags = client
            .list_queue_tags()
            .queue_url(url)
            .send()
            .await
            .map_err(|e| sdk_error("ListQueueTags", e))?;
        for (key, value) in tags.tags.unwrap_or_default() {
            object = object.with(tag(&key), Found::own(value));
        }
        Ok(object)
    }
}
