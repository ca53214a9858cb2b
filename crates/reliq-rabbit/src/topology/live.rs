//! The plan as data ([`plan`]) and how the broker's objects, read back through the
//! management API ([`crate::inspect`]), are compared with it: the policies and operator
//! policies that apply to each queue and the settings in effect ([`effective`]).
//!
//! A setting in effect is resolved as RabbitMQ resolves it: the queue's `x-` argument,
//! else the definition of the highest-priority policy that matches the queue; for the
//! limits where RabbitMQ takes the smaller of the values (`delivery-limit`,
//! `message-ttl`, `expires`, `max-length`, `max-length-bytes`), the smallest of the
//! argument, the policy and the operator policy. The policies are matched here from the
//! policy lists rather than read from each queue's `policy` field, which the management
//! API refreshes only with its statistics (every 5 s by default).

use reliq_core::{
    Channel, Found, LiveObject, ObjectKind, Plan, PlannedObject, Severity, Subscription, Traffic,
    Wanted,
};
use serde_json::{Value, json};

use super::spec::{ArgValue, QUEUE_TYPE, QueueSpec, dead_letter_specs, main_spec, retry_specs};
use crate::names::Names;
use crate::{options::QueueType, options::RabbitOptions};

/// Where RabbitMQ takes the smallest of argument, policy and operator policy.
const SMALLEST_WINS: &[&str] = &[
    "delivery-limit",
    "message-ttl",
    "expires",
    "max-length",
    "max-length-bytes",
];

fn why(key: &str, role: &str) -> &'static str {
    let retry = role.starts_with("retry");
    match key {
        "delivery-limit" => {
            "a crash loop is dead-lettered at another count (unset: never on 3.x, after 20 deliveries on 4.x)"
        }
        "dead-letter-exchange" | "dead-letter-routing-key" if retry => {
            "an expired retry does not come back to this consumer's queue"
        }
        "dead-letter-exchange" | "dead-letter-routing-key" => {
            "the broker's dead letters do not reach reliq's landing queue (or are dropped)"
        }
        "dead-letter-strategy" => {
            "at-most-once dead-lettering can lose a message between the queues"
        }
        "overflow" => "a full queue drops its oldest messages instead of refusing the publish",
        "message-ttl" => "a retry waits another time than its tier",
        _ => "the queue behaves otherwise than reliq declared it",
    }
}

fn queue_object(spec: &QueueSpec, opts: &RabbitOptions) -> PlannedObject {
    let stream = spec
        .args
        .iter()
        .any(|(k, v)| *k == QUEUE_TYPE && matches!(v, ArgValue::Text(t) if t == "stream"));
    let kind = if stream {
        ObjectKind::Stream
    } else {
        ObjectKind::Queue
    };
    let mut o = PlannedObject::new(kind, &spec.name, spec.role)
        .with(
            "type",
            Wanted::equals(if stream {
                "stream"
            } else {
                spec.queue_type.as_str()
            }),
            Severity::Breaking,
            "another queue type: another delivery limit, replication and dead-lettering",
        )
        .with(
            "durable",
            Wanted::equals(true),
            Severity::Breaking,
            "the queue and its messages are gone after a broker restart",
        );
    for (k, v) in spec.args.iter().filter(|(k, _)| *k != QUEUE_TYPE) {
        let key = k.trim_start_matches("x-");
        let severity = if key == "expires" {
            Severity::Cosmetic
        } else {
            Severity::Breaking
        };
        o = o.with(
            key,
            Wanted::Equals(v.value()),
            severity,
            why(key, spec.role),
        );
    }
    let mut unset: Vec<(&str, &str)> = Vec::new();
    if stream {
        unset.push((
            "max-age",
            "dead letters are deleted by the stream's retention",
        ));
        unset.push((
            "max-length-bytes",
            "dead letters are deleted by the stream's retention",
        ));
    } else {
        unset.push((
            "max-length",
            "a full queue refuses publishes or drops messages",
        ));
        unset.push((
            "max-length-bytes",
            "a full queue refuses publishes or drops messages",
        ));
        unset.push((
            "message-ttl",
            "messages expire out of the queue before they are handled",
        ));
        if opts.queue_expiry.is_none() {
            unset.push((
                "expires",
                "the broker deletes the queue, with its messages, when it idles",
            ));
        }
    }
    for (key, why) in unset {
        if !o.settings.iter().any(|s| s.key == key) {
            o = o.with(key, Wanted::Unset, Severity::Breaking, why);
        }
    }
    o
}

fn binding_name(names: &Names) -> String {
    format!(
        "{} -> {} key={}",
        names.exchange, names.queue, names.binding_key
    )
}

/// A queue reliq publishes to through the default exchange (its name is the routing key).
fn queue_channel(traffic: Traffic, queue: &str) -> Channel {
    Channel::new(traffic, queue).binding(
        "amqp",
        json!({
            "is": "queue",
            "queue": { "name": queue, "durable": true, "exclusive": false, "autoDelete": false },
            "bindingVersion": "0.3.0",
        }),
    )
}

/// What [`Broker::subscribe`](reliq_core::Broker::subscribe) declares for `sub`, as data.
pub(crate) fn plan(sub: &Subscription, opts: &RabbitOptions) -> Plan {
    let names = Names::of(sub);
    let mut specs = Vec::from(dead_letter_specs(&names, opts));
    specs.push(main_spec(sub, &names, opts));
    specs.extend(retry_specs(&names, opts));
    // Producers publish to the exchange with a routing key; the consumer reads its own
    // queue, bound with the subscription's key.
    let source = Channel::new(Traffic::Source, &names.binding_key)
        .binding(
            "amqp",
            json!({
                "is": "routingKey",
                "exchange": { "name": names.exchange, "type": "topic", "durable": true },
                "bindingVersion": "0.3.0",
            }),
        )
        .read_binding("amqp", json!({ "ack": true, "bindingVersion": "0.3.0" }));
    let mut plan = Plan::new("rabbit", sub).with(
        PlannedObject::new(ObjectKind::Exchange, &names.exchange, "source exchange")
            .carrying(source)
            .with(
                "type",
                Wanted::equals("topic"),
                Severity::Breaking,
                "routing keys are matched otherwise than the subscription's filter",
            )
            .with(
                "durable",
                Wanted::equals(true),
                Severity::Breaking,
                "the exchange and its bindings are gone after a broker restart",
            ),
    );
    for spec in &specs {
        let object = queue_object(spec, opts);
        let traffic = if spec.name == names.parking {
            Some(Traffic::DeadLetters)
        } else {
            names
                .retry
                .iter()
                .find(|(_, name)| *name == spec.name)
                .map(|(delay, _)| Traffic::retry([*delay]))
        };
        plan = plan.with(match traffic {
            Some(traffic) => object.carrying(queue_channel(traffic, &spec.name)),
            None => object,
        });
    }
    plan.with(PlannedObject::new(
        ObjectKind::Binding,
        binding_name(&names),
        "the consumer queue's binding",
    ))
    .not_checking(
        "users, permissions and the cluster's queue-leader placement (not a consumer's \
         topology); the delivery limit of a classic queue (it has none)",
    )
}

/// A policy from `/api/policies` or `/api/operator-policies`.
pub(crate) struct ListedPolicy {
    name: String,
    priority: i64,
    apply_to: String,
    pattern: Option<regex::Regex>,
    definition: serde_json::Map<String, Value>,
}

impl ListedPolicy {
    fn from_json(v: &Value) -> Self {
        let pattern = v.get("pattern").and_then(Value::as_str).unwrap_or("");
        let name = v
            .get("name")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_owned();
        Self {
            pattern: match regex::Regex::new(pattern) {
                Ok(re) => Some(re),
                Err(e) => {
                    tracing::warn!(policy = %name, pattern, error = %e, "cannot evaluate a policy pattern; assuming it does not match");
                    None
                }
            },
            name,
            priority: v.get("priority").and_then(Value::as_i64).unwrap_or(0),
            apply_to: v
                .get("apply-to")
                .and_then(Value::as_str)
                .unwrap_or("all")
                .to_owned(),
            definition: v
                .get("definition")
                .and_then(Value::as_object)
                .cloned()
                .unwrap_or_default(),
        }
    }

    /// Whether it applies to a queue named `queue` of type `queue_type` (`quorum`,
    /// `classic`, `stream`).
    fn applies(&self, queue: &str, queue_type: &str) -> bool {
        let kind = match self.apply_to.as_str() {
            "all" | "queues" => true,
            "quorum_queues" => queue_type == "quorum",
            "classic_queues" => queue_type == "classic",
            "streams" => queue_type == "stream",
            _ => false,
        };
        kind && self.pattern.as_ref().is_some_and(|re| re.is_match(queue))
    }
}

/// Whether the policy `other` (JSON from the policy list) applies to `queue` of
/// `queue_type`.
pub(crate) fn policy_applies(other: &Value, queue: &str, queue_type: QueueType) -> bool {
    ListedPolicy::from_json(other).applies(queue, queue_type.as_str())
}

/// The highest-priority policy of `list` that applies (RabbitMQ applies only that one).
fn winner<'a>(list: &'a [ListedPolicy], queue: &str, queue_type: &str) -> Option<&'a ListedPolicy> {
    list.iter()
        .filter(|p| p.applies(queue, queue_type))
        .max_by_key(|p| p.priority)
}

pub(crate) fn number(v: &Value) -> Option<i64> {
    v.as_i64()
        .or_else(|| v.as_str().and_then(|s| s.parse().ok()))
}

/// A queue's settings in effect from its arguments and the policies that apply.
pub(crate) fn effective(
    queue: &Value,
    name: &str,
    policies: &[ListedPolicy],
    operator: &[ListedPolicy],
    planned: &PlannedObject,
) -> LiveObject {
    let queue_type = queue
        .get("type")
        .and_then(Value::as_str)
        .unwrap_or("classic");
    let args = queue
        .get("arguments")
        .and_then(Value::as_object)
        .cloned()
        .unwrap_or_default();
    let policy = winner(policies, name, queue_type);
    let op = winner(operator, name, queue_type);
    let mut live = LiveObject {
        governed_by: policy.map(|p| format!("policy `{}` applies", p.name)),
        ..LiveObject::default()
    }
    .with("type", Found::own(queue_type))
    .with(
        "durable",
        Found::own(queue.get("durable").cloned().unwrap_or(Value::Null)),
    );
    if policy.is_none() {
        live.governed_by = Some("no policy applies".into());
    }
    for setting in planned
        .settings
        .iter()
        .filter(|s| s.key != "type" && s.key != "durable")
    {
        let key = setting.key.as_str();
        let mut candidates: Vec<(Value, Option<String>)> = Vec::new();
        if let Some(v) = args.get(&format!("x-{key}")) {
            candidates.push((v.clone(), None));
        }
        if let Some(p) = policy
            && let Some(v) = p.definition.get(key)
        {
            candidates.push((v.clone(), Some(format!("policy `{}`", p.name))));
        }
        if let Some(p) = op
            && let Some(v) = p.definition.get(key)
        {
            candidates.push((v.clone(), Some(format!("operator policy `{}`", p.name))));
        }
        let chosen = if SMALLEST_WINS.contains(&key) {
            candidates
                .into_iter()
                .min_by_key(|(v, _)| number(v).unwrap_or(i64::MAX))
        } else {
            // The argument wins over the policy; operator policies cannot set these keys.
            candidates.into_iter().next()
        };
        if let Some((value, set_by)) = chosen {
            live = live.with(key, Found { value, set_by });
        }
    }
    live
}

pub(crate) fn policy_list(v: &Value) -> Vec<ListedPolicy> {
    v.as_array()
        .into_iter()
        .flatten()
        .map(ListedPolicy::from_json)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use reliq_core::LiveTopology;
    use serde_json::json;
    use std::time::Duration;

    fn policy(name: &str, pattern: &str, priority: i64, definition: Value) -> ListedPolicy {
        ListedPolicy::from_json(&json!({
            "name": name, "pattern": pattern, "priority": priority,
            "apply-to": "queues", "definition": definition,
        }))
    }

    #[test]
    fn settings_resolve_as_rabbitmq_resolves_them() {
        let mut sub = Subscription::new("inventory", "orders");
        sub.retry_tiers = vec![Duration::from_secs(5)];
        sub.delivery_limit = 5;
        let plan = plan(&sub, &RabbitOptions::default());
        let planned = plan
            .object(ObjectKind::Queue, "orders.inventory")
            .expect("consumer queue planned");
        let queue = json!({
            "type": "quorum", "durable": true,
            "arguments": {"x-queue-type": "quorum", "x-delivery-limit": 4,
                "x-dead-letter-exchange": "", "x-dead-letter-routing-key": "orders.inventory.dlq",
                "x-dead-letter-strategy": "at-least-once", "x-overflow": "reject-publish"},
        });
        // Arguments only: as planned.
        let found = effective(&queue, "orders.inventory", &[], &[], planned);
        let live = LiveTopology::default().found(ObjectKind::Queue, "orders.inventory", found);
        let only_queue = Plan {
            objects: vec![planned.clone()],
            ..plan.clone()
        };
        assert_eq!(reliq_core::seam::compare(&only_queue, &live), vec![]);
        // A policy may add a length limit; an operator policy's smaller delivery limit wins.
        let policies = [policy("ops", "^orders\\.", 20, json!({"max-length": 1000}))];
        let operator = [policy("cap", ".*", 0, json!({"delivery-limit": 2}))];
        let found = effective(&queue, "orders.inventory", &policies, &operator, planned);
        let live = LiveTopology::default().found(ObjectKind::Queue, "orders.inventory", found);
        let drift: Vec<String> = reliq_core::seam::compare(&only_queue, &live)
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(drift.len(), 2, "{drift:?}");
        assert!(drift[0].starts_with("breaks delivery guarantees: queue `orders.inventory`: delivery-limit wanted = 4, found 2 (operator policy `cap`)"), "{drift:?}");
        assert!(
            drift[1].contains("max-length wanted unset, found 1000 (policy `ops`)"),
            "{drift:?}"
        );
        assert!(!policies[0].applies("billing.x", "quorum"));
    }
}
