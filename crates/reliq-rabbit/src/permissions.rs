//! What a service's RabbitMQ user must be allowed on its vhost
//! ([`Broker::permissions`](reliq_core::Broker::permissions)), from the names in
//! [`Names`].
//!
//! RabbitMQ grants a user three regular expressions per vhost, matched against exchange
//! and queue names: **configure** (declare, delete), **write** (publish to an exchange;
//! bind a queue) and **read** (consume, get, purge; the exchange side of a binding). The
//! checks reliq's calls meet:
//!
//! | call | needs |
//! |---|---|
//! | `exchange.declare` of the source | configure on the exchange |
//! | `queue.declare` of the consumer queue, the retry queues, the landing queue and the streams | configure on the queue; with a dead-letter exchange also read on the queue and write on that exchange (`""`, checked as `amq.default`) |
//! | `queue.bind` of the consumer queue to the source | write on the queue, read on the exchange |
//! | `basic.consume` of the consumer queue, the landing queue; the streams (dead-letter reads) | read on the queue |
//! | `basic.publish` of retry and dead-letter copies, ledger entries, replays (to one consumer's queue) | write on `amq.default` (they go through the default exchange) |
//! | `basic.publish` to a destination | write on its exchange |
//!
//! Passive declarations (reliq's existence checks and backlog counts) need nothing.
//! The retry queues are granted by prefix (`<source>.<consumer>.retry.`), so the queues of
//! a changed retry policy are covered without a new grant. Policies
//! ([`QueueSettings::Policies`](crate::options::QueueSettings)) are set through the management
//! API, which wants the user tag `policymaker` besides these permissions.

use reliq_core::{Access, Grant, NamePattern, Permissions, Subscription};

use crate::names::Names;

const PLACEHOLDER: &str = "<user>";
/// The default exchange, as RabbitMQ's permission checks name it.
const DEFAULT_EXCHANGE: &str = "amq.default";

fn exchange(name: &str, operations: &[&'static str], reason: &str) -> Grant {
    Grant::literal("exchange", name, operations, reason)
}

fn queue(name: &str, operations: &[&'static str], reason: &str) -> Grant {
    Grant::literal("queue", name, operations, reason)
}

/// The grants of `access` on a vhost, as `rabbitmqctl` commands. `user` comes from the
/// connection's URL when the access names no principal; `policies` adds the user tag
/// the management API's policy calls need.
pub(crate) fn permissions(
    access: &Access,
    vhost: &str,
    user: Option<&str>,
    policies: bool,
) -> Permissions {
    let mut grants = Vec::new();
    for sub in &access.consumers {
        consumer(sub, access.operator, &mut grants);
    }
    for destination in &access.publishes {
        grants.push(exchange(destination, &["write"], "publish"));
    }
    let grants = Permissions::merged(grants);
    let principal = access
        .principal
        .clone()
        .or_else(|| user.filter(|u| !u.is_empty()).map(str::to_owned))
        .unwrap_or_else(|| PLACEHOLDER.to_owned());
    let document = document(&principal, vhost, access, &grants, policies);
    Permissions {
        backend: "rabbit",
        principal,
        grants,
        document,
    }
}

fn consumer(sub: &Subscription, operator: bool, out: &mut Vec<Grant>) {
    let names = Names::of(sub);
    out.push(exchange(
        &names.exchange,
        &["configure", "read"],
        "declare the source exchange; bind the consumer queue to it",
    ));
    out.push(queue(
        &names.queue,
        &["configure", "write", "read"],
        "declare the consumer queue (with its dead-letter exchange) and bind it; consume",
    ));
    out.push(Grant::prefixed(
        "queue",
        format!("{}.retry.", names.queue),
        &["configure", "read"],
        "declare the retry queues (TTL, dead-lettering back to the consumer queue), this \
         policy's and a later one's",
    ));
    out.push(queue(
        &names.landing,
        &["configure", "read"],
        "declare the landing queue; move what the delivery limit dead-letters there into \
         the stream",
    ));
    out.push(queue(
        &names.parking,
        &["configure"],
        "declare the dead-letter stream",
    ));
    out.push(queue(
        &names.removed,
        &["configure"],
        "declare the dead-letter stream's removal ledger",
    ));
    out.push(exchange(
        DEFAULT_EXCHANGE,
        &["write"],
        "retry and dead-letter copies go through the default exchange; the queues \
         dead-letter through it",
    ));
    if operator {
        out.push(queue(
            &names.parking,
            &["read"],
            "operator: browse, get and count dead letters",
        ));
        out.push(queue(
            &names.removed,
            &["read"],
            "operator: skip removed dead letters",
        ));
        out.push(exchange(
            DEFAULT_EXCHANGE,
            &["write"],
            "operator: replay to the consumer's queue; record removals in the ledger",
        ));
    }
}

/// One name as a regex alternative: escaped, and `.*` after a prefix.
fn alternative(grant: &Grant) -> String {
    let name = regex::escape(&grant.name);
    match grant.pattern {
        NamePattern::Literal => name,
        NamePattern::Prefixed => format!("{name}.*"),
    }
}

/// The regex RabbitMQ matches for `operation`: `^(a|b\.c|d\..*)$`, or `^$` (nothing).
pub(crate) fn regex_for(grants: &[Grant], operation: &str) -> String {
    let names: Vec<String> = grants
        .iter()
        .filter(|g| g.operations.contains(&operation))
        .map(alternative)
        .collect();
    if names.is_empty() {
        "^$".to_owned()
    } else {
        format!("^({})$", names.join("|"))
    }
}

/// A shell word in single quotes (a `'` inside becomes `'\''`).
fn quoted(word: &str) -> String {
    format!("'{}'", word.replace('\'', r"'\''"))
}

/// One comment per grant, then the `rabbitmqctl set_permissions` line (and the tag line
/// for policies). `set_permissions` replaces the user's permissions on the vhost: a user
/// that runs several services gets one `permissions` call with all of them.
fn document(
    principal: &str,
    vhost: &str,
    access: &Access,
    grants: &[Grant],
    policies: bool,
) -> String {
    let mut doc = format!(
        "# RabbitMQ permissions for {principal} on vhost {vhost}: {}\n",
        access.summary()
    );
    for g in grants {
        let pattern = match g.pattern {
            NamePattern::Literal => String::new(),
            NamePattern::Prefixed => " (prefix)".to_owned(),
        };
        doc.push_str(&format!(
            "# {} {}{pattern}: {}: {}\n",
            g.resource,
            g.name,
            g.operations.join(", "),
            g.reason
        ));
    }
    doc.push_str(&format!(
        "rabbitmqctl set_permissions -p {} {} {} {} {}\n",
        quoted(vhost),
        quoted(principal),
        quoted(&regex_for(grants, "configure")),
        quoted(&regex_for(grants, "write")),
        quoted(&regex_for(grants, "read")),
    ));
    if policies {
        doc.push_str(
            "# reliq sets its queue settings as policies (management API): the user needs the \
             tag policymaker (set_user_tags replaces the user's tags: list them all)\n",
        );
        doc.push_str(&format!(
            "rabbitmqctl set_user_tags {} policymaker\n",
            quoted(principal)
        ));
    }
    doc
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn matches(regex: &str, name: &str) -> bool {
        regex::Regex::new(regex).expect("regex").is_match(name)
    }

    fn line(p: &Permissions) -> Vec<String> {
        let line = p
            .document
            .lines()
            .find(|l| l.starts_with("rabbitmqctl set_permissions"))
            .expect("the permissions line");
        line.split('\'')
            .skip(1)
            .step_by(2)
            .map(str::to_owned)
            .collect()
    }

    #[test]
    fn a_consumer_may_declare_bind_and_consume_its_own_queues_only() {
        let mut sub = Subscription::new("billing", "orders.eu");
        sub.retry_tiers = vec![Duration::from_secs(5)];
        let p = permissions(&Access::consumer(sub), "shop", Some("billing-svc"), false);
        let [vhost, user, configure, write, read] = line(&p).try_into().expect("5 words");
        assert_eq!((vhost.as_str(), user.as_str()), ("shop", "billing-svc"));
        for q in [
            "orders.eu",
            "orders.eu.billing",
            "orders.eu.billing.retry.5000ms",
            "orders.eu.billing.retry.30000ms",
            "orders.eu.billing.dlq",
            "orders.eu.billing.dlq.stream",
            "orders.eu.billing.dlq.removed",
        ] {
            assert!(matches(&configure, q), "configure {q}: {configure}");
        }
        for other in [
            "orders.eu.shipping",
            "orders_eu",
            "orders.eu.billing.x",
            "orders.eu.billingretry.1",
            "amq.default",
        ] {
            assert!(
                !matches(&configure, other),
                "configure {other}: {configure}"
            );
        }
        assert!(matches(&write, "amq.default") && matches(&write, "orders.eu.billing"));
        assert!(
            !matches(&write, "orders.eu"),
            "no publish to the source: {write}"
        );
        assert!(matches(&read, "orders.eu.billing") && matches(&read, "orders.eu.billing.dlq"));
        // The stream's reads are the operator's.
        assert!(!matches(&read, "orders.eu.billing.dlq.stream"), "{read}");
        assert!(!p.document.contains("set_user_tags"));
    }

    #[test]
    fn the_operator_reads_the_streams_and_publishes_get_write() {
        let sub = Subscription::new("billing", "orders");
        let access = Access::consumer(sub).operator().publish("invoices");
        let p = permissions(&access, "/", None, true);
        let [_, user, _, write, read] = line(&p).try_into().expect("5 words");
        assert_eq!(user, PLACEHOLDER);
        assert!(matches(&read, "orders.billing.dlq.stream"));
        assert!(matches(&read, "orders.billing.dlq.removed"));
        assert!(matches(&write, "invoices"));
        assert!(
            p.document
                .contains("rabbitmqctl set_user_tags '<user>' policymaker")
        );
        // One comment per grant, naming why.
        assert!(
            p.document.contains(
                "# queue orders.billing.retry. (prefix): configure, read: declare the retry queues"
            ),
            "{}",
            p.document
        );
    }

    #[test]
    fn nothing_granted_is_the_empty_name_only() {
        assert_eq!(regex_for(&[], "read"), "^$");
        assert_eq!(quoted("it's"), r"'it'\''s'");
    }
}
