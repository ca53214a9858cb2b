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
//!
//! **AWS MSK IAM** ([`MskIamSettings`]): the same grants as IAM actions on MSK's ARNs,
//! and the document an IAM policy. Each operation maps to the actions MSK checks for it,
//! with the `Describe*` actions they depend on:
//!
//! | ACL operation | IAM actions |
//! |---|---|
//! | topic Read | `kafka-cluster:ReadData`, `DescribeTopic` |
//! | topic Write | `kafka-cluster:WriteData`, `DescribeTopic` (and `WriteDataIdempotently` on the cluster: reliq's producers are idempotent) |
//! | topic Create | `kafka-cluster:CreateTopic` |
//! | topic DescribeConfigs | `kafka-cluster:DescribeTopicDynamicConfiguration` |
//! | group Read | `kafka-cluster:AlterGroup`, `DescribeGroup` |
//! | group Describe | `kafka-cluster:DescribeGroup` |
//! | (every client) | `kafka-cluster:Connect` on the cluster |
//!
//! The ARNs name the cluster of `reliq.aws.cluster.arn`; without it, any cluster of the
//! account (`cluster/*/*`) in the URL's region (`*` when the region comes from the
//! environment).

use reliq_core::{Access, Grant, Permissions, Subscription};

use crate::names::{browse_group, ledger_topic};
use crate::options::{KafkaConfig, MskIamSettings, RetryMode};

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
    if let Some(msk) = &config.msk_iam {
        let grants = msk_iam_grants(msk, &grants);
        return Permissions {
            backend: "kafka",
            principal: access
                .principal
                .clone()
                .unwrap_or_else(|| IAM_PLACEHOLDER.to_owned()),
            document: reliq_core::seam::iam_policy(&grants),
            grants,
        };
    }
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

/// Printed for MSK IAM when [`Access::principal`] is not given (an IAM policy names no
/// principal: it is attached to one).
const IAM_PLACEHOLDER: &str = "<IAM role or user>";

/// The ACL grants as MSK IAM grants: ARNs and IAM actions (the table in the module docs),
/// the cluster's `Connect` first.
fn msk_iam_grants(msk: &MskIamSettings, grants: &[Grant]) -> Vec<Grant> {
    // arn:<partition>:kafka:<region>:<account>:cluster/<name>/<uuid>
    let cluster_arn = msk.cluster_arn.as_deref();
    let (prefix, cluster) = match cluster_arn.and_then(|arn| arn.split_once(":cluster/")) {
        Some((prefix, cluster)) => (prefix.to_owned(), cluster.to_owned()),
        None => {
            let region = msk.region.as_deref().unwrap_or("*");
            let partition = reliq_core::seam::aws_partition(region);
            (
                format!("arn:{partition}:kafka:{region}:*"),
                "*/*".to_owned(),
            )
        }
    };
    let writes = grants
        .iter()
        .any(|g| g.resource == "topic" && g.operations.contains(&"Write"));
    let mut cluster_actions = vec!["kafka-cluster:Connect"];
    if writes {
        cluster_actions.push("kafka-cluster:WriteDataIdempotently");
    }
    let mut out = vec![Grant::literal(
        "cluster",
        format!("{prefix}:cluster/{cluster}"),
        &cluster_actions,
        "connect (every client); idempotent produce",
    )];
    for g in grants {
        let mut actions: Vec<&'static str> = Vec::new();
        for op in &g.operations {
            let mapped: &[&'static str] = match (g.resource, *op) {
                ("topic", "Read") => &["kafka-cluster:ReadData", "kafka-cluster:DescribeTopic"],
                ("topic", "Write") => &["kafka-cluster:WriteData", "kafka-cluster:DescribeTopic"],
                ("topic", "Create") => &["kafka-cluster:CreateTopic"],
                ("topic", "DescribeConfigs") => {
                    &["kafka-cluster:DescribeTopicDynamicConfiguration"]
                }
                ("group", "Read") => &["kafka-cluster:AlterGroup", "kafka-cluster:DescribeGroup"],
                ("group", "Describe") => &["kafka-cluster:DescribeGroup"],
                ("topic", "Describe") => &["kafka-cluster:DescribeTopic"],
                // A test checks that every grant maps to some action.
                _ => &[],
            };
            for a in mapped {
                if !actions.contains(a) {
                    actions.push(a);
                }
            }
        }
        let name = format!("{prefix}:{}/{cluster}/{}", g.resource, g.name);
        out.push(Grant {
            name,
            operations: actions,
            ..g.clone()
        });
    }
    out
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

    #[test]
    fn with_msk_iam_the_grants_are_iam_actions_on_the_clusters_arns() {
        let arn = "arn:aws:kafka:eu-west-1:123456789012:cluster/prod/0b1c-2d3e-1";
        let config = KafkaConfig::from_url(&format!(
            "kafka://b-1.prod.kafka.eu-west-1.amazonaws.com:9098?sasl.oauthbearer.method=aws_msk_iam&reliq.aws.cluster.arn={arn}"
        ))
        .unwrap();
        let access = Access::consumer(sub()).operator().publish("invoices");
        let acls = permissions(&KafkaConfig::from_url("kafka://k:9092").unwrap(), &access);
        let p = permissions(&config, &access);
        assert_eq!(p.principal, IAM_PLACEHOLDER);
        let scope = "arn:aws:kafka:eu-west-1:123456789012";
        assert_eq!(
            ops(&p, "cluster", &format!("{scope}:cluster/prod/0b1c-2d3e-1")),
            [
                "kafka-cluster:Connect",
                "kafka-cluster:WriteDataIdempotently"
            ]
        );
        assert_eq!(
            ops(
                &p,
                "topic",
                &format!("{scope}:topic/prod/0b1c-2d3e-1/orders")
            ),
            [
                "kafka-cluster:ReadData",
                "kafka-cluster:DescribeTopic",
                "kafka-cluster:CreateTopic",
                "kafka-cluster:WriteData",
                "kafka-cluster:DescribeTopicDynamicConfiguration"
            ]
        );
        assert_eq!(
            ops(
                &p,
                "group",
                &format!("{scope}:group/prod/0b1c-2d3e-1/billing")
            ),
            ["kafka-cluster:AlterGroup", "kafka-cluster:DescribeGroup"]
        );
        let retry = p
            .grants
            .iter()
            .find(|g| g.name.ends_with("/orders.billing.retry."))
            .expect("the retry prefix");
        assert_eq!(retry.pattern, NamePattern::Prefixed);
        // One IAM grant per ACL grant, every one with actions, plus the cluster's.
        assert_eq!(p.grants.len(), acls.grants.len() + 1);
        assert!(
            p.grants.iter().all(|g| !g.operations.is_empty()),
            "{:#?}",
            p.grants
        );
        let policy: serde_json::Value = serde_json::from_str(&p.document).expect("JSON");
        let statements = policy["Statement"].as_array().expect("statements");
        assert_eq!(statements.len(), p.grants.len());
        assert!(
            statements.iter().any(|s| s["Resource"]
                == format!("{scope}:topic/prod/0b1c-2d3e-1/orders.billing.retry.*")),
            "{}",
            p.document
        );
    }

    #[test]
    fn with_msk_iam_and_no_cluster_arn_the_arns_take_any_cluster_of_the_region() {
        let config = KafkaConfig::from_url(
            "kafka://b:9098?sasl.oauthbearer.method=aws_msk_iam&reliq.aws.region=cn-north-1",
        )
        .unwrap();
        let p = permissions(&config, &Access::consumer(sub()));
        assert_eq!(
            p.grants[0].name,
            "arn:aws-cn:kafka:cn-north-1:*:cluster/*/*"
        );
        assert_eq!(
            ops(&p, "cluster", "arn:aws-cn:kafka:cn-north-1:*:cluster/*/*"),
            [
                "kafka-cluster:Connect",
                "kafka-cluster:WriteDataIdempotently"
            ]
        );
        assert!(
            p.grants
                .iter()
                .any(|g| g.name == "arn:aws-cn:kafka:cn-north-1:*:topic/*/*/orders.billing.dlq"),
            "{:#?}",
            p.grants
        );
    }
}
