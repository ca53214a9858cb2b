//! One smoke test per real broker started by `scripts/brokers`: connect with the client
//! crate the backend uses, publish one message, read it back. These fail (never skip)
//! when a broker is absent — `just test` starts them.

use std::time::Duration;

use anyhow::{Context, ensure};
use reliq_integration::settings;

fn unique(base: &str) -> String {
    reliq_conformance::support::unique(base)
}

const WAIT: Duration = Duration::from_secs(30);

mod smoke {
    use super::*;

    #[tokio::test]
    async fn rabbit_publish_confirm_and_read_back() -> anyhow::Result<()> {
        use lapin::options::{
            BasicAckOptions, BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions,
            QueueDeclareOptions, QueueDeleteOptions,
        };
        use lapin::types::{AMQPValue, FieldTable};
        use lapin::{BasicProperties, Connection, ConnectionProperties};

        let url = settings::get("RELIQ_RABBIT_URL");
        let conn = Connection::connect(&url, ConnectionProperties::default())
            .await
            .with_context(|| format!("RabbitMQ at {url} (run scripts/brokers up)"))?;
        let ch = conn.create_channel().await?;
        ch.confirm_select(ConfirmSelectOptions::default()).await?;
        let queue = unique("smoke");
        let mut args = FieldTable::default();
        args.insert(
            "x-queue-type".into(),
            AMQPValue::LongString("quorum".into()),
        );
        ch.queue_declare(
            queue.as_str().into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            args,
        )
        .await?;
        let confirm = ch
            .basic_publish(
                "".into(),
                queue.as_str().into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..Default::default()
                },
                b"hello rabbit",
                BasicProperties::default().with_message_id("m-1".into()),
            )
            .await?
            .await?;
        ensure!(confirm.is_ack(), "broker did not confirm: {confirm:?}");
        let deadline = tokio::time::Instant::now() + WAIT;
        let msg = loop {
            if let Some(m) = ch
                .basic_get(queue.as_str().into(), BasicGetOptions::default())
                .await?
            {
                break m;
            }
            ensure!(
                tokio::time::Instant::now() < deadline,
                "message never arrived"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        ensure!(msg.delivery.data == b"hello rabbit");
        ensure!(
            msg.delivery
                .properties
                .message_id()
                .as_ref()
                .map(|s| s.as_str())
                == Some("m-1")
        );
        msg.delivery.ack(BasicAckOptions::default()).await?;
        ch.queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
            .await?;
        conn.close(200, "done".into()).await?;
        Ok(())
    }

    #[tokio::test]
    async fn kafka_produce_acks_all_and_consume_in_a_group() -> anyhow::Result<()> {
        use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
        use rdkafka::client::DefaultClientContext;
        use rdkafka::config::ClientConfig;
        use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
        use rdkafka::message::Message as _;
        use rdkafka::producer::{FutureProducer, FutureRecord};

        let bootstrap = settings::authority(&settings::get("RELIQ_KAFKA_URL")).to_owned();
        let topic = unique("smoke");
        let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
            .set("bootstrap.servers", &bootstrap)
            .create()?;
        let created = admin
            .create_topics(
                &[NewTopic::new(&topic, 3, TopicReplication::Fixed(1))],
                &AdminOptions::new().operation_timeout(Some(WAIT)),
            )
            .await
            .with_context(|| format!("Kafka at {bootstrap} (run scripts/brokers up)"))?;
        for r in created {
            r.map_err(|(t, e)| anyhow::anyhow!("create topic {t}: {e}"))?;
        }
        let producer: FutureProducer = ClientConfig::new()
            .set("bootstrap.servers", &bootstrap)
            .set("acks", "all")
            .set("enable.idempotence", "true")
            .set("message.timeout.ms", "30000")
            .create()?;
        let delivered = producer
            .send(
                FutureRecord::to(&topic).key("k").payload("hello kafka"),
                WAIT,
            )
            .await
            .map_err(|(e, _)| anyhow::anyhow!("produce: {e}"))?;
        ensure!(delivered.offset >= 0 && (0..3).contains(&delivered.partition));
        let consumer: StreamConsumer = ClientConfig::new()
            .set("bootstrap.servers", &bootstrap)
            .set("group.id", unique("smoke-group"))
            .set("enable.auto.commit", "false")
            .set("auto.offset.reset", "earliest")
            .create()?;
        consumer.subscribe(&[&topic])?;
        let msg = tokio::time::timeout(WAIT, consumer.recv())
            .await
            .context("no record within 30 s")??;
        ensure!(msg.payload() == Some(&b"hello kafka"[..]));
        ensure!(msg.key() == Some(&b"k"[..]));
        consumer.commit_message(&msg, CommitMode::Sync)?;
        admin.delete_topics(&[&topic], &AdminOptions::new()).await?;
        Ok(())
    }

    #[tokio::test]
    async fn nats_jetstream_publish_ack_and_pull() -> anyhow::Result<()> {
        use async_nats::jetstream::{self, consumer::pull, stream};
        use futures::StreamExt;

        let url = settings::get("RELIQ_NATS_URL");
        let client = async_nats::connect(&url)
            .await
            .with_context(|| format!("NATS at {url} (run scripts/brokers up)"))?;
        let js = jetstream::new(client);
        let name = unique("smoke");
        let subject = format!("{name}.orders");
        js.create_stream(stream::Config {
            name: name.clone(),
            subjects: vec![format!("{name}.>")],
            ..Default::default()
        })
        .await?;
        let ack = js
            .publish(subject.clone(), "hello nats".into())
            .await?
            .await?;
        ensure!(ack.sequence == 1, "pub ack {ack:?}");
        let stream = js.get_stream(&name).await?;
        let consumer = stream
            .create_consumer(pull::Config {
                durable_name: Some("smoke".into()),
                ack_policy: jetstream::consumer::AckPolicy::Explicit,
                max_ack_pending: 16,
                ..Default::default()
            })
            .await?;
        let mut batch = consumer
            .fetch()
            .max_messages(1)
            .expires(WAIT)
            .messages()
            .await?;
        let msg = batch
            .next()
            .await
            .context("no message fetched")?
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        ensure!(msg.payload.as_ref() == b"hello nats");
        msg.ack().await.map_err(|e| anyhow::anyhow!("ack: {e}"))?;
        js.delete_stream(&name).await?;
        Ok(())
    }

    #[tokio::test]
    async fn sqs_send_receive_delete() -> anyhow::Result<()> {
        use aws_smithy_http_client::{Builder, tls};

        let url = settings::get("RELIQ_SQS_URL");
        let endpoint = format!("http://{}", settings::authority(&url));
        let region = settings::query_param(&url, "region").unwrap_or_else(|| "us-east-1".into());
        let http = Builder::new()
            .tls_provider(tls::Provider::Rustls(
                tls::rustls_provider::CryptoMode::Ring,
            ))
            .build_https();
        let conf = aws_config::defaults(aws_config::BehaviorVersion::latest())
            .http_client(http)
            .endpoint_url(&endpoint)
            .region(aws_config::Region::new(region))
            .credentials_provider(aws_sdk_sqs::config::Credentials::new(
                "test", "test", None, None, "static",
            ))
            .load()
            .await;
        let sqs = aws_sdk_sqs::Client::new(&conf);
        let queue = sqs
            .create_queue()
            .queue_name(unique("smoke"))
            .send()
            .await
            .with_context(|| format!("SQS at {endpoint} (run scripts/brokers up)"))?;
        let queue_url = queue.queue_url().context("no queue url")?.to_owned();
        sqs.send_message()
            .queue_url(&queue_url)
            .message_body("hello sqs")
            .send()
            .await?;
        let got = sqs
            .receive_message()
            .queue_url(&queue_url)
            .max_number_of_messages(1)
            .wait_time_seconds(10)
            .send()
            .await?;
        let msg = got.messages().first().context("no message received")?;
        ensure!(msg.body() == Some("hello sqs"));
        sqs.delete_message()
            .queue_url(&queue_url)
            .receipt_handle(msg.receipt_handle().context("no receipt handle")?)
            .send()
            .await?;
        sqs.delete_queue().queue_url(&queue_url).send().await?;
        Ok(())
    }

    #[tokio::test]
    async fn postgres_connects_and_round_trips_a_row() -> anyhow::Result<()> {
        use sqlx::Row;
        let url = settings::get("RELIQ_POSTGRES_URL");
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .acquire_timeout(WAIT)
            .connect(&url)
            .await
            .with_context(|| {
                format!(
                    "PostgreSQL at {} (run scripts/brokers up)",
                    settings::authority(&url)
                )
            })?;
        let mut tx = pool.begin().await?;
        sqlx::query("CREATE TEMP TABLE smoke (id text PRIMARY KEY) ON COMMIT DROP")
            .execute(&mut *tx)
            .await?;
        let inserted =
            sqlx::query("INSERT INTO smoke VALUES ($1) ON CONFLICT DO NOTHING RETURNING 1")
                .bind("m-1")
                .fetch_optional(&mut *tx)
                .await?;
        let again = sqlx::query("INSERT INTO smoke VALUES ($1) ON CONFLICT DO NOTHING RETURNING 1")
            .bind("m-1")
            .fetch_optional(&mut *tx)
            .await?;
        ensure!(
            inserted.is_some() && again.is_none(),
            "the inbox claim idiom works"
        );
        let row = sqlx::query("SELECT count(*) AS n FROM smoke")
            .fetch_one(&mut *tx)
            .await?;
        ensure!(row.try_get::<i64, _>("n")? == 1);
        tx.commit().await?;
        Ok(())
    }
}

/// `docker-compose.yml` parses, has every broker with a healthcheck, and publishes the
/// same host ports as `brokers.env` (what the local script uses).
mod compose {
    use super::*;
    use yaml_rust2::{Yaml, YamlLoader};

    #[test]
    fn docker_compose_matches_the_local_script() -> anyhow::Result<()> {
        let text = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../docker-compose.yml"
        ))?;
        let docs = YamlLoader::load_from_str(&text)?;
        let services = &docs.first().context("empty compose file")?["services"];
        let expect = [
            ("rabbitmq", vec!["RABBITMQ_PORT", "RABBITMQ_MGMT_PORT"]),
            ("kafka", vec!["KAFKA_PORT"]),
            ("nats", vec!["NATS_PORT", "NATS_MONITOR_PORT"]),
            ("sqs", vec!["SQS_PORT"]),
            ("postgres", vec!["POSTGRES_PORT"]),
        ];
        for (name, port_keys) in expect {
            let svc = &services[name];
            ensure!(!svc.is_badvalue(), "service `{name}` missing");
            ensure!(
                !svc["healthcheck"].is_badvalue(),
                "service `{name}` has no healthcheck"
            );
            let published: Vec<String> = svc["ports"]
                .as_vec()
                .context("ports")?
                .iter()
                .filter_map(Yaml::as_str)
                .map(|p| {
                    // "127.0.0.1:HOST:CONTAINER" → HOST
                    let parts: Vec<&str> = p.split(':').collect();
                    parts[parts.len().saturating_sub(2)].to_owned()
                })
                .collect();
            for key in port_keys {
                let port =
                    settings::file_value(key).with_context(|| format!("{key} in brokers.env"))?;
                ensure!(
                    published.contains(&port),
                    "`{name}` publishes {published:?}, brokers.env says {key}={port}"
                );
            }
        }
        Ok(())
    }
}
