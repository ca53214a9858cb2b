//! The raw RabbitMQ baselines, on lapin.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, ensure};
use futures::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use reliq_conformance::support::unique;
use reliq_core::MessageId;
use reliq_integration::settings;

use crate::measure::{Rate, cpu_time};
use crate::workload::{forward_loop, payload, publish_window};
use crate::{PREFETCH, RETRY_TIER};

async fn channel() -> anyhow::Result<(Connection, Channel, String)> {
    let conn = Connection::connect(
        &settings::get("RELIQ_RABBIT_URL"),
        ConnectionProperties::default(),
    )
    .await?;
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    let queue = unique("bench-raw");
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
    // Same broker work as reliq's publish: a durable topic exchange routing to the
    // queue, persistent messages carrying a message id (a UUID, as reliq's).
    ch.exchange_declare(
        queue.as_str().into(),
        lapin::ExchangeKind::Topic,
        ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await?;
    ch.queue_bind(
        queue.as_str().into(),
        queue.as_str().into(),
        "#".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await?;
    Ok((conn, ch, queue))
}

async fn fill(ch: &Channel, queue: &str, n: usize) -> anyhow::Result<Rate> {
    publish_window(n, |i| async move {
        let confirm = ch
            .basic_publish(
                queue.into(),
                "".into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..Default::default()
                },
                &payload(i),
                BasicProperties::default()
                    .with_delivery_mode(2)
                    .with_message_id(MessageId::generate().as_str().into()),
            )
            .await?;
        ensure!(confirm.await?.is_ack(), "broker nacked a publish");
        Ok(())
    })
    .await
}

pub async fn publish(n: usize) -> anyhow::Result<Rate> {
    let (_conn, ch, queue) = channel().await?;
    fill(&ch, &queue, n).await
}

/// A queue filled with `n` messages and a consumer on it (prefetch [`PREFETCH`]).
async fn filled(n: usize) -> anyhow::Result<(Connection, Channel, String, lapin::Consumer)> {
    let (conn, ch, queue) = channel().await?;
    fill(&ch, &queue, n).await?;
    ch.basic_qos(u16::try_from(PREFETCH)?, BasicQosOptions::default())
        .await?;
    let consumer = ch
        .basic_consume(
            queue.as_str().into(),
            "raw".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    Ok((conn, ch, queue, consumer))
}

pub async fn consume(n: usize) -> anyhow::Result<Rate> {
    let (_conn, _ch, _, mut consumer) = filled(n).await?;
    let cpu0 = cpu_time();
    let mut t0 = None;
    for _ in 0..n {
        let d = consumer.next().await.context("consumer ended")??;
        t0.get_or_insert_with(Instant::now);
        d.ack(BasicAckOptions::default()).await?;
    }
    let t0 = t0.context("no delivery")?;
    Ok(Rate::since(n, t0, cpu0))
}

/// The fastest safe consume lapin allows: each delivery handled, then acknowledged
/// with one `multiple` ack per 64 deliveries (and the rest at the end) instead of an
/// awaited ack each — the limit the runtime is measured against, beside the idiom.
pub async fn consume_fast(n: usize) -> anyhow::Result<Rate> {
    let (_conn, ch, _, mut consumer) = filled(n).await?;
    let cpu0 = cpu_time();
    let mut t0 = None;
    for i in 0..n {
        let d = consumer.next().await.context("consumer ended")??;
        t0.get_or_insert_with(Instant::now);
        std::hint::black_box(&d.data);
        if i % 64 == 63 || i + 1 == n {
            ch.basic_ack(d.delivery_tag, BasicAckOptions { multiple: true })
                .await?;
        }
    }
    let t0 = t0.context("no delivery")?;
    Ok(Rate::since(n, t0, cpu0))
}

/// Declare the durable quorum queue `name` (with `args` besides its type) and open a
/// channel with publisher confirms to copy deliveries into it.
async fn target_queue(
    conn: &Connection,
    ch: &Channel,
    name: &str,
    args: Vec<(&str, AMQPValue)>,
) -> anyhow::Result<Channel> {
    let mut table = FieldTable::default();
    table.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".into()),
    );
    for (key, value) in args {
        table.insert(key.into(), value);
    }
    ch.queue_declare(
        name.into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        table,
    )
    .await?;
    let publisher = conn.create_channel().await?;
    publisher
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    Ok(publisher)
}

/// Publish `d` (body and properties as they came) to `queue`, mandatory, and wait for
/// the broker's confirm.
async fn copy_to(
    publisher: &Channel,
    queue: &str,
    d: &lapin::message::Delivery,
) -> anyhow::Result<()> {
    let confirm = publisher
        .basic_publish(
            "".into(),
            queue.into(),
            BasicPublishOptions {
                mandatory: true,
                ..Default::default()
            },
            &d.data,
            d.properties.clone(),
        )
        .await?;
    ensure!(confirm.await?.is_ack(), "broker nacked a publish");
    Ok(())
}

/// The retry path's broker work, as reliq's RabbitMQ topology does it: each message
/// consumed, published (confirmed) to a quorum TTL queue of [`RETRY_TIER`] whose
/// expired messages the broker dead-letters back to the source (at least once), and
/// acked; delivered again (it now has an `x-death` header), and acked. N messages,
/// 2N deliveries, timed from the first delivery to the N-th second one acked.
pub async fn retry(n: usize) -> anyhow::Result<Rate> {
    let (conn, ch, queue, consumer) = filled(n).await?;
    let retry_queue: Arc<str> = format!("{queue}.retry").into();
    let ttl = i64::try_from(RETRY_TIER.as_millis())?;
    let publisher = target_queue(
        &conn,
        &ch,
        &retry_queue,
        vec![
            ("x-dead-letter-exchange", AMQPValue::LongString("".into())),
            (
                "x-dead-letter-routing-key",
                AMQPValue::LongString(queue.as_str().into()),
            ),
            ("x-overflow", AMQPValue::LongString("reject-publish".into())),
            (
                "x-dead-letter-strategy",
                AMQPValue::LongString("at-least-once".into()),
            ),
            ("x-message-ttl", AMQPValue::LongLongInt(ttl)),
        ],
    )
    .await?;
    let deliveries = consumer.map(|d| d.map_err(anyhow::Error::from));
    let both = forward_loop(
        2 * n,
        deliveries,
        |d: lapin::message::Delivery| {
            let (publisher, retry_queue) = (publisher.clone(), retry_queue.clone());
            async move {
                let retried = d
                    .properties
                    .headers()
                    .as_ref()
                    .is_some_and(|h| h.inner().keys().any(|k| k.as_str() == "x-death"));
                if !retried {
                    copy_to(&publisher, &retry_queue, &d).await?;
                }
                d.ack(BasicAckOptions::default()).await?;
                anyhow::Ok(())
            }
        },
        |()| Ok(()),
    )
    .await?;
    Ok(both.per_message_of_two())
}

/// The dead-letter path's broker work: each message consumed, published to a second
/// quorum queue (persistent, mandatory, confirmed), then acked.
pub async fn forward(n: usize) -> anyhow::Result<Rate> {
    let (conn, ch, queue, consumer) = filled(n).await?;
    let dlq: Arc<str> = format!("{queue}.dlq").into();
    let publisher = target_queue(&conn, &ch, &dlq, Vec::new()).await?;
    let deliveries = consumer.map(|d| d.map_err(anyhow::Error::from));
    forward_loop(
        n,
        deliveries,
        |d: lapin::message::Delivery| {
            let (publisher, dlq) = (publisher.clone(), dlq.clone());
            async move {
                copy_to(&publisher, &dlq, &d).await?;
                d.ack(BasicAckOptions::default()).await?;
                anyhow::Ok(())
            }
        },
        |()| Ok(()),
    )
    .await
}
