//! The per-consumer topology reliq declares on RabbitMQ, derived from a portable
//! [`Subscription`], and a human-readable plan of it ([`plan`]).
//!
//! For a subscription `consumer = inventory`, `source = orders`, tiers 5 s and 30 s:
//!
//! | object | kind | arguments |
//! |---|---|---|
//! | `orders` | topic exchange, durable | — |
//! | `orders.inventory` | queue (quorum), bound to `orders` with the filter (or `#`) | `x-delivery-limit` (= delivery limit − 1, see [`rabbit_delivery_limit`]), DLX `""` → `orders.inventory.dlq`, at-least-once, `reject-publish` |
//! | `orders.inventory.retry.5000ms` | queue (quorum), no consumers | `x-message-ttl=5000`, DLX `""` → `orders.inventory`, at-least-once, `reject-publish` |
//! | `orders.inventory.retry.30000ms` | same, TTL 30 s | |
//! | `orders.inventory.dlq` | queue (quorum), the parking queue | — |
//!
//! The retry queues dead-letter through the *default* exchange straight into this
//! consumer's queue, never through the shared source exchange: a retry of one consumer
//! cannot reach another consumer bound to the same exchange. One queue per delay tier
//! (all messages of a queue share one TTL), so a short delay never waits behind a long one.

use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{Channel, ExchangeKind};
use reliq_core::{BrokerError, Subscription};
use std::fmt::Write as _;
use std::time::Duration;

use crate::{QueueType, RabbitError, RabbitOptions};

/// Every name one subscription uses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Names {
    /// The source topic exchange.
    pub exchange: String,
    /// The binding key (the filter, or `#`).
    pub binding_key: String,
    /// This consumer's queue: `<source>.<consumer>`.
    pub queue: String,
    /// The retry (TTL) queues, one per tier: `(delay, name)`.
    pub retry: Vec<(Duration, String)>,
    /// The parking queue (DLQ): `<source>.<consumer>.dlq`.
    pub parking: String,
}

impl Names {
    /// The names for `sub`.
    pub fn of(sub: &Subscription) -> Self {
        Self {
            exchange: sub.source.clone(),
            binding_key: sub.filter.clone().unwrap_or_else(|| "#".to_owned()),
            queue: queue_name(sub),
            retry: sub
                .retry_tiers
                .iter()
                .map(|d| (*d, sub.retry_name(*d)))
                .collect(),
            parking: sub.dead_letter_name(),
        }
    }
}

/// The name of `sub`'s consumer queue: `<source>.<consumer>`.
pub fn queue_name(sub: &Subscription) -> String {
    format!("{}.{}", sub.source, sub.consumer)
}

pub(crate) fn short(field: &str, value: &str) -> Result<ShortString, BrokerError> {
    ShortString::try_new(value).map_err(|_| BrokerError::Config {
        field: field.to_owned(),
        reason: format!(
            "`{}…` is longer than AMQP's 255-byte limit for names",
            value.chars().take(40).collect::<String>()
        ),
    })
}

fn long(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s.to_owned()))
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// One queue's declaration: name and arguments, as ordered `(key, value)` pairs (for the
/// plan) that also become the AMQP argument table.
#[derive(Clone, Debug)]
struct QueueSpec {
    name: String,
    role: &'static str,
    args: Vec<(&'static str, ArgValue)>,
}

#[derive(Clone, Debug)]
enum ArgValue {
    Text(String),
    Int(i64),
}

impl ArgValue {
    fn amqp(&self) -> AMQPValue {
        match self {
            Self::Text(s) => long(s),
            Self::Int(n) => AMQPValue::LongLongInt(*n),
        }
    }

    fn json(&self) -> String {
        match self {
            Self::Text(s) => serde_json::Value::String(s.clone()).to_string(),
            Self::Int(n) => n.to_string(),
        }
    }
}

impl QueueSpec {
    fn table(&self) -> FieldTable {
        let mut t = FieldTable::default();
        for (k, v) in &self.args {
            t.insert(ShortString::from(*k), v.amqp());
        }
        t
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

fn parking_spec(names: &Names, opts: &RabbitOptions) -> QueueSpec {
    QueueSpec {
        name: names.parking.clone(),
        role: "parking queue (DLQ)",
        args: base_args(opts),
    }
}

fn main_spec(sub: &Subscription, names: &Names, opts: &RabbitOptions) -> QueueSpec {
    let mut args = base_args(opts);
    if opts.queue_type == QueueType::Quorum {
        args.push((
            "x-delivery-limit",
            ArgValue::Int(rabbit_delivery_limit(sub.delivery_limit)),
        ));
    }
    args.extend(dead_lettering(opts, &names.parking));
    QueueSpec {
        name: names.queue.clone(),
        role: "consumer queue",
        args,
    }
}

fn retry_specs(names: &Names, opts: &RabbitOptions) -> Vec<QueueSpec> {
    names
        .retry
        .iter()
        .map(|(delay, name)| {
            let mut args = base_args(opts);
            args.push(("x-message-ttl", ArgValue::Int(millis(*delay))));
            args.extend(dead_lettering(opts, &names.queue));
            QueueSpec {
                name: name.clone(),
                role: "retry queue (TTL tier)",
                args,
            }
        })
        .collect()
}

async fn declare_queue(ch: &Channel, spec: &QueueSpec) -> Result<(), BrokerError> {
    ch.queue_declare(
        short("queue", &spec.name)?,
        QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        },
        spec.table(),
    )
    .await
    .map_err(|e| RabbitError::declare(&spec.name, e))?;
    Ok(())
}

/// RabbitMQ's `x-delivery-limit` counts *re*deliveries: a quorum queue dead-letters a
/// message when its delivery count (returns) goes above the limit, i.e. after
/// `limit + 1` deliveries (checked on 3.10.8). reliq's [`Subscription::delivery_limit`]
/// counts deliveries, so it maps to `limit - 1`.
pub fn rabbit_delivery_limit(deliveries: u32) -> i64 {
    i64::from(deliveries.saturating_sub(1))
}

/// Declare the source exchange (durable topic exchange), idempotently.
pub(crate) async fn declare_exchange(ch: &Channel, exchange: &str) -> Result<(), BrokerError> {
    ch.exchange_declare(
        short("exchange", exchange)?,
        ExchangeKind::Topic,
        ExchangeDeclareOptions {
            durable: true,
            ..ExchangeDeclareOptions::default()
        },
        FieldTable::default(),
    )
    .await
    .map_err(|e| RabbitError::declare(exchange, e))?;
    Ok(())
}

/// Declare the whole topology of `sub`, idempotently.
pub(crate) async fn declare_all(
    ch: &Channel,
    sub: &Subscription,
    opts: &RabbitOptions,
) -> Result<Names, BrokerError> {
    let names = Names::of(sub);
    declare_exchange(ch, &names.exchange).await?;
    declare_queue(ch, &parking_spec(&names, opts)).await?;
    declare_queue(ch, &main_spec(sub, &names, opts)).await?;
    ch.queue_bind(
        short("queue", &names.queue)?,
        short("exchange", &names.exchange)?,
        short("filter", &names.binding_key)?,
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .map_err(|e| RabbitError::declare(&names.queue, e))?;
    for spec in retry_specs(&names, opts) {
        declare_queue(ch, &spec).await?;
    }
    Ok(names)
}

/// Declare only the parking queue of `sub`.
pub(crate) async fn declare_parking(
    ch: &Channel,
    sub: &Subscription,
    opts: &RabbitOptions,
) -> Result<(), BrokerError> {
    declare_queue(ch, &parking_spec(&Names::of(sub), opts)).await
}

/// Declare only the retry queues of `sub`.
pub(crate) async fn declare_retry(
    ch: &Channel,
    sub: &Subscription,
    opts: &RabbitOptions,
) -> Result<(), BrokerError> {
    for spec in retry_specs(&Names::of(sub), opts) {
        declare_queue(ch, &spec).await?;
    }
    Ok(())
}

/// Whether `version` (e.g. `3.10.8`, `4.1.0`) is 3.12 or newer: the policy `apply-to`
/// value `quorum_queues` exists from 3.12 on; older brokers only know `queues`.
pub fn knows_quorum_apply_to(version: &str) -> bool {
    let mut parts = version
        .split(['.', '-', '+'])
        .map(|p| p.parse::<u32>().unwrap_or(0));
    let major = parts.next().unwrap_or(0);
    let minor = parts.next().unwrap_or(0);
    (major, minor) >= (3, 12)
}

fn policy_json(spec: &QueueSpec) -> String {
    // Policy keys are the queue argument names without `x-`; the queue type is not a
    // policy key.
    let body: Vec<String> = spec
        .args
        .iter()
        .filter(|(k, _)| *k != "x-queue-type")
        .map(|(k, v)| format!("\"{}\":{}", k.trim_start_matches("x-"), v.json()))
        .collect();
    format!("{{{}}}", body.join(","))
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

/// What [`Broker::subscribe`](reliq_core::Broker::subscribe) on a [`crate::RabbitBroker`] declares for `sub`, as text: every exchange,
/// queue, argument and binding, followed by the equivalent `rabbitmqctl set_policy`
/// commands (for operators who prefer policies, which can be changed without deleting a
/// queue). `server_version` picks the policy `--apply-to` value: `quorum_queues` on 3.12+,
/// `queues` before (3.10 rejects `quorum_queues`); unknown = `queues`.
///
/// ```
/// use std::time::Duration;
/// use reliq_core::Subscription;
/// let mut sub = Subscription::new("inventory", "orders");
/// sub.retry_tiers = vec![Duration::from_secs(5)];
/// let plan = reliq_rabbit::plan(&sub, &reliq_rabbit::RabbitOptions::default(), Some("3.10.8"));
/// assert!(plan.contains("orders.inventory.retry.5000ms"));
/// assert!(plan.contains("--apply-to queues"));
/// ```
pub fn plan(sub: &Subscription, opts: &RabbitOptions, server_version: Option<&str>) -> String {
    let names = Names::of(sub);
    let apply_to = match (opts.queue_type, server_version) {
        (QueueType::Quorum, Some(v)) if knows_quorum_apply_to(v) => "quorum_queues",
        _ => "queues",
    };
    let mut specs = vec![parking_spec(&names, opts), main_spec(sub, &names, opts)];
    specs.extend(retry_specs(&names, opts));
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# reliq topology for consumer `{}` on `{}` (RabbitMQ {})",
        sub.consumer,
        sub.source,
        server_version.unwrap_or("version unknown")
    );
    let _ = writeln!(out, "exchange {} type=topic durable=true", names.exchange);
    for spec in &specs {
        let args: Vec<String> = spec
            .args
            .iter()
            .map(|(k, v)| format!("{k}={}", v.json()))
            .collect();
        let _ = writeln!(
            out,
            "queue {} durable=true ({}) {}",
            spec.name,
            spec.role,
            args.join(" ")
        );
    }
    let _ = writeln!(
        out,
        "binding {} -> {} key={}",
        names.exchange, names.queue, names.binding_key
    );
    let _ = writeln!(
        out,
        "\n# equivalent policies (queue arguments take precedence):"
    );
    for spec in &specs {
        let json = policy_json(spec);
        if json == "{}" {
            continue;
        }
        let _ = writeln!(
            out,
            "rabbitmqctl set_policy reliq-{} '^{}$' '{}' --apply-to {}",
            spec.name,
            regex_escape(&spec.name),
            json,
            apply_to
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sub() -> Subscription {
        let mut s = Subscription::new("inventory", "orders").with_filter("order.*");
        s.retry_tiers = vec![Duration::from_secs(5), Duration::from_secs(30)];
        s.delivery_limit = 8;
        s
    }

    #[test]
    fn names_are_per_consumer() {
        let n = Names::of(&sub());
        assert_eq!(n.queue, "orders.inventory");
        assert_eq!(n.parking, "orders.inventory.dlq");
        assert_eq!(n.binding_key, "order.*");
        assert_eq!(
            n.retry,
            vec![
                (
                    Duration::from_secs(5),
                    "orders.inventory.retry.5000ms".to_owned()
                ),
                (
                    Duration::from_secs(30),
                    "orders.inventory.retry.30000ms".to_owned()
                ),
            ]
        );
    }

    #[test]
    fn retry_queues_dead_letter_to_this_consumer_only() {
        let opts = RabbitOptions::default();
        let n = Names::of(&sub());
        for spec in retry_specs(&n, &opts) {
            let get = |k: &str| {
                spec.args
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.json())
            };
            assert_eq!(get("x-dead-letter-exchange").as_deref(), Some("\"\""));
            assert_eq!(
                get("x-dead-letter-routing-key").as_deref(),
                Some("\"orders.inventory\"")
            );
            assert_eq!(
                get("x-dead-letter-strategy").as_deref(),
                Some("\"at-least-once\"")
            );
            assert_eq!(get("x-overflow").as_deref(), Some("\"reject-publish\""));
        }
    }

    #[test]
    fn plan_lists_objects_and_version_dependent_policies() {
        let opts = RabbitOptions::default();
        let old = plan(&sub(), &opts, Some("3.10.8"));
        assert!(old.contains("exchange orders type=topic"));
        assert!(old.contains("binding orders -> orders.inventory key=order.*"));
        assert!(old.contains(
            "rabbitmqctl set_policy reliq-orders.inventory '^orders\\.inventory$' \
             '{\"delivery-limit\":7,\"dead-letter-exchange\":\"\",\"dead-letter-routing-key\":\"orders.inventory.dlq\",\"overflow\":\"reject-publish\",\"dead-letter-strategy\":\"at-least-once\"}' --apply-to queues"
        ), "{old}");
        assert!(old.contains("\"message-ttl\":30000"));
        let new = plan(&sub(), &opts, Some("4.1.0"));
        assert!(new.contains("--apply-to quorum_queues") && !new.contains("--apply-to queues"));
        assert!(knows_quorum_apply_to("3.12.0") && !knows_quorum_apply_to("3.11.28"));
    }

    #[test]
    fn classic_queues_have_no_quorum_only_arguments() {
        let opts = RabbitOptions {
            queue_type: QueueType::Classic,
            ..RabbitOptions::default()
        };
        let n = Names::of(&sub());
        let main = main_spec(&sub(), &n, &opts);
        assert!(
            main.args
                .iter()
                .all(|(k, _)| *k != "x-delivery-limit" && *k != "x-dead-letter-strategy")
        );
    }
}
