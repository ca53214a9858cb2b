use std::fmt;

use serde::Serialize;

use crate::subscription::Subscription;

/// What a service does at the broker: the consumers it runs and where it publishes.
#[derive(Clone, Debug, Default)]
pub struct Access {
    /// The consumers (each with its retry tiers and dead-letter queue).
    pub consumers: Vec<Subscription>,
    /// Destinations the service publishes to (besides the copies its consumers make).
    pub publishes: Vec<String>,
    /// Also what an operator's tools do with these consumers' dead letters (`reliq dlq`
    /// look, replay, edit, purge; `reliq topology check`; the admin server's gauges).
    pub operator: bool,
    /// The principal the grants are for, in the broker's form (`User:orders-svc` on
    /// Kafka); `None` prints a placeholder.
    pub principal: Option<String>,
}

impl Access {
    /// One consumer's access.
    pub fn consumer(subscription: Subscription) -> Self {
        Self {
            consumers: vec![subscription],
            ..Self::default()
        }
    }

    /// Also publishes to `destination`.
    #[must_use]
    pub fn publish(mut self, destination: impl Into<String>) -> Self {
        self.publishes.push(destination.into());
        self
    }

    /// Also the operator's reads, replays and removals of these consumers' dead letters.
    #[must_use]
    pub fn operator(mut self) -> Self {
        self.operator = true;
        self
    }

    /// What this access covers, in words: ``consumer `billing` on `orders`; publishes to
    /// invoices; with the operator's tools`` (the first line of a permissions document).
    pub fn summary(&self) -> String {
        let consumers: Vec<String> = self
            .consumers
            .iter()
            .map(|s| format!("`{}` on `{}`", s.consumer, s.source))
            .collect();
        let mut text = format!(
            "consumer {}",
            if consumers.is_empty() {
                "none".to_owned()
            } else {
                consumers.join(", ")
            }
        );
        if !self.publishes.is_empty() {
            text.push_str(&format!("; publishes to {}", self.publishes.join(", ")));
        }
        if self.operator {
            text.push_str("; with the operator's tools");
        }
        text
    }

    /// The grants are for `principal`.
    #[must_use]
    pub fn principal(mut self, principal: impl Into<String>) -> Self {
        self.principal = Some(principal.into());
        self
    }
}

/// How a grant's name matches resources.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum NamePattern {
    /// Exactly this name.
    Literal,
    /// Every name that starts with it (Kafka's `PREFIXED` resource pattern).
    Prefixed,
}

impl NamePattern {
    /// `literal` or `prefixed`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Literal => "literal",
            Self::Prefixed => "prefixed",
        }
    }
}

/// One resource and what reliq does with it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Grant {
    /// The kind of resource in the broker's words (`topic`, `group`, `cluster`).
    pub resource: &'static str,
    /// The resource's name (or the prefix, by [`Grant::pattern`]).
    pub name: String,
    /// How `name` matches.
    pub pattern: NamePattern,
    /// The operations, in the broker's words (`Read`, `Write`, `Describe`, `Create`).
    pub operations: Vec<&'static str>,
    /// Why reliq needs them.
    pub reason: String,
}

impl Grant {
    /// A grant on exactly `name`.
    pub fn literal(
        resource: &'static str,
        name: impl Into<String>,
        operations: &[&'static str],
        reason: impl Into<String>,
    ) -> Self {
        Self {
            resource,
            name: name.into(),
            pattern: NamePattern::Literal,
            operations: operations.to_vec(),
            reason: reason.into(),
        }
    }

    /// A grant on every name starting with `prefix`.
    pub fn prefixed(
        resource: &'static str,
        prefix: impl Into<String>,
        operations: &[&'static str],
        reason: impl Into<String>,
    ) -> Self {
        Self {
            pattern: NamePattern::Prefixed,
            ..Self::literal(resource, prefix, operations, reason)
        }
    }
}

/// What a service's credentials must allow ([`Broker::permissions`](crate::broker::Broker::permissions)).
///
/// Least privilege, generated: what a service's broker credentials must allow.
///
/// A consumer's objects are named by its subscription (the source, the retry tiers, the
/// dead-letter queue, the backend's own groups or consumers): the same names
/// [`Broker::plan`](crate::broker::Broker::plan) lists. [`Broker::permissions`](crate::broker::Broker::permissions)
/// turns an [`Access`] — the consumers a service runs and the destinations it publishes
/// to — into [`Permissions`]: one [`Grant`] per resource with the operations reliq uses on
/// it and why, and the same grants in the broker's own form ([`Permissions::document`]:
/// Kafka ACL commands, RabbitMQ permission regexes, NATS permissions, an IAM policy).
///
/// Nothing here reads the broker: the list is what reliq *will* do, so it can be applied
/// before the first deployment.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Permissions {
    /// The backend (`kafka`, `rabbit`, `nats`, `sqs`).
    pub backend: &'static str,
    /// The principal the grants are for (or the placeholder printed).
    pub principal: String,
    /// One entry per resource, merged: a resource named twice has the union of the
    /// operations, in the order first asked.
    pub grants: Vec<Grant>,
    /// The grants in the broker's own form, ready to apply or to review (commands,
    /// regexes, a policy document).
    pub document: String,
}

impl Permissions {
    /// Grants merged by resource, kind and pattern (the order of first mention kept).
    pub fn merged(grants: impl IntoIterator<Item = Grant>) -> Vec<Grant> {
        let mut out: Vec<Grant> = Vec::new();
        for g in grants {
            match out
                .iter_mut()
                .find(|o| o.resource == g.resource && o.name == g.name && o.pattern == g.pattern)
            {
                Some(o) => {
                    for op in g.operations {
                        if !o.operations.contains(&op) {
                            o.operations.push(op);
                        }
                    }
                    if !o.reason.contains(&g.reason) {
                        o.reason = format!("{}; {}", o.reason, g.reason);
                    }
                }
                None => out.push(g),
            }
        }
        out
    }
}

impl fmt::Display for Permissions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.document)
    }
}

/// The AWS partition of `region` (`aws`, `aws-cn`, `aws-us-gov`): the second field of
/// its ARNs.
pub fn aws_partition(region: &str) -> &'static str {
    if region.starts_with("cn-") {
        "aws-cn"
    } else if region.starts_with("us-gov-") {
        "aws-us-gov"
    } else {
        "aws"
    }
}

/// A statement id from a grant: the letters and digits of the last part of its ARN (a
/// queue, a topic) in CamelCase — `orders_eu-billing.fifo` → `OrdersEuBillingFifo` —
/// unique in `taken` (IAM takes only letters and digits).
fn sid(grant: &Grant, taken: &mut Vec<String>) -> String {
    let name = grant
        .name
        .rsplit([':', '/'])
        .find(|part| !part.is_empty() && *part != "*")
        .unwrap_or(&grant.name);
    let mut base: String = name
        .split(|c: char| !c.is_ascii_alphanumeric())
        .filter(|w| !w.is_empty())
        .map(|w| {
            let mut chars = w.chars();
            chars
                .next()
                .map(|first| first.to_ascii_uppercase().to_string() + chars.as_str())
                .unwrap_or_default()
        })
        .collect();
    if base.is_empty() {
        base = "All".into();
    }
    if grant.pattern == NamePattern::Prefixed {
        base.push_str("Prefix");
    }
    let mut id = base.clone();
    let mut n = 2;
    while taken.contains(&id) {
        id = format!("{base}{n}");
        n += 1;
    }
    taken.push(id.clone());
    id
}

/// The grants as an AWS IAM identity policy, one statement per grant: each grant's name
/// is an ARN (a prefix grant matches with `*` after it), its operations IAM actions. The
/// policy is to attach as it is (`aws iam put-role-policy --policy-document
/// file://policy.json`), so it carries no comments: IAM refuses unknown elements. The
/// reasons stay in the grants.
pub fn iam_policy(grants: &[Grant]) -> String {
    let quote = |s: &str| serde_json::Value::from(s).to_string();
    let mut taken = Vec::new();
    let statements: Vec<String> = grants
        .iter()
        .map(|g| {
            let resource = match g.pattern {
                NamePattern::Literal => g.name.clone(),
                NamePattern::Prefixed => format!("{}*", g.name),
            };
            let actions: Vec<String> = g
                .operations
                .iter()
                .map(|a| format!("        {}", quote(a)))
                .collect();
            format!(
                "    {{\n      \"Sid\": {},\n      \"Effect\": \"Allow\",\n      \"Action\": [\n{}\n      ],\n      \"Resource\": {}\n    }}",
                quote(&sid(g, &mut taken)),
                actions.join(",\n"),
                quote(&resource)
            )
        })
        .collect();
    format!(
        "{{\n  \"Version\": \"2012-10-17\",\n  \"Statement\": [\n{}\n  ]\n}}\n",
        statements.join(",\n")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grants_on_one_resource_merge_their_operations_and_reasons() {
        let merged = Permissions::merged([
            Grant::literal("topic", "orders", &["Read", "Describe"], "consume"),
            Grant::prefixed("topic", "orders", &["Write"], "retry tiers"),
            Grant::literal("topic", "orders", &["Write", "Describe"], "publish"),
        ]);
        assert_eq!(merged.len(), 2, "{merged:?}");
        assert_eq!(merged[0].operations, ["Read", "Describe", "Write"]);
        assert_eq!(merged[0].reason, "consume; publish");
        assert_eq!(merged[1].pattern, NamePattern::Prefixed);
    }

    #[test]
    fn iam_statement_ids_are_camel_case_names_unique_in_the_policy() {
        let mut taken = Vec::new();
        let g = |name: &str| Grant::literal("queue", name, &["sqs:SendMessage"], "x");
        assert_eq!(sid(&g("arn:aws:sqs:r:1:a-b"), &mut taken), "AB");
        assert_eq!(sid(&g("arn:aws:sqs:r:1:a_b"), &mut taken), "AB2");
        assert_eq!(sid(&g("*"), &mut taken), "All");
        assert_eq!(
            sid(
                &g("arn:aws:kafka:r:1:topic/prod/uuid-1/orders.dlq"),
                &mut taken
            ),
            "OrdersDlq"
        );
        assert_eq!(
            sid(&g("arn:aws:kafka:r:*:cluster/*/*"), &mut taken),
            "Cluster"
        );
    }
}
