//! Topology drift made by hand with each broker's own client — what an operator, another
//! tool or an earlier deployment does — and named by [`Broker::check_topology`] with the
//! right severity. (A clean topology reporting nothing, and a redeployed policy's
//! differences, are the conformance scenario
//! `topology_check_names_each_difference_from_the_plan` on every backend.)

use std::time::Duration;

use anyhow::{Context as _, ensure};
use reliq_conformance::Ctx;
use reliq_core::{Broker, Difference, Drift, Severity, Subscription, TopologyReport};
use serde_json::{Value, json};

/// The one difference on `object` (by name, or its suffix) about `setting` — `None` for
/// a missing or extra object.
fn find<'a>(
    report: &'a TopologyReport,
    object: &str,
    setting: Option<&str>,
) -> anyhow::Result<&'a Drift> {
    let found: Vec<&Drift> = report
        .drift
        .iter()
        .filter(|d| d.object.ends_with(object) && d.setting() == setting)
        .collect();
    ensure!(
        found.len() == 1,
        "one difference on `{object}` {setting:?}, found {}:\n{report}",
        found.len()
    );
    Ok(found[0])
}

fn different(d: &Drift) -> anyhow::Result<(Option<&Value>, Option<&str>)> {
    match &d.difference {
        Difference::Different { found, set_by, .. } => Ok((found.as_ref(), set_by.as_deref())),
        other => anyhow::bail!("expected a different setting: {other:?}"),
    }
}

fn number(v: Option<&Value>) -> Option<i64> {
    v.and_then(|v| {
        v.as_i64()
            .or_else(|| v.as_str().and_then(|s| s.parse().ok()))
    })
}

mod rabbit {
    use super::*;
    use lapin::options::{BasicPublishOptions, QueueDeclareOptions};
    use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
    use lapin::{BasicProperties, Connection, ConnectionProperties};
    use reliq_integration::rabbit::RabbitBackend;
    use reliq_integration::settings;
    use reliq_rabbit::{Management, encode_segment};

    /// An operator's policy, removed when the test ends (even when it fails).
    struct PolicyGuard {
        api: Management,
        path: String,
    }

    impl PolicyGuard {
        async fn put(
            api: &Management,
            kind: &str,
            name: &str,
            body: Value,
        ) -> anyhow::Result<Self> {
            let path = format!(
                "/api/{kind}/{}/{}",
                encode_segment("/"),
                encode_segment(name)
            );
            api.put(&path, &body).await?;
            Ok(Self {
                api: api.clone(),
                path,
            })
        }
    }

    impl Drop for PolicyGuard {
        fn drop(&mut self) {
            let (api, path) = (self.api.clone(), self.path.clone());
            // The runtime may be shutting down with the test; the policy's pattern names
            // only this test's queues, so a leftover harms no other test.
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(async move { api.delete(&path).await });
            }
        }
    }

    fn pattern(queue: &str) -> String {
        format!("^{}$", regex_escape(queue))
    }

    fn regex_escape(s: &str) -> String {
        s.chars()
            .flat_map(|c| {
                if "\\.^$|?*+()[]{}".contains(c) {
                    vec!['\\', c]
                } else {
                    vec![c]
                }
            })
            .collect()
    }

    async fn raw() -> anyhow::Result<Connection> {
        Ok(Connection::connect(
            &settings::get("RELIQ_RABBIT_URL"),
            ConnectionProperties::default(),
        )
        .await?)
    }

    /// A policy of reliq (settings in policies) replaced by an operator's broader policy
    /// with a higher priority: the delivery limit and the dead-lettering are gone, each
    /// named as breaking with the policy that took over; the operator's length limit is
    /// named with it too.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_competing_policy_is_named_as_breaking() -> anyhow::Result<()> {
        let broker = RabbitBackend::policy_broker().await?;
        let api = broker.management().context("management API")?.clone();
        let mut sub = Subscription::new(
            reliq_conformance::support::unique("c"),
            reliq_conformance::support::unique("topo"),
        );
        sub.delivery_limit = 5;
        sub.retry_tiers = vec![Duration::from_secs(5)];
        let rx = broker.subscribe(&sub).await?;
        let queue = format!("{}.{}", sub.source, sub.consumer);
        let clean = broker.check_topology(&sub).await?;
        ensure!(clean.drift.is_empty(), "as declared:\n{clean}");

        let name = format!("ops-{}", sub.consumer);
        let _policy = PolicyGuard::put(
            &api,
            "policies",
            &name,
            json!({
                "pattern": pattern(&queue), "priority": 50, "apply-to": "queues",
                "definition": {"max-length": 1000},
            }),
        )
        .await?;
        let report = broker.check_topology(&sub).await?;
        for setting in [
            "delivery-limit",
            "dead-letter-exchange",
            "dead-letter-routing-key",
            "overflow",
        ] {
            let d = find(&report, &queue, Some(setting))?;
            ensure!(d.severity == Severity::Breaking, "{d}");
            let (found, set_by) = different(d)?;
            ensure!(found.is_none(), "{d}");
            ensure!(
                set_by == Some(format!("policy `{name}` applies").as_str()),
                "{d}"
            );
        }
        let d = find(&report, &queue, Some("max-length"))?;
        let (found, set_by) = different(d)?;
        ensure!(
            d.severity == Severity::Breaking
                && number(found) == Some(1000)
                && set_by == Some(format!("policy `{name}`").as_str()),
            "{d}"
        );
        ensure!(
            report.is_breaking() && report.to_string().contains(&name),
            "{report}"
        );
        rx.close().await?;
        // reliq's own per-queue policies outlive the queues: remove them.
        for object in &broker.plan(&sub).await?.objects {
            api.delete_policy("/", &format!("reliq-{}", object.name))
                .await?;
        }
        Ok(())
    }

    /// An operator policy (which RabbitMQ merges with every queue's own settings, the
    /// smaller limit winning) capping the consumer queue's length: named with the
    /// operator policy; a queue it does not match stays clean.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_operator_policy_limit_is_named_with_its_name() -> anyhow::Result<()> {
        let backend = RabbitBackend::new();
        let ctx = Ctx::new(&backend, "topo-op").await?;
        let sub = ctx.subscription("c");
        let rx = ctx.broker.subscribe(&sub).await?;
        let queue = format!("{}.{}", sub.source, sub.consumer);
        let (admin, _) = backend.admin().await?;
        let api = admin.management().context("management API")?;
        let name = format!("cap-{}", ctx.topic);
        let _policy = PolicyGuard::put(
            api,
            "operator-policies",
            &name,
            json!({
                "pattern": pattern(&queue), "priority": 0, "apply-to": "queues",
                "definition": {"max-length": 10},
            }),
        )
        .await?;
        let report = ctx.broker.check_topology(&sub).await?;
        let d = find(&report, &queue, Some("max-length"))?;
        let (found, set_by) = different(d)?;
        ensure!(
            d.severity == Severity::Breaking
                && number(found) == Some(10)
                && set_by == Some(format!("operator policy `{name}`").as_str()),
            "{d}"
        );
        ensure!(
            report.drift.len() == 1,
            "only the consumer queue is capped:\n{report}"
        );
        rx.close().await?;
        Ok(())
    }

    /// Retry queues of an earlier policy, made by hand: one that dead-letters back to the
    /// consumer queue (as reliq declares a tier) holding 2 messages is cosmetic — they
    /// come back; one that does not is breaking — what it holds is stranded.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn stale_tiers_are_named_with_what_they_hold() -> anyhow::Result<()> {
        let backend = RabbitBackend::new();
        let ctx = Ctx::new(&backend, "topo-stale").await?;
        let sub = ctx.subscription("c");
        let rx = ctx.broker.subscribe(&sub).await?;
        let queue = format!("{}.{}", sub.source, sub.consumer);
        let conn = raw().await?;
        let ch = conn.create_channel().await?;
        let text = |s: &str| AMQPValue::LongString(LongString::from(s.to_owned()));
        let declare = |name: String, back: bool| {
            let ch = ch.clone();
            let queue = queue.clone();
            async move {
                let mut args = FieldTable::default();
                args.insert(ShortString::from("x-queue-type"), text("quorum"));
                args.insert(
                    ShortString::from("x-expires"),
                    AMQPValue::LongLongInt(600_000),
                );
                args.insert(
                    ShortString::from("x-message-ttl"),
                    AMQPValue::LongLongInt(3_600_000),
                );
                if back {
                    args.insert(ShortString::from("x-dead-letter-exchange"), text(""));
                    args.insert(ShortString::from("x-dead-letter-routing-key"), text(&queue));
                }
                ch.queue_declare(
                    name.as_str().into(),
                    QueueDeclareOptions {
                        durable: true,
                        ..Default::default()
                    },
                    args,
                )
                .await?;
                for i in 0..2 {
                    ch.basic_publish(
                        "".into(),
                        name.as_str().into(),
                        BasicPublishOptions::default(),
                        format!("m{i}").as_bytes(),
                        BasicProperties::default(),
                    )
                    .await?
                    .await?;
                }
                anyhow::Ok(name)
            }
        };
        let returning = declare(format!("{queue}.retry.3600000ms"), true).await?;
        let stranded = declare(format!("{queue}.retry.7200000ms"), false).await?;
        let report = ctx.broker.check_topology(&sub).await?;
        ensure!(report.drift.len() == 2, "{report}");
        for (name, severity) in [
            (&returning, Severity::Cosmetic),
            (&stranded, Severity::Breaking),
        ] {
            let d = find(&report, name, None)?;
            ensure!(
                d.severity == severity
                    && matches!(
                        d.difference,
                        Difference::Extra {
                            messages: Some(2),
                            ..
                        }
                    ),
                "{d}"
            );
        }
        ch.close(200, "ok".into()).await?;
        rx.close().await?;
        Ok(())
    }

    /// Without the management API the check says what it needs, naming the option.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn without_the_management_api_the_check_names_it() -> anyhow::Result<()> {
        let broker = reliq_rabbit::RabbitBroker::connect_with(
            &settings::get("RELIQ_RABBIT_URL"),
            reliq_rabbit::RabbitOptions::default(),
        )
        .await?;
        let err = broker
            .check_topology(&Subscription::new("c", "o"))
            .await
            .err()
            .context("no management API: an error")?;
        ensure!(
            matches!(&err, reliq_core::BrokerError::Config { field, .. } if field == "reliq.management"),
            "{err}"
        );
        Ok(())
    }
}

mod kafka {
    use super::*;
    use rdkafka::ClientConfig;
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    use rdkafka::client::DefaultClientContext;
    use rdkafka::producer::{FutureProducer, FutureRecord};
    use reliq_integration::kafka::KafkaBackend;
    use reliq_integration::settings;

    fn bootstrap() -> String {
        settings::authority(&settings::get("RELIQ_KAFKA_URL")).to_owned()
    }

    async fn create(name: &str, partitions: i32, configs: &[(&str, &str)]) -> anyhow::Result<()> {
        let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
            .set("bootstrap.servers", bootstrap())
            .create()?;
        let mut topic = NewTopic::new(name, partitions, TopicReplication::Fixed(1));
        for (k, v) in configs {
            topic = topic.set(k, v);
        }
        for r in admin.create_topics([&topic], &AdminOptions::new()).await? {
            r.map_err(|(t, e)| anyhow::anyhow!("creating {t}: {e}"))?;
        }
        Ok(())
    }

    /// A retry topic and a DLQ created by hand before the consumer first ran (reliq keeps
    /// an existing topic as it is): a one-partition tier with a retention shorter than its
    /// delay, and a DLQ with a retention. The retention of each is breaking, the
    /// partitions cosmetic; a stale tier holding 3 records is cosmetic (the consumer
    /// relays it), and nothing else is reported.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn hand_made_topics_and_stale_tiers_are_named() -> anyhow::Result<()> {
        let backend = KafkaBackend::new();
        let ctx = Ctx::new(&backend, "topo").await?;
        let tier = Duration::from_secs(5);
        let mut sub = ctx.subscription("c");
        sub.retry_tiers = vec![tier];
        let retry = sub.retry_name(tier);
        let dlq = sub.dead_letter_name();
        let stale = sub.retry_name(Duration::from_secs(77));
        create(&retry, 1, &[("retention.ms", "1000")]).await?;
        create(&dlq, 3, &[("retention.ms", "3600000")]).await?;
        create(&stale, 1, &[]).await?;
        let producer: FutureProducer = ClientConfig::new()
            .set("bootstrap.servers", bootstrap())
            .create()?;
        for i in 0..3 {
            producer
                .send(
                    FutureRecord::<(), _>::to(&stale).payload(&format!("r{i}")),
                    Duration::from_secs(10),
                )
                .await
                .map_err(|(e, _)| e)?;
        }
        // Check before the consumer runs: its relay would drain the stale tier.
        let report = ctx.broker.check_topology(&sub).await?;
        let d = find(&report, &retry, Some("retention.ms"))?;
        let (found, set_by) = different(d)?;
        ensure!(
            d.severity == Severity::Breaking && number(found) == Some(1000) && set_by.is_none(),
            "{d}"
        );
        let d = find(&report, &retry, Some("partitions"))?;
        ensure!(
            d.severity == Severity::Cosmetic && number(different(d)?.0) == Some(1),
            "{d}"
        );
        let d = find(&report, &dlq, Some("retention.ms"))?;
        ensure!(
            d.severity == Severity::Breaking && number(different(d)?.0) == Some(3_600_000),
            "{d}"
        );
        let d = find(&report, &stale, None)?;
        ensure!(
            d.severity == Severity::Cosmetic
                && matches!(
                    d.difference,
                    Difference::Extra {
                        messages: Some(3),
                        ..
                    }
                ),
            "{d}"
        );
        // The rest: what the consumer makes when it first runs (groups, the ledger).
        for d in &report.drift {
            let expected = [retry.as_str(), dlq.as_str(), stale.as_str()]
                .contains(&d.object.as_str())
                || matches!(d.difference, Difference::Missing { .. });
            ensure!(expected, "unexpected: {d}\n{report}");
        }
        Ok(())
    }
}

mod nats {
    use super::*;
    use reliq_integration::nats::NatsBackend;
    use reliq_integration::settings;

    /// A JetStream consumer edited to an unlimited `max_deliver` and a DLQ stream given a
    /// `max_age`: both breaking, with the values found; nothing else.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_edited_consumer_and_dlq_are_named() -> anyhow::Result<()> {
        let backend = NatsBackend::new();
        let ctx = Ctx::new(&backend, "topo").await?;
        let mut sub = ctx.subscription("c");
        sub.delivery_limit = 6;
        let rx = ctx.broker.subscribe(&sub).await?;
        let client = async_nats::connect(settings::get("RELIQ_NATS_URL")).await?;
        let js = async_nats::jetstream::new(client);
        let stream = js.get_stream(reliq_nats::stream_name(&sub.source)).await?;
        let mut consumer = stream
            .consumer_info(reliq_nats::stream_name(&sub.consumer))
            .await?
            .config
            .clone();
        consumer.max_deliver = -1;
        stream.update_consumer(consumer).await?;
        let mut dlq = js
            .get_stream(reliq_nats::dead_letter_stream(&sub))
            .await?
            .cached_info()
            .config
            .clone();
        dlq.max_age = Duration::from_secs(3600);
        js.update_stream(&dlq).await?;

        let report = ctx.broker.check_topology(&sub).await?;
        ensure!(report.drift.len() == 2, "{report}");
        let d = find(
            &report,
            &reliq_nats::stream_name(&sub.consumer),
            Some("max_deliver"),
        )?;
        ensure!(
            d.severity == Severity::Breaking && number(different(d)?.0) == Some(-1),
            "{d}"
        );
        let d = find(
            &report,
            &reliq_nats::dead_letter_stream(&sub),
            Some("max_age"),
        )?;
        let (found, _) = different(d)?;
        ensure!(
            d.severity == Severity::Breaking && found == Some(&json!("1h")),
            "{d}"
        );
        rx.close().await?;
        Ok(())
    }
}

mod sqs {
    use super::*;
    use aws_sdk_sqs::types::QueueAttributeName;
    use reliq_integration::sqs::SqsBackend;

    /// The consumer queue's redrive policy pointed at a foreign queue, and the DLQ's
    /// retention cut to an hour: both breaking, the foreign ARN named; nothing else.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_foreign_redrive_target_is_named() -> anyhow::Result<()> {
        let backend = SqsBackend::new();
        let broker = backend.connect_sqs().await?;
        let ctx = Ctx::new(&backend, "topo").await?;
        let sub = ctx.subscription("c");
        let rx = ctx.broker.subscribe(&sub).await?;
        let client = broker.client();
        let foreign = client
            .create_queue()
            .queue_name(reliq_conformance::support::unique("foreign"))
            .send()
            .await?;
        let foreign_url = foreign.queue_url().context("foreign url")?;
        let foreign_arn = client
            .get_queue_attributes()
            .queue_url(foreign_url)
            .attribute_names(QueueAttributeName::QueueArn)
            .send()
            .await?
            .attributes()
            .and_then(|a| a.get(&QueueAttributeName::QueueArn))
            .cloned()
            .context("foreign arn")?;
        let url_of = |name: String| async move {
            anyhow::Ok(
                client
                    .get_queue_url()
                    .queue_name(name)
                    .send()
                    .await?
                    .queue_url()
                    .context("url")?
                    .to_owned(),
            )
        };
        let queue = url_of(reliq_sqs::queue_name(&sub, false)).await?;
        let dlq = url_of(reliq_sqs::dead_letter_queue_name(&sub, false)).await?;
        let redrive =
            json!({"deadLetterTargetArn": foreign_arn, "maxReceiveCount": sub.delivery_limit});
        client
            .set_queue_attributes()
            .queue_url(&queue)
            .attributes(QueueAttributeName::RedrivePolicy, redrive.to_string())
            .send()
            .await?;
        client
            .set_queue_attributes()
            .queue_url(&dlq)
            .attributes(QueueAttributeName::MessageRetentionPeriod, "3600")
            .send()
            .await?;

        let report = ctx.broker.check_topology(&sub).await?;
        ensure!(report.drift.len() == 2, "{report}");
        let d = find(
            &report,
            &reliq_sqs::queue_name(&sub, false),
            Some("RedrivePolicy.deadLetterTargetArn"),
        )?;
        ensure!(
            d.severity == Severity::Breaking && different(d)?.0 == Some(&json!(foreign_arn)),
            "{d}"
        );
        let d = find(
            &report,
            &reliq_sqs::dead_letter_queue_name(&sub, false),
            Some("MessageRetentionPeriod"),
        )?;
        ensure!(
            d.severity == Severity::Breaking && number(different(d)?.0) == Some(3600),
            "{d}"
        );
        client.delete_queue().queue_url(foreign_url).send().await?;
        rx.close().await?;
        Ok(())
    }
}
