//! The per-consumer topology reliq declares on RabbitMQ, derived from a portable
//! [`Subscription`], a human-readable plan of it ([`plan_text`]), and the plan as data
//! read back from the broker ([`live`]).
//!
//! For a subscription `consumer = inventory`, `source = orders`, tiers 5 s and 30 s:
//!
//! | object | kind | arguments |
//! |---|---|---|
//! | `orders` | topic exchange, durable | — |
//! | `orders.inventory.dlq` | queue (quorum), the landing queue | — |
//! | `orders.inventory.dlq.stream` | stream, the DLQ | — |
//! | `orders.inventory.dlq.removed` | stream, the DLQ's removal ledger | — |
//! | `orders.inventory` | queue (quorum), bound to `orders` with the filter (or `#`) | `x-delivery-limit` (= delivery limit − 1, see [`rabbit_delivery_limit`]), DLX `""` → `orders.inventory.dlq`, at-least-once, `reject-publish` |
//! | `orders.inventory.retry.5000ms` | queue (quorum), no consumers | `x-message-ttl=5000`, DLX `""` → `orders.inventory`, at-least-once, `reject-publish` |
//! | `orders.inventory.retry.30000ms` | same, TTL 30 s | |
//!
//! The retry queues dead-letter through the *default* exchange straight into this
//! consumer's queue, never through the shared source exchange: a retry of one consumer
//! cannot reach another consumer bound to the same exchange. One queue per delay tier
//! (all messages of a queue share one TTL), so a short delay never waits behind a long one.
//!
//! The consumer queue dead-letters (delivery limit) into the landing queue rather than
//! straight into the stream: on 3.10 a message dead-lettered into a stream loses its
//! `x-death` table (the stream keeps only flat headers), so neither the time nor the
//! routing key of the move could be read back. reliq moves each landed message into the
//! stream with a reliq record made from its `x-death` (see [`crate::dead_letters::RabbitDeadLetters`]),
//! confirmed before it acks the landing copy.

use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{Channel, ExchangeKind};
use reliq_core::{BrokerError, Subscription};
use std::fmt::Write as _;

use crate::management::{Management, Policy};
use crate::names::{Names, short};
use crate::{error::RabbitError, options::QueueType, options::RabbitOptions};

pub(crate) mod live;
mod spec;
pub(crate) use live::plan;
pub use spec::rabbit_delivery_limit;
use spec::{QueueSpec, dead_letter_specs, main_spec, retry_specs};

/// Where the settings of reliq's queues (delivery limit, TTL, dead-lettering, overflow)
/// live on this broker — resolved once at connect time from
/// [`RabbitOptions::queue_settings`].
#[derive(Clone, Debug)]
pub(crate) enum SettingsStore {
    /// As `x-` queue arguments: fixed for the queue's lifetime.
    Arguments,
    /// As one policy per queue, set through the management API before the queue is
    /// declared; the queue itself carries only `x-queue-type` (and can be re-tuned by
    /// changing the policy).
    Policies {
        api: Management,
        vhost: String,
        apply_to: &'static str,
        priority: i32,
    },
}

async fn declare_queue(
    ch: &Channel,
    spec: &QueueSpec,
    store: &SettingsStore,
) -> Result<(), BrokerError> {
    let in_policy = match store {
        SettingsStore::Arguments => false,
        SettingsStore::Policies {
            api,
            vhost,
            apply_to,
            priority,
        } => match spec.policy(apply_to, *priority) {
            Some(p) => {
                check_not_shadowed(api, vhost, &spec.name, spec.queue_type, &p).await?;
                // Before the declaration, so the queue never exists without its settings.
                ensure_policy(api, vhost, &p).await?;
                true
            }
            None => false,
        },
    };
    ch.queue_declare(
        short("queue", &spec.name)?,
        QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        },
        spec.table(!in_policy),
    )
    .await
    .map_err(|e| RabbitError::declare(&spec.name, e))?;
    Ok(())
}

/// Put `policy` unless the broker already has exactly it: every policy change makes
/// RabbitMQ re-match all queues of the vhost, so a restarting consumer must not cause one.
async fn ensure_policy(api: &Management, vhost: &str, policy: &Policy) -> Result<(), BrokerError> {
    let path = format!(
        "/api/policies/{}/{}",
        crate::options::encode_segment(vhost),
        crate::options::encode_segment(&policy.name)
    );
    let current = api.get(&path).await.ok();
    let same = current.as_ref().is_some_and(|c| {
        c.get("pattern").and_then(|v| v.as_str()) == Some(policy.pattern.as_str())
            && c.get("apply-to").and_then(|v| v.as_str()) == Some(policy.apply_to.as_str())
            && c.get("priority").and_then(serde_json::Value::as_i64)
                == Some(i64::from(policy.priority))
            && c.get("definition").and_then(|v| v.as_object()) == Some(&policy.definition)
    });
    if !same {
        tracing::info!(policy = %policy.name, definition = %serde_json::Value::Object(policy.definition.clone()), "setting RabbitMQ policy");
        api.put_policy(vhost, policy).await?;
    }
    Ok(())
}

/// Check that no other policy would win over `policy` on `queue`: RabbitMQ applies only
/// the highest-priority matching policy, so an operator's broader policy with a higher
/// (or equal) priority would silently drop reliq's delivery limit and dead-lettering.
/// Checked against the policy list rather than the queue's `policy` field, which the
/// management API only refreshes with the statistics (every 5 s by default).
async fn check_not_shadowed(
    api: &Management,
    vhost: &str,
    queue: &str,
    queue_type: QueueType,
    policy: &Policy,
) -> Result<(), BrokerError> {
    let list = api
        .get(&format!(
            "/api/policies/{}",
            crate::options::encode_segment(vhost)
        ))
        .await?;
    for other in list.as_array().into_iter().flatten() {
        let name = other.get("name").and_then(|v| v.as_str()).unwrap_or("");
        let priority = other
            .get("priority")
            .and_then(serde_json::Value::as_i64)
            .unwrap_or(0);
        if name == policy.name || priority < i64::from(policy.priority) {
            continue;
        }
        if live::policy_applies(other, queue, queue_type) {
            return Err(BrokerError::Config {
                field: "policy_priority".into(),
                reason: format!(
                    "policy `{name}` (priority {priority}) matches queue `{queue}` and would \
                     replace reliq's `{}` (priority {}): raise RabbitOptions::policy_priority \
                     above it, narrow that policy's pattern, or use operator policies for \
                     cluster-wide limits",
                    policy.name, policy.priority
                ),
            });
        }
    }
    Ok(())
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
    store: &SettingsStore,
) -> Result<Names, BrokerError> {
    let names = Names::of(sub);
    declare_exchange(ch, &names.exchange).await?;
    for spec in dead_letter_specs(&names, opts) {
        declare_queue(ch, &spec, store).await?;
    }
    declare_queue(ch, &main_spec(sub, &names, opts), store).await?;
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
        declare_queue(ch, &spec, store).await?;
    }
    Ok(names)
}

/// Declare only `sub`'s dead-letter stream, its ledger and the landing queue.
pub(crate) async fn declare_dead_letters(
    ch: &Channel,
    sub: &Subscription,
    opts: &RabbitOptions,
    store: &SettingsStore,
) -> Result<(), BrokerError> {
    for spec in dead_letter_specs(&Names::of(sub), opts) {
        declare_queue(ch, &spec, store).await?;
    }
    Ok(())
}

/// Declare only the retry queues of `sub`.
pub(crate) async fn declare_retry(
    ch: &Channel,
    sub: &Subscription,
    opts: &RabbitOptions,
    store: &SettingsStore,
) -> Result<(), BrokerError> {
    for spec in retry_specs(&Names::of(sub), opts) {
        declare_queue(ch, &spec, store).await?;
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

/// The policy `apply-to` value for `queue_type` on a broker of `server_version`.
pub(crate) fn apply_to(queue_type: QueueType, server_version: Option<&str>) -> &'static str {
    match (queue_type, server_version) {
        (QueueType::Quorum, Some(v)) if knows_quorum_apply_to(v) => "quorum_queues",
        _ => "queues",
    }
}

/// What [`Broker::subscribe`](reliq_core::Broker::subscribe) on a [`crate::client::RabbitBroker`] declares for `sub`, as text: every exchange,
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
/// let plan = reliq_rabbit::plan_text(&sub, &reliq_rabbit::RabbitOptions::default(), Some("3.10.8"));
/// assert!(plan.contains("orders.inventory.retry.5000ms"));
/// assert!(plan.contains("--apply-to queues"));
/// ```
pub fn plan_text(sub: &Subscription, opts: &RabbitOptions, server_version: Option<&str>) -> String {
    let names = Names::of(sub);
    let apply_to = apply_to(opts.queue_type, server_version);
    let mut specs = Vec::from(dead_letter_specs(&names, opts));
    specs.push(main_spec(sub, &names, opts));
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
        "\n# the same settings as policies (what reliq sets through the management API \
         when RabbitOptions::queue_settings resolves to Policies; the queues then carry \
         only x-queue-type):"
    );
    for policy in specs
        .iter()
        .filter_map(|s| s.policy(apply_to, opts.policy_priority))
    {
        let _ = writeln!(
            out,
            "rabbitmqctl set_policy {} '{}' '{}' --priority {} --apply-to {}",
            policy.name,
            policy.pattern,
            serde_json::Value::Object(policy.definition),
            policy.priority,
            policy.apply_to
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

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
        assert_eq!(n.parking, "orders.inventory.dlq.stream");
        assert_eq!(n.landing, "orders.inventory.dlq");
        assert_eq!(n.removed, "orders.inventory.dlq.removed");
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
        let old = plan_text(&sub(), &opts, Some("3.10.8"));
        assert!(old.contains("exchange orders type=topic"));
        assert!(old.contains("binding orders -> orders.inventory key=order.*"));
        assert!(old.contains(
            "rabbitmqctl set_policy reliq-orders.inventory '^orders\\.inventory$' \
             '{\"dead-letter-exchange\":\"\",\"dead-letter-routing-key\":\"orders.inventory.dlq\",\"dead-letter-strategy\":\"at-least-once\",\"delivery-limit\":7,\"overflow\":\"reject-publish\"}' --priority 10 --apply-to queues"
        ), "{old}");
        assert!(old.contains("\"message-ttl\":30000"));
        // The DLQ and its ledger are streams with no policy; the landing queue is the
        // consumer queue's dead-letter target and is declared first.
        assert!(old.contains(
            "queue orders.inventory.dlq.stream durable=true (dead-letter stream (the DLQ)) x-queue-type=\"stream\"\n"
        ), "{old}");
        assert!(old.contains(
            "queue orders.inventory.dlq.removed durable=true (removal ledger of the DLQ) x-queue-type=\"stream\"\n"
        ));
        let landing = old.find("queue orders.inventory.dlq durable").unwrap();
        assert!(landing < old.find("queue orders.inventory.dlq.stream").unwrap());
        assert!(!old.contains("set_policy reliq-orders.inventory.dlq.stream"));
        let new = plan_text(&sub(), &opts, Some("4.1.0"));
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
