//! What reliq declares for a subscription, as data: each queue's name, role and
//! arguments ([`QueueSpec`]), from which the declarations, the policies, the plan and
//! the plan text are all made.

use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use reliq_core::Subscription;
use std::time::Duration;

use crate::management::Policy;
use crate::names::Names;
use crate::{options::QueueType, options::RabbitOptions};

fn long(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s.to_owned()))
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// One queue's declaration: name and arguments, as ordered `(key, value)` pairs (for the
/// plan) that also become the AMQP argument table.
#[derive(Clone, Debug)]
pub(super) struct QueueSpec {
    pub(super) name: String,
    pub(super) queue_type: QueueType,
    pub(super) role: &'static str,
    pub(super) args: Vec<(&'static str, ArgValue)>,
}

#[derive(Clone, Debug)]
pub(super) enum ArgValue {
    Text(String),
    Int(i64),
}

impl ArgValue {
    pub(super) fn amqp(&self) -> AMQPValue {
        match self {
            Self::Text(s) => long(s),
            Self::Int(n) => AMQPValue::LongLongInt(*n),
        }
    }

    pub(super) fn json(&self) -> String {
        self.value().to_string()
    }
}

impl ArgValue {
    pub(super) fn value(&self) -> serde_json::Value {
        match self {
            Self::Text(s) => serde_json::Value::String(s.clone()),
            Self::Int(n) => serde_json::Value::from(*n),
        }
    }
}

/// The queue type is an argument only: it cannot be a policy key.
pub(super) const QUEUE_TYPE: &str = "x-queue-type";

impl QueueSpec {
    /// The AMQP argument table: every argument, or only the queue type when the rest is
    /// in a policy.
    pub(super) fn table(&self, all: bool) -> FieldTable {
        let mut t = FieldTable::default();
        for (k, v) in self.args.iter().filter(|(k, _)| all || *k == QUEUE_TYPE) {
            t.insert(ShortString::from(*k), v.amqp());
        }
        t
    }

    /// The policy name for this queue.
    pub(super) fn policy_name(&self) -> String {
        format!("reliq-{}", self.name)
    }

    /// The policy definition: the arguments without `x-` (the policy keys), sorted by
    /// key (as the management API returns them); empty when the queue has only a type.
    pub(super) fn policy_definition(&self) -> serde_json::Map<String, serde_json::Value> {
        self.args
            .iter()
            .filter(|(k, _)| *k != QUEUE_TYPE)
            .map(|(k, v)| (k.trim_start_matches("x-").to_owned(), v.value()))
            .collect()
    }

    /// The policy that carries this queue's settings, or `None` when it has none.
    pub(super) fn policy(&self, apply_to: &str, priority: i32) -> Option<Policy> {
        let definition = self.policy_definition();
        (!definition.is_empty()).then(|| Policy {
            name: self.policy_name(),
            pattern: format!("^{}$", regex_escape(&self.name)),
            apply_to: apply_to.to_owned(),
            priority,
            definition,
        })
    }
}

fn base_args(opts: &RabbitOptions) -> Vec<(&'static str, ArgValue)> {
    let mut args = vec![(
        "x-queue-type",
        ArgValue::Text(opts.queue_type.as_str().to_owned()),
    )];
    if let Some(expires) = opts.queue_expiry {
        args.push(("x-expires", ArgValue::Int(millis(expires).max(1))));
    }
    args
}

/// Arguments of a queue that dead-letters to `target` through the default exchange.
fn dead_lettering(opts: &RabbitOptions, target: &str) -> Vec<(&'static str, ArgValue)> {
    let mut args = vec![
        ("x-dead-letter-exchange", ArgValue::Text(String::new())),
        (
            "x-dead-letter-routing-key",
            ArgValue::Text(target.to_owned()),
        ),
        ("x-overflow", ArgValue::Text("reject-publish".to_owned())),
    ];
    if opts.queue_type == QueueType::Quorum {
        args.push((
            "x-dead-letter-strategy",
            ArgValue::Text("at-least-once".to_owned()),
        ));
    }
    args
}

/// A stream: no `x-expires` (streams reject it) and no policy (nothing to set). The
/// `queue_type` field only serves policy matching, which a stream never needs.
fn stream_spec(name: &str, role: &'static str, opts: &RabbitOptions) -> QueueSpec {
    QueueSpec {
        name: name.to_owned(),
        queue_type: opts.queue_type,
        role,
        args: vec![(QUEUE_TYPE, ArgValue::Text("stream".to_owned()))],
    }
}

/// The landing queue, the dead-letter stream and its removal ledger, in declaration
/// order (the landing queue first: a stream without its landing queue is an orphan).
pub(super) fn dead_letter_specs(names: &Names, opts: &RabbitOptions) -> [QueueSpec; 3] {
    [
        QueueSpec {
            name: names.landing.clone(),
            queue_type: opts.queue_type,
            role: "landing queue (the broker's own dead-lettering; reliq moves it to the DLQ)",
            args: base_args(opts),
        },
        stream_spec(&names.parking, "dead-letter stream (the DLQ)", opts),
        stream_spec(&names.removed, "removal ledger of the DLQ", opts),
    ]
}

pub(super) fn main_spec(sub: &Subscription, names: &Names, opts: &RabbitOptions) -> QueueSpec {
    let mut args = base_args(opts);
    if opts.queue_type == QueueType::Quorum {
        args.push((
            "x-delivery-limit",
            ArgValue::Int(rabbit_delivery_limit(sub.delivery_limit)),
        ));
    }
    args.extend(dead_lettering(opts, &names.landing));
    QueueSpec {
        name: names.queue.clone(),
        queue_type: opts.queue_type,
        role: "consumer queue",
        args,
    }
}

pub(super) fn retry_specs(names: &Names, opts: &RabbitOptions) -> Vec<QueueSpec> {
    names
        .retry
        .iter()
        .map(|(delay, name)| {
            let mut args = base_args(opts);
            args.push(("x-message-ttl", ArgValue::Int(millis(*delay))));
            args.extend(dead_lettering(opts, &names.queue));
            QueueSpec {
                name: name.clone(),
                queue_type: opts.queue_type,
                role: "retry queue (TTL tier)",
                args,
            }
        })
        .collect()
}

/// RabbitMQ's `x-delivery-limit` counts *re*deliveries: a quorum queue dead-letters a
/// message when its delivery count (returns) goes above the limit, i.e. after
/// `limit + 1` deliveries (checked on 3.10.8). reliq's [`Subscription::delivery_limit`]
/// counts deliveries, so it maps to `limit - 1`.
pub fn rabbit_delivery_limit(deliveries: u32) -> i64 {
    i64::from(deliveries.saturating_sub(1))
}

fn regex_escape(name: &str) -> String {
    let mut out = String::with_capacity(name.len() + 8);
    for c in name.chars() {
        if "\\.^$|?*+()[]{}".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}
