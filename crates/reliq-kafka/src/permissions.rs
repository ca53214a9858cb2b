//! The Kafka ACLs a service's principal needs ([`Broker::permissions`](reliq_core::Broker::permissions)),
//! from the names the consumer uses (see `names` and `topology`).
//!
//! | resource | pattern | operations | why |
//! |---|---|---|---|
//! | source topic | literal | Read, Create | consume; `subscribe` creates it when missing |
//! | `<source>.<consumer>.retry.` topics | prefixed | Read, Write, Create | the tiers' copies and relays — this policy's tiers and an earlier policy's still draining |
//! | `<source>.<consumer>.dlq` | literal | Write, Create | dead-letter copies (the crash-loop counter's too) |
//! | `<source>.<consumer>.dlq.removed` | literal | Create | the removal ledger, created at start |
//! | group `<prefix><consumer>` | literal | Read | join the group, commit, the crash-loop counter's metadata |
//! | groups `<prefix><consumer>.retry.` | prefixed | Read | the relays' groups |
//! | each published topic | literal | Write | publish |
//!
//! With [`Access::operator`] (the `reliq` command, the admin server): Read on the DLQ,
//! Read and Write on the ledger (browse, replay, remove), Write on the source (a replay
//! to a consumer without retry topics goes to the source), Describe on the consumer's
//! groups (backlog) and DescribeConfigs on every topic (`topology check`).
//!
//! Read and Write imply Describe in Kafka's authorizer; idempotent producers need no
//! cluster grant (Write on a topic allows `InitProducerId` since Kafka 3.0). Nothing
//! transactional: reliq's Kafka producers use no transactional id.

use reliq_core::{Access, Grant, Permissions, Subscription};

use crate::names::{browse_group, ledger_topic};
use crate::options::{KafkaConfig, RetryMode};

/// Printed when [`Access::principal`] is not given.
const PLACEHOLDER: &str = "User:<principal>";

pub(crate) fn permissions(config: &KafkaConfig, access: &Access) -> Permissions {
    let mut grants = Vec::new();
    for sub in &access.consumers {
        consumer(config, sub, access.operator, &mut grants);
    }
    for topic in &access.publishes {
        grants.push(Grant::literal("topic", topic, &["Write"], "publish"));
    }
    let grants = Permissions::merged(grants);
    let principal = access
        .principal
        .clone()
        .unwrap_or_else(|| PLACEHOLDER.to_owned());
    let document = document(config, &principal, access, &grants);
    Permissions {
        backend: "kafka",
        principal,
        grants,
        document,
    }
}

fn consumer(config: &KafkaConfig, sub: &Subscription, operator: bool, out: &mut Vec<Grant>) {
    let group = format!("{}{}", config.group_prefix, sub.consumer);
    let dlq = sub.dead_letter_name();
    let ledger = ledger_topic(&dlq);
    let retry_prefix = format!("{}.{}.retry.", sub.source, sub.consumer);
    let tiers = config.retry_mode == RetryMode::Topics && !sub.retry_tiers.is_empty();
    out.push(Grant::literal(
        "topic",
        &sub.source,
        &["Read", "Create"],
        format!("consume `{}`; created at start when missing", sub.consumer),
    ));
    if tiers {
        out.push(Grant::prefixed(
            "topic",
            &retry_prefix,
            &["Read", "Write", "Create"],
            "retry tiers: copies produced, relayed back when due (earlier policies' tiers drain too)",
        ));
    }
    out.push(Grant::literal(
        "topic",
        &dlq,
        &["Write", "Create"],
        "dead-letter copies",
    ));
    out.push(Grant::literal(
        "topic",
        &ledger,
        &["Create"],
        "the dead-letter removal ledger, created at start",
    ));
    out.push(Grant::literal(
        "group",
        &group,
        &["Read"],
        "join the consumer group; commit offsets and the delivery counter",
    ));
    if tiers {
        out.push(Grant::prefixed(
            "group",
            format!("{group}.retry."),
            &["Read"],
            "the retry tiers' relay groups",
        ));
    }
    if operator {
        out.push(Grant::literal(
            "topic",
            &dlq,
            &["Read", "DescribeConfigs"],
            "operator: browse, count and replay dead letters; topology check",
        ));
        out.push(Grant::literal(
            "topic",
            &ledger,
            &["Read", "Write", "DescribeConfigs"],
            "operator: read and record removals",
        ));
        out.push(Grant::literal(
            "topic",
            &sub.source,
            &["Write", "DescribeConfigs"],
            "operator: replay to the source; topology check",
        ));
        if tiers {
            out.push(Grant::prefixed(
                "topic",
                &retry_prefix,
                &["DescribeConfigs"],
                "operator: topology check",
            ));
        }
        out.push(Grant::literal(
            "group",
            format!("{}{}", config.group_prefix, browse_group(sub)),
            &["Read"],
            "operator: the dead-letter reader's group id (never joined, nothing committed)",
        ));
        out.push(Grant::literal(
            "group",
            &group,
            &["Describe"],
            "operator: the consumer's committed offsets (backlog)",
        ));
    }
}

/// The grants as `kafka-acls.sh` commands, one per resource, each after a comment that
/// says why.
fn document(config: &KafkaConfig, principal: &str, access: &Access, grants: &[Grant]) -> String {
    let mut doc = String::new();
    doc.push_str(&format!(
        "# Kafka ACLs for {principal}: {}\n",
        access.summary()
    ));
    doc.push_str("# Apply with an admin's client config (--command-config).\n");
    for g in grants {
        doc.push_str(&format!(
            "# {} {} ({}): {}\n",
            g.resource,
            g.name,
            g.pattern.as_str(),
            g.reason
        ));
        doc.push_str(&format!(
            "kafka-acls.sh --bootstrap-server {} --add --allow-principal {principal}",
            config.bootstrap
        ));
        for op in &g.operations {
            doc.push_str(&format!(" --operation {op}"));
        }
        doc.push_str(&format!(" --{} {}", g.resource, g.name));
        if g.pattern == reliq_core::NamePattern::Prefixed {
            doc.push_str(" --resource-pattern-type prefixed");
        }
        doc.push('\n');
    }
    doc
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use reliq_core::NamePattern;

    use super::*;

    fn sub() -> Subscription {
        let mut s = Subscription::new("billing", "orders");
        s.retry_tiers = vec![Duration::from_secs(5), Duration::from_secs(30)];
        s
    }

    fn ops<'a>(p: &'a Permissions, resource: &str, name: &str) -> &'a [&'static str] {
        p.grants
            .iter()
            .find(|g| g.resource == resource && g.name == name)
            .map_or(&[], |g| g.operations.as_slice())
    }

    #[test]
    fn a_consumer_gets_its_topics_and_groups_and_nothing_of_the_operator() {
        let config = KafkaConfig::from_url("kafka://k:9092?reliq.group.prefix=prod.").unwrap();
        let p = permissions(&config, &Access::consumer(sub()).principal("User:billing"));
        assert_eq!(ops(&p, "topic", "orders"), ["Read", "Create"]);
        assert_eq!(
            ops(&p, "topic", "orders.billing.retry."),
            ["Read", "Write", "Create"]
        );
        assert_eq!(ops(&p, "topic", "orders.billing.dlq"), ["Write", "Create"]);
        assert_eq!(ops(&p, "topic", "orders.billing.dlq.removed"), ["Create"]);
        assert_eq!(ops(&p, "group", "prod.billing"), ["Read"]);
        assert_eq!(ops(&p, "group", "prod.billing.retry."), ["Read"]);
        assert_eq!(p.grants.len(), 6, "{:#?}", p.grants);
        let prefixed: Vec<&str> = p
            .grants
            .iter()
            .filter(|g| g.pattern == NamePattern::Prefixed)
            .map(|g| g.name.as_str())
            .collect();
        assert_eq!(prefixed, ["orders.billing.retry.", "prod.billing.retry."]);
        assert!(
            p.document.contains(
                "kafka-acls.sh --bootstrap-server k:9092 --add --allow-principal User:billing \
             --operation Read --operation Write --operation Create --topic orders.billing.retry. \
             --resource-pattern-type prefixed\n"
            ),
            "{}",
            p.document
        );
        assert_eq!(
            p.document
                .lines()
                .filter(|l| l.starts_with("kafka-acls.sh"))
                .count(),
            6
        );
    }

    #[test]
    fn the_operator_adds_reads_of_the_dead_letters_and_publishing_adds_writes() {
        let config = KafkaConfig::from_url("kafka://k:9092").unwrap();
        let access = Access::consumer(sub()).operator().publish("invoices");
        let p = permissions(&config, &access);
        assert_eq!(p.principal, PLACEHOLDER);
        assert_eq!(
            ops(&p, "topic", "orders.billing.dlq"),
            ["Write", "Create", "Read", "DescribeConfigs"]
        );
        assert_eq!(
            ops(&p, "topic", "orders.billing.dlq.removed"),
            ["Create", "Read", "Write", "DescribeConfigs"]
        );
        assert_eq!(ops(&p, "group", "billing"), ["Read", "Describe"]);
        assert_eq!(ops(&p, "group", "billing.dlq-browse"), ["Read"]);
        assert_eq!(ops(&p, "topic", "invoices"), ["Write"]);
    }

    #[test]
    fn blocking_retries_need_no_retry_topics_or_relay_groups() {
        let config = KafkaConfig::from_url("kafka://k:9092?reliq.retry=blocking").unwrap();
        let p = permissions(&config, &Access::consumer(sub()));
        assert!(
            p.grants.iter().all(|g| !g.name.contains(".retry")),
            "{:#?}",
            p.grants
        );
    }
}
