//! The raw NATS JetStream baselines, on async-nats.

use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use async_nats::jetstream::{self, consumer::pull, stream};
use futures::StreamExt;
use reliq_conformance::support::unique;
use reliq_core::MessageId;
use reliq_integration::settings;

use crate::measure::{Rate, cpu_time};
use crate::workload::{forward_loop, payload, publish_window};
use crate::{PREFETCH, RETRY_TIER};

async fn stream_with(n_fill: usize) -> anyhow::Result<(jetstream::Context, String, Rate)> {
    let client = async_nats::connect(settings::get("RELIQ_NATS_URL")).await?;
    let js = jetstream::new(client);
    let name = unique("bench-raw");
    js.create_stream(stream::Config {
        name: name.clone(),
        subjects: vec![name.clone()],
        ..Default::default()
    })
    .await?;
    let rate = publish_window(n_fill, |i| {
        let (js, subject) = (js.clone(), name.clone());
        async move {
            // Same server work as reliq's publish: deduplication by message id.
            let mut headers = async_nats::HeaderMap::new();
            headers.insert("Nats-Msg-Id", MessageId::generate().as_str());
            js.publish_with_headers(subject, headers, payload(i).into())
                .await?
                .await?;
            Ok(())
        }
    })
    .await?;
    Ok((js, name, rate))
}

pub async fn publish(n: usize) -> anyhow::Result<Rate> {
    Ok(stream_with(n).await?.2)
}

pub async fn consume(n: usize) -> anyhow::Result<Rate> {
    let (js, name, _) = stream_with(n).await?;
    let mut messages = messages_of(&js, &name).await?;
    let cpu0 = cpu_time();
    let mut t0 = None;
    for _ in 0..n {
        let m = messages.next().await.context("stream ended")??;
        t0.get_or_insert_with(Instant::now);
        m.double_ack().await.map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    let t0 = t0.context("no delivery")?;
    Ok(Rate::since(n, t0, cpu0))
}

/// A pull consumer's messages on stream `name` (explicit acks, [`PREFETCH`] pending).
async fn messages_of(
    js: &jetstream::Context,
    name: &str,
) -> anyhow::Result<impl futures::Stream<Item = anyhow::Result<jetstream::Message>> + Unpin> {
    let consumer = js
        .get_stream(name)
        .await?
        .create_consumer(pull::Config {
            durable_name: Some("raw".into()),
            ack_policy: jetstream::consumer::AckPolicy::Explicit,
            max_ack_pending: i64::from(PREFETCH),
            ..Default::default()
        })
        .await?;
    Ok(consumer
        .messages()
        .await?
        .map(|m| m.map_err(|e| anyhow::anyhow!("{e}"))))
}

/// The fastest safe consume async-nats allows with confirmed acks (reliq's NATS
/// default): each message handled, its `double_ack` started at once and up to the
/// prefetch of them awaited together instead of one after another.
pub async fn consume_fast(n: usize) -> anyhow::Result<Rate> {
    let (js, name, _) = stream_with(n).await?;
    let messages = messages_of(&js, &name).await?;
    forward_loop(
        n,
        messages,
        |m: jetstream::Message| async move {
            std::hint::black_box(&m.payload);
            m.double_ack().await.map_err(|e| anyhow::anyhow!("{e}"))
        },
        |()| Ok(()),
    )
    .await
}

/// The retry path's broker work, as reliq's NATS backend does it: each message's
/// first delivery scheduled again on the server (a `Nats-Schedule: @at` message to a
/// subject of its own, targeting the stream's due subject; the `PubAck` awaited)
/// and double-acked; the copy, published by the server when due, double-acked. N
/// messages, 2N deliveries, timed from the first delivery to the N-th second one.
pub async fn retry(n: usize) -> anyhow::Result<Rate> {
    let client = async_nats::connect(settings::get("RELIQ_NATS_URL")).await?;
    let js = jetstream::new(client);
    let name = unique("bench-raw");
    let due: Arc<str> = format!("{name}.due").into();
    js.create_stream(stream::Config {
        name: name.clone(),
        subjects: vec![name.clone(), format!("{name}.at.>"), due.to_string()],
        allow_message_schedules: true,
        ..Default::default()
    })
    .await?;
    publish_window(n, |i| {
        let (js, subject) = (js.clone(), name.clone());
        async move {
            let mut headers = async_nats::HeaderMap::new();
            headers.insert("Nats-Msg-Id", MessageId::generate().as_str());
            js.publish_with_headers(subject, headers, payload(i).into())
                .await?
                .await?;
            Ok(())
        }
    })
    .await?;
    // Only the source and the due copies: the schedules themselves stay unread.
    let consumer = js
        .get_stream(&name)
        .await?
        .create_consumer(pull::Config {
            durable_name: Some("raw".into()),
            ack_policy: jetstream::consumer::AckPolicy::Explicit,
            max_ack_pending: i64::from(PREFETCH),
            filter_subjects: vec![name.clone(), due.to_string()],
            ..Default::default()
        })
        .await?;
    let messages = consumer
        .messages()
        .await?
        .map(|m| m.map_err(|e| anyhow::anyhow!("{e}")));
    let both = forward_loop(
        2 * n,
        messages,
        |m: jetstream::Message| {
            let (js, due, source) = (js.clone(), due.clone(), name.clone());
            async move {
                if m.subject.as_str() == source {
                    let seq = m
                        .info()
                        .map_err(|e| anyhow::anyhow!("{e}"))?
                        .stream_sequence;
                    let at = std::time::SystemTime::now() + RETRY_TIER;
                    let mut headers = m.headers.clone().unwrap_or_default();
                    headers.insert(
                        "Nats-Schedule",
                        format!("@at {}", reliq_core::seam::headers::format_time(at)).as_str(),
                    );
                    headers.insert("Nats-Schedule-Target", &*due);
                    headers.insert("Nats-Msg-Id", format!("retry:{seq}").as_str());
                    js.publish_with_headers(
                        format!("{source}.at.{seq}"),
                        headers,
                        m.payload.clone(),
                    )
                    .await?
                    .await?;
                }
                m.double_ack().await.map_err(|e| anyhow::anyhow!("{e}"))
            }
        },
        |()| Ok(()),
    )
    .await?;
    Ok(both.per_message_of_two())
}

/// The dead-letter path's broker work: each message consumed, published to a second
/// stream with its headers and a deduplication id (the server's ack awaited), then
/// acked with the server's confirmation (as reliq's NATS acks are).
pub async fn forward(n: usize) -> anyhow::Result<Rate> {
    let (js, name, _) = stream_with(n).await?;
    let dlq = format!("{name}-dlq");
    js.create_stream(stream::Config {
        name: dlq.clone(),
        subjects: vec![dlq.clone()],
        ..Default::default()
    })
    .await?;
    let messages = messages_of(&js, &name).await?;
    forward_loop(
        n,
        messages,
        |m: jetstream::Message| {
            let (js, dlq) = (js.clone(), dlq.clone());
            async move {
                let mut headers = m.headers.clone().unwrap_or_default();
                headers.insert("Nats-Msg-Id", MessageId::generate().as_str());
                js.publish_with_headers(dlq, headers, m.payload.clone())
                    .await?
                    .await?;
                m.double_ack().await.map_err(|e| anyhow::anyhow!("{e}"))?;
                anyhow::Ok(())
            }
        },
        |()| Ok(()),
    )
    .await
}
