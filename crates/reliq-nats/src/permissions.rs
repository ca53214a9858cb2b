//! The subjects a service's NATS user must be allowed to publish and subscribe to
//! ([`Broker::permissions`](reliq_core::Broker::permissions)), from the names in `names`.
//!
//! JetStream is driven by requests on `$JS.API.…` subjects, so a user's permissions name
//! the API calls reliq makes on its own streams and consumer, beside the data subjects:
//!
//! | publish | why |
//! |---|---|
//! | `$JS.API.STREAM.{INFO,CREATE,UPDATE}.<stream>` and the same for `DLQ_<stream>_<consumer>` | declare the source and DLQ streams |
//! | `$JS.API.CONSUMER.{INFO,CREATE,DURABLE.CREATE}.<stream>.<consumer>[.>]` | declare the durable consumer |
//! | `$JS.API.CONSUMER.MSG.NEXT.<stream>.<consumer>` | pull |
//! | `$JS.ACK.<stream>.<consumer>.>` | ack, nak, term, in progress |
//! | `retry.<stream>.<consumer>.at.>` | the retries' scheduled copies |
//! | `dlq.<stream>.<consumer>` | dead-letter copies |
//! | `$JS.API.STREAM.MSG.GET.<stream>` | the advisory watcher reads the message an advisory names |
//! | `$JS.API.INFO` | the reachability check (`Broker::ping`: `reliq` before a command, the admin server's `/readyz`) |
//!
//! | subscribe | why |
//! |---|---|
//! | `_INBOX.>` | replies: pulled messages, publish acks, API answers |
//! | `$JS.EVENT.ADVISORY.CONSUMER.{MAX_DELIVERIES,MSG_TERMINATED}.<stream>.<consumer>` | the advisory watcher |
//!
//! With [`Access::operator`]: direct gets and message deletes on the DLQ stream, and
//! publishing to the source (a replay goes to the original subject).

use reliq_core::{Access, Grant, Permissions, Subscription};

use crate::names::{consumer_name, dead_letter_stream, dead_letter_subject, stream_name};

const PLACEHOLDER: &str = "<user>";

fn publish(subject: String, reason: &str) -> Grant {
    Grant::literal("subject", subject, &["publish"], reason)
}

fn subscribe(subject: String, reason: &str) -> Grant {
    Grant::literal("subject", subject, &["subscribe"], reason)
}

pub(crate) fn permissions(access: &Access) -> Permissions {
    let mut grants = Vec::new();
    if !access.consumers.is_empty() {
        grants.push(subscribe(
            "_INBOX.>".into(),
            "replies: pulled messages, publish acks, JetStream API answers",
        ));
        // The account's JetStream info: read-only, and the one call that answers
        // whether JetStream is there without naming a stream.
        grants.push(publish(
            "$JS.API.INFO".into(),
            "reachability check (the command line, the admin server's /readyz)",
        ));
    }
    for sub in &access.consumers {
        consumer(sub, access.operator, &mut grants);
    }
    for destination in &access.publishes {
        grants.push(publish(destination.clone(), "publish"));
        grants.push(publish(format!("{destination}.>"), "publish with a route"));
        if access.consumers.is_empty() {
            grants.push(subscribe("_INBOX.>".into(), "publish acks"));
        }
    }
    let grants = Permissions::merged(grants);
    let principal = access
        .principal
        .clone()
        .unwrap_or_else(|| PLACEHOLDER.to_owned());
    let document = document(&principal, access, &grants);
    Permissions {
        backend: "nats",
        principal,
        grants,
        document,
    }
}

fn consumer(sub: &Subscription, operator: bool, out: &mut Vec<Grant>) {
    let stream = stream_name(&sub.source);
    let name = consumer_name(&sub.consumer);
    let dlq = dead_letter_stream(sub);
    for s in [&stream, &dlq] {
        for call in ["INFO", "CREATE", "UPDATE"] {
            out.push(publish(
                format!("$JS.API.STREAM.{call}.{s}"),
                "declare the source and dead-letter streams",
            ));
        }
    }
    for call in [
        format!("$JS.API.CONSUMER.INFO.{stream}.{name}"),
        format!("$JS.API.CONSUMER.CREATE.{stream}.{name}"),
        format!("$JS.API.CONSUMER.CREATE.{stream}.{name}.>"),
        format!("$JS.API.CONSUMER.DURABLE.CREATE.{stream}.{name}"),
    ] {
        out.push(publish(call, "declare the durable consumer"));
    }
    out.push(publish(
        format!("$JS.API.CONSUMER.MSG.NEXT.{stream}.{name}"),
        "pull",
    ));
    out.push(publish(
        format!("$JS.ACK.{stream}.{name}.>"),
        "ack, nak, term, in progress",
    ));
    out.push(publish(
        format!("retry.{stream}.{name}.at.>"),
        "the retries' scheduled copies",
    ));
    out.push(publish(dead_letter_subject(sub), "dead-letter copies"));
    out.push(publish(
        format!("$JS.API.STREAM.MSG.GET.{stream}"),
        "the advisory watcher reads the message an advisory names",
    ));
    for event in ["MAX_DELIVERIES", "MSG_TERMINATED"] {
        out.push(subscribe(
            format!("$JS.EVENT.ADVISORY.CONSUMER.{event}.{stream}.{name}"),
            "the advisory watcher: deliveries the server gave up on or another client terminated",
        ));
    }
    if operator {
        out.push(publish(
            format!("$JS.API.DIRECT.GET.{dlq}"),
            "operator: browse dead letters",
        ));
        out.push(publish(
            format!("$JS.API.STREAM.MSG.DELETE.{dlq}"),
            "operator: remove dead letters",
        ));
        out.push(publish(
            sub.source.clone(),
            "operator: replay to the source",
        ));
        out.push(publish(
            format!("{}.>", sub.source),
            "operator: replay to the source's routes",
        ));
    }
}

/// The grants as a `permissions` block for a user in `nats-server.conf`, and the same
/// lists as `nsc edit user` flags (decentralized auth; single-quoted: `$JS` is no shell
/// variable).
fn document(principal: &str, access: &Access, grants: &[Grant]) -> String {
    let list = |op: &str| -> Vec<&Grant> {
        grants
            .iter()
            .filter(|g| g.operations.contains(&op))
            .collect()
    };
    let (publishes, subscribes) = (list("publish"), list("subscribe"));
    let mut doc = format!("# NATS permissions for {principal}: {}\n", access.summary());
    doc.push_str("permissions: {\n");
    for (key, items) in [("publish", &publishes), ("subscribe", &subscribes)] {
        doc.push_str(&format!("  {key}: {{ allow: [\n"));
        for g in items.iter() {
            doc.push_str(&format!("    \"{}\"  # {}\n", g.name, g.reason));
        }
        doc.push_str("  ] }\n");
    }
    doc.push_str("}\n");
    let names = |items: &[&Grant]| -> String {
        items
            .iter()
            .map(|g| g.name.as_str())
            .collect::<Vec<_>>()
            .join(",")
    };
    doc.push_str(&format!(
        "# nsc edit user {principal} --allow-pub '{}' --allow-sub '{}'\n",
        names(&publishes),
        names(&subscribes)
    ));
    doc
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn subjects(p: &Permissions, op: &str) -> Vec<String> {
        p.grants
            .iter()
            .filter(|g| g.operations.contains(&op))
            .map(|g| g.name.clone())
            .collect()
    }

    #[test]
    fn a_consumer_may_use_its_own_streams_and_consumer_only() {
        let mut sub = Subscription::new("billing", "orders.eu");
        sub.retry_tiers = vec![Duration::from_secs(5)];
        let p = permissions(&Access::consumer(sub));
        let publishes = subjects(&p, "publish");
        assert!(publishes.contains(&"$JS.API.CONSUMER.MSG.NEXT.orders_eu.billing".to_owned()));
        assert!(publishes.contains(&"$JS.API.STREAM.CREATE.DLQ_orders_eu_billing".to_owned()));
        assert!(publishes.contains(&"retry.orders_eu.billing.at.>".to_owned()));
        assert!(publishes.contains(&"dlq.orders_eu.billing".to_owned()));
        // Not the operator's reads, not publishing to the source.
        assert!(
            !publishes
                .iter()
                .any(|s| s.contains("DIRECT.GET") || s == "orders.eu")
        );
        // Every call names its own stream, but the account's read-only info (the ping).
        assert!(
            publishes
                .iter()
                .all(|s| s.contains("orders_eu") || s == "$JS.API.INFO"),
            "{publishes:?}"
        );
        assert!(publishes.contains(&"$JS.API.INFO".to_owned()));
        assert_eq!(
            subjects(&p, "subscribe"),
            [
                "_INBOX.>",
                "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.orders_eu.billing",
                "$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.orders_eu.billing"
            ]
        );
        assert!(
            p.document
                .contains("permissions: {\n  publish: { allow: [\n"),
            "{}",
            p.document
        );
        assert!(
            p.document.contains(
                "# nsc edit user <user> --allow-pub '$JS.API.INFO,$JS.API.STREAM.INFO.orders_eu,"
            ),
            "{}",
            p.document
        );
    }

    #[test]
    fn the_operator_reads_and_removes_dead_letters_and_replays() {
        let p = permissions(&Access::consumer(Subscription::new("billing", "orders")).operator());
        let publishes = subjects(&p, "publish");
        for s in [
            "$JS.API.DIRECT.GET.DLQ_orders_billing",
            "$JS.API.STREAM.MSG.DELETE.DLQ_orders_billing",
            "orders",
            "orders.>",
        ] {
            assert!(publishes.contains(&s.to_owned()), "{s}: {publishes:?}");
        }
    }
}
