//! The broker's objects for a subscription, read back through the management API:
//! exchange, queues and streams with their settings in effect, the binding, and the retry
//! queues of earlier policies this plan has no tier for (with what they hold).

use reliq_core::{
    BrokerError, ExtraObject, Found, LiveObject, LiveTopology, ObjectKind, Plan, PlannedObject,
    Severity, Subscription, Wanted,
};
use serde_json::Value;

use crate::client::Inner;
use crate::management::Management;
use crate::names::Names;
use crate::options::encode_segment;
use crate::topology::live::{ListedPolicy, effective, number, policy_list};

fn management(inner: &Inner) -> Result<&Management, BrokerError> {
    inner
        .management
        .as_ref()
        .ok_or_else(|| BrokerError::Config {
            field: "reliq.management".into(),
            reason: "checking the topology reads queue arguments, bindings and policies from \
                 the management API: give its URL (RabbitOptions::management_url, or \
                 ?reliq.management=<port> in the broker URL)"
                .into(),
        })
}

/// The planned objects as the broker has them, and the retry queues of this consumer the
/// plan has no tier for.
pub(crate) async fn inspect(
    inner: &Inner,
    sub: &Subscription,
    plan: &Plan,
) -> Result<LiveTopology, BrokerError> {
    let api = management(inner)?;
    let v = encode_segment(&inner.vhost());
    let read = Reading {
        inner,
        api,
        names: Names::of(sub),
        policies: policy_list(&api.get(&format!("/api/policies/{v}")).await?),
        operator: policy_list(&api.get(&format!("/api/operator-policies/{v}")).await?),
        v,
    };
    let mut live = LiveTopology::default();
    for object in &plan.objects {
        if let Some(found) = read.planned(object).await? {
            live.push(object.kind, &object.name, found);
        }
    }
    let prefix = format!("{}.retry.", read.names.queue);
    let listed = api
        .get(&format!(
            "/api/queues/{}?columns=name,arguments,type",
            read.v
        ))
        .await?;
    for q in listed.as_array().into_iter().flatten() {
        let Some(name) = q.get("name").and_then(Value::as_str) else {
            continue;
        };
        let stale = name
            .strip_prefix(&prefix)
            .and_then(|rest| rest.strip_suffix("ms"))
            .is_some_and(|ms| ms.parse::<u64>().is_ok());
        if stale && plan.object(ObjectKind::Queue, name).is_none() {
            live.extra.push(read.stale_tier(q, name).await?);
        }
    }
    Ok(live)
}

/// What one inspection reads everything through: the management API, the vhost (encoded
/// for a path), the consumer's names and the vhost's policies.
struct Reading<'a> {
    inner: &'a Inner,
    api: &'a Management,
    v: String,
    names: Names,
    policies: Vec<ListedPolicy>,
    operator: Vec<ListedPolicy>,
}

impl Reading<'_> {
    /// One planned object as the broker has it (its effective settings: arguments, then
    /// policies), or `None` when the broker has no such object.
    async fn planned(&self, object: &PlannedObject) -> Result<Option<LiveObject>, BrokerError> {
        let v = &self.v;
        Ok(match object.kind {
            ObjectKind::Exchange => {
                let path = format!("/api/exchanges/{v}/{}", encode_segment(&object.name));
                self.api.get_if_exists(&path).await?.map(|e| {
                    LiveObject::default()
                        .with("type", Found::own(e["type"].clone()))
                        .with("durable", Found::own(e["durable"].clone()))
                })
            }
            ObjectKind::Queue | ObjectKind::Stream => {
                let path = format!("/api/queues/{v}/{}", encode_segment(&object.name));
                self.api
                    .get_if_exists(&path)
                    .await?
                    .map(|q| effective(&q, &object.name, &self.policies, &self.operator, object))
            }
            ObjectKind::Binding => {
                let path = format!(
                    "/api/bindings/{v}/e/{}/q/{}",
                    encode_segment(&self.names.exchange),
                    encode_segment(&self.names.queue)
                );
                let bound = self.api.get_if_exists(&path).await?.is_some_and(|list| {
                    list.as_array().into_iter().flatten().any(|b| {
                        b.get("routing_key").and_then(Value::as_str)
                            == Some(self.names.binding_key.as_str())
                    })
                });
                bound.then(LiveObject::default)
            }
            _ => None,
        })
    }

    /// A retry queue of an earlier policy (`q`, as listed): how many messages it holds
    /// and whether they still come back to the consumer's queue.
    async fn stale_tier(&self, q: &Value, name: &str) -> Result<ExtraObject, BrokerError> {
        let messages = crate::backlog::message_count(self.inner, name).await?;
        // Where its messages go when their TTL runs out: back to this consumer's queue
        // through the default exchange, as reliq declares a tier, or elsewhere.
        let probe = PlannedObject::new(ObjectKind::Queue, name, "")
            .with(
                "dead-letter-exchange",
                Wanted::Unset,
                Severity::Cosmetic,
                "",
            )
            .with(
                "dead-letter-routing-key",
                Wanted::Unset,
                Severity::Cosmetic,
                "",
            )
            .with("message-ttl", Wanted::Unset, Severity::Cosmetic, "");
        let found = effective(q, name, &self.policies, &self.operator, &probe);
        let get = |k: &str| {
            found
                .settings
                .iter()
                .find(|(key, _)| key == k)
                .map(|(_, f)| f.value.clone())
        };
        let returns = get("dead-letter-exchange") == Some(Value::String(String::new()))
            && get("dead-letter-routing-key") == Some(Value::String(self.names.queue.clone()))
            && get("message-ttl").as_ref().and_then(number).is_some();
        let (severity, note) = match (messages.unwrap_or(0), returns) {
            (0, _) => (
                Severity::Cosmetic,
                "a retry tier of an earlier policy, empty: delete it".to_owned(),
            ),
            (_, true) => (
                Severity::Cosmetic,
                "a retry tier of an earlier policy: its messages come back to the consumer \
                 queue as their TTL runs out; delete it once empty"
                    .to_owned(),
            ),
            (_, false) => (
                Severity::Breaking,
                "a retry tier of an earlier policy that does not dead-letter back to the \
                 consumer queue: what it holds is never delivered"
                    .to_owned(),
            ),
        };
        Ok(ExtraObject {
            kind: ObjectKind::Queue,
            name: name.to_owned(),
            messages,
            severity,
            note,
        })
    }
}
