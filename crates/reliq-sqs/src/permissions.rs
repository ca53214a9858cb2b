//! The IAM policy a service's role or user needs on SQS
//! ([`Broker::permissions`](reliq_core::Broker::permissions)), from the queue names in
//! `names` — the same names [`Broker::plan`](reliq_core::Broker::plan) lists.
//!
//! | resource | actions | why |
//! |---|---|---|
//! | consumer queue `<source>-<consumer>` | `GetQueueUrl`, `CreateQueue`, `TagQueue`, `SetQueueAttributes`, `GetQueueAttributes` | declared at subscribe: created with its tags when missing, else its visibility timeout, redrive policy and tags brought up to date; its ARN for the DLQ's redrive-allow policy |
//! | consumer queue | `ReceiveMessage`, `ChangeMessageVisibility`, `DeleteMessage` | consume; retries and releases are visibility changes, leases are extended the same way; acks are (batched) deletes |
//! | consumer queue | `ListQueueTags` (+ `GetQueueAttributes`) | the start-up topology check |
//! | DLQ `<source>_<consumer>_dlq` | `GetQueueUrl`, `CreateQueue`, `TagQueue`, `SetQueueAttributes`, `GetQueueAttributes` | declared before the consumer queue: its ARN is the redrive target, its redrive-allow policy names the consumer queue |
//! | DLQ | `SendMessage` | dead-letter copies (confirmed before the source message is deleted) |
//! | DLQ | `ListQueueTags` | the start-up topology check |
//! | `*` | `ListQueues` | publishing: find a topic's consumer queues (`ListQueues` has no resource-level permission) |
//! | queues `<topic>-*` | `ListQueueTags`, `SendMessage` | publishing: every consumer queue of the topic (its name starts with the topic prefix, its tag says which topic) |
//!
//! With [`Access::operator`] (`reliq dlq`, `reliq topology check`, the admin server):
//! `ReceiveMessage`, `ChangeMessageVisibility`, `DeleteMessage` on the DLQ (every read is
//! a scan under a short lease that is given back; remove, purge and the removal after a
//! replay delete), `SendMessage` on the consumer queue (a replay goes to this consumer
//! only). `SendMessageBatch`, `DeleteMessageBatch` and `ChangeMessageVisibilityBatch` are
//! authorized by the single-message actions. Crash-looping messages move to the DLQ by
//! SQS's redrive policy: no action of the caller.
//!
//! ARNs are `arn:<partition>:sqs:<region>:<account>:<queue>`: the region is the
//! connection's, the account the URL's `account=`, else STS `GetCallerIdentity` of the
//! connection's credentials, else `*` (IAM accepts a wildcard account; a queue of another
//! account still needs that queue's own policy to allow the principal). The document is
//! a policy to attach as it is (`aws iam put-role-policy --policy-document
//! file://policy.json`), so it carries no comments: IAM refuses unknown elements, and its
//! `Sid`s only take letters and digits. The reasons are in [`Permissions::grants`].

use reliq_core::{Access, Grant, Permissions, Subscription};

use crate::names::{dead_letter_queue_name, queue_name, topic_prefix};

/// Printed when [`Access::principal`] is not given (an IAM policy names no principal:
/// it is attached to one).
const PLACEHOLDER: &str = "<IAM role or user>";

/// The resource kind of every grant.
const QUEUE: &str = "queue";

/// Where the queues are: the parts of their ARNs, and whether they are FIFO queues.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Scope {
    /// `aws`, `aws-cn`, `aws-us-gov`.
    pub(crate) partition: String,
    /// The connection's region.
    pub(crate) region: String,
    /// The account id (`None`: `*`).
    pub(crate) account: Option<String>,
    /// FIFO queues (`.fifo` names).
    pub(crate) fifo: bool,
}

impl Scope {
    /// The scope of `region` (its partition from its name).
    pub(crate) fn new(region: &str, account: Option<String>, fifo: bool) -> Self {
        Self {
            partition: reliq_core::seam::aws_partition(region).to_owned(),
            region: region.to_owned(),
            account,
            fifo,
        }
    }

    fn arn(&self, queue: &str) -> String {
        format!(
            "arn:{}:sqs:{}:{}:{queue}",
            self.partition,
            self.region,
            self.account.as_deref().unwrap_or("*")
        )
    }
}

fn queue(arn: String, actions: &[&'static str], reason: impl Into<String>) -> Grant {
    Grant::literal(QUEUE, arn, actions, reason)
}

const DECLARE: &[&str] = &[
    "sqs:GetQueueUrl",
    "sqs:CreateQueue",
    "sqs:TagQueue",
    "sqs:SetQueueAttributes",
    "sqs:GetQueueAttributes",
];
const CHECK: &[&str] = &["sqs:GetQueueAttributes", "sqs:ListQueueTags"];

pub(crate) fn permissions(scope: &Scope, access: &Access) -> Permissions {
    let mut grants = Vec::new();
    for sub in &access.consumers {
        consumer(scope, sub, access.operator, &mut grants);
    }
    for topic in &access.publishes {
        grants.push(queue(
            "*".into(),
            &["sqs:ListQueues"],
            "publish: find the consumer queues of a topic (ListQueues has no resource-level permission)",
        ));
        grants.push(Grant::prefixed(
            QUEUE,
            scope.arn(&topic_prefix(topic)),
            &["sqs:ListQueueTags", "sqs:SendMessage"],
            format!(
                "publish to `{topic}`: every consumer queue of the topic (named `{}…`, tagged with the topic)",
                topic_prefix(topic)
            ),
        ));
    }
    let grants = Permissions::merged(grants);
    let principal = access
        .principal
        .clone()
        .unwrap_or_else(|| PLACEHOLDER.to_owned());
    let document = reliq_core::seam::iam_policy(&grants);
    Permissions {
        backend: "sqs",
        principal,
        grants,
        document,
    }
}

fn consumer(scope: &Scope, sub: &Subscription, operator: bool, out: &mut Vec<Grant>) {
    let source = scope.arn(&queue_name(sub, scope.fifo));
    let dlq = scope.arn(&dead_letter_queue_name(sub, scope.fifo));
    out.push(queue(
        dlq.clone(),
        DECLARE,
        "declare the DLQ (created when missing, else retention, tags and redrive-allow policy \
         brought up to date; its ARN is the consumer queue's redrive target)",
    ));
    out.push(queue(
        source.clone(),
        DECLARE,
        format!(
            "declare the queue of `{}` (created when missing, else visibility timeout, redrive \
             policy and tags brought up to date)",
            sub.consumer
        ),
    ));
    out.push(queue(
        source.clone(),
        &[
            "sqs:ReceiveMessage",
            "sqs:ChangeMessageVisibility",
            "sqs:DeleteMessage",
        ],
        "consume: receive; retry, release and lease extension change the visibility; ack deletes",
    ));
    out.push(queue(
        dlq.clone(),
        &["sqs:SendMessage"],
        "dead-letter copies, confirmed before the source message is deleted",
    ));
    for arn in [&dlq, &source] {
        out.push(queue(arn.clone(), CHECK, "the start-up topology check"));
    }
    if operator {
        out.push(queue(
            dlq.clone(),
            &[
                "sqs:ReceiveMessage",
                "sqs:ChangeMessageVisibility",
                "sqs:GetQueueAttributes",
            ],
            "operator: browse, show and count dead letters (each read scans under a short lease and gives it back)",
        ));
        out.push(queue(
            dlq,
            &["sqs:DeleteMessage"],
            "operator: remove and purge dead letters, and remove the replayed ones",
        ));
        out.push(queue(
            source,
            &["sqs:SendMessage", "sqs:GetQueueAttributes"],
            "operator: replay to this consumer only; backlog gauges",
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ACCOUNT: &str = "123456789012";

    fn scope(fifo: bool) -> Scope {
        Scope::new("eu-west-1", Some(ACCOUNT.into()), fifo)
    }

    fn arn(queue: &str) -> String {
        format!("arn:aws:sqs:eu-west-1:{ACCOUNT}:{queue}")
    }

    /// The policy's statements as (resource, actions), parsed back from the document.
    fn statements(p: &Permissions) -> Vec<(String, Vec<String>)> {
        let doc: serde_json::Value = serde_json::from_str(&p.document).expect("JSON");
        assert_eq!(doc["Version"], "2012-10-17");
        doc["Statement"]
            .as_array()
            .expect("statements")
            .iter()
            .map(|s| {
                assert_eq!(s["Effect"], "Allow");
                let sid = s["Sid"].as_str().expect("sid");
                assert!(sid.chars().all(|c| c.is_ascii_alphanumeric()), "{sid}");
                let actions = s["Action"]
                    .as_array()
                    .expect("actions")
                    .iter()
                    .map(|a| a.as_str().expect("action").to_owned())
                    .collect();
                (
                    s["Resource"].as_str().expect("resource").to_owned(),
                    actions,
                )
            })
            .collect()
    }

    fn sorted(actions: &[&str]) -> Vec<String> {
        let mut v: Vec<String> = actions.iter().map(|a| (*a).to_owned()).collect();
        v.sort();
        v
    }

    fn actions_on(p: &Permissions, resource: &str) -> Vec<String> {
        let mut found: Vec<Vec<String>> = statements(p)
            .into_iter()
            .filter(|(r, _)| r == resource)
            .map(|(_, a)| a)
            .collect();
        assert_eq!(
            found.len(),
            1,
            "one statement for {resource}: {}",
            p.document
        );
        let mut actions = found.remove(0);
        actions.sort();
        actions
    }

    #[test]
    fn a_consumer_gets_exactly_its_two_queues() {
        let p = permissions(
            &scope(false),
            &Access::consumer(Subscription::new("billing", "orders.eu")),
        );
        assert_eq!(p.backend, "sqs");
        assert_eq!(p.principal, PLACEHOLDER);
        let resources: Vec<String> = statements(&p).into_iter().map(|(r, _)| r).collect();
        assert_eq!(
            resources,
            [arn("orders_eu_billing_dlq"), arn("orders_eu-billing")]
        );
        assert_eq!(
            actions_on(&p, &arn("orders_eu-billing")),
            sorted(&[
                "sqs:ChangeMessageVisibility",
                "sqs:CreateQueue",
                "sqs:DeleteMessage",
                "sqs:GetQueueAttributes",
                "sqs:GetQueueUrl",
                "sqs:ListQueueTags",
                "sqs:ReceiveMessage",
                "sqs:SetQueueAttributes",
                "sqs:TagQueue",
            ])
        );
        assert_eq!(
            actions_on(&p, &arn("orders_eu_billing_dlq")),
            sorted(&[
                "sqs:CreateQueue",
                "sqs:GetQueueAttributes",
                "sqs:GetQueueUrl",
                "sqs:ListQueueTags",
                "sqs:SendMessage",
                "sqs:SetQueueAttributes",
                "sqs:TagQueue",
            ])
        );
        // Every grant says why.
        for g in &p.grants {
            assert!(!g.reason.is_empty(), "{g:?}");
        }
        let dlq = p
            .grants
            .iter()
            .find(|g| g.name == arn("orders_eu_billing_dlq"))
            .expect("dlq grant");
        assert!(dlq.reason.contains("dead-letter copies"), "{}", dlq.reason);
        // No publishing, no listing of the account's queues.
        assert!(!p.document.contains("sqs:ListQueues"), "{}", p.document);
    }

    #[test]
    fn the_operator_reads_and_removes_dead_letters_and_replays_to_the_consumer() {
        let p = permissions(
            &scope(false),
            &Access::consumer(Subscription::new("billing", "orders")).operator(),
        );
        let dlq = actions_on(&p, &arn("orders_billing_dlq"));
        for action in [
            "sqs:ReceiveMessage",
            "sqs:ChangeMessageVisibility",
            "sqs:DeleteMessage",
        ] {
            assert!(dlq.contains(&action.to_owned()), "{action}: {dlq:?}");
        }
        assert_eq!(dlq.len(), 10, "{dlq:?}");
        let source = actions_on(&p, &arn("orders-billing"));
        assert!(source.contains(&"sqs:SendMessage".to_owned()), "{source:?}");
        assert_eq!(source.len(), 10, "{source:?}");
    }

    #[test]
    fn publishing_lists_queues_and_sends_to_the_topics_queues_only() {
        let p = permissions(
            &scope(false),
            &Access::consumer(Subscription::new("billing", "orders"))
                .publish("invoices")
                .publish("refunds")
                .principal("arn:aws:iam::123456789012:role/billing"),
        );
        assert_eq!(p.principal, "arn:aws:iam::123456789012:role/billing");
        assert_eq!(actions_on(&p, "*"), ["sqs:ListQueues"]);
        for topic in ["invoices", "refunds"] {
            assert_eq!(
                actions_on(&p, &format!("{}*", arn(&format!("{topic}-")))),
                ["sqs:ListQueueTags", "sqs:SendMessage"]
            );
        }
        // The consumer publishes nothing to its own source.
        assert!(!actions_on(&p, &arn("orders-billing")).contains(&"sqs:SendMessage".to_owned()));
        assert_eq!(statements(&p).len(), 5, "{}", p.document);
    }

    #[test]
    fn fifo_queues_and_an_unknown_account_show_in_the_arns() {
        let scope = Scope::new("cn-north-1", None, true);
        let p = permissions(
            &scope,
            &Access::consumer(Subscription::new("billing", "orders")),
        );
        let resources: Vec<String> = statements(&p).into_iter().map(|(r, _)| r).collect();
        assert_eq!(
            resources,
            [
                "arn:aws-cn:sqs:cn-north-1:*:orders_billing_dlq.fifo",
                "arn:aws-cn:sqs:cn-north-1:*:orders-billing.fifo"
            ]
        );
        assert!(
            p.document.contains("\"Sid\": \"OrdersBillingFifo\""),
            "{}",
            p.document
        );
    }
}
