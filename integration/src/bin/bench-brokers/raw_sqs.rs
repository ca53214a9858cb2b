//! The plain aws-sdk-sqs idiom, on the same client stack reliq uses.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, ensure};
use aws_sdk_sqs::types::{DeleteMessageBatchRequestEntry, Message, SendMessageBatchRequestEntry};
use futures::StreamExt;
use reliq_conformance::support::unique;
use reliq_integration::settings;

use crate::PREFETCH;
use crate::measure::{Rate, cpu_time};
use crate::workload::{payload, publish_window};

async fn queue() -> anyhow::Result<(aws_sdk_sqs::Client, String)> {
    let broker = reliq_sqs::SqsBroker::connect(&settings::get("RELIQ_SQS_URL")).await?;
    let client = broker.client().clone();
    let out = client
        .create_queue()
        .queue_name(unique("raw-bench"))
        .send()
        .await?;
    let url = out.queue_url().context("no queue url")?.to_owned();
    Ok((client, url))
}

/// `SendMessage` per message, 64 in flight (reliq batches what arrives together).
pub async fn publish(n: usize) -> anyhow::Result<Rate> {
    let (client, url) = queue().await?;
    publish_window(n, |i| {
        let send = client.send_message().queue_url(&url);
        async move {
            send.message_body(String::from_utf8(payload(i))?)
                .send()
                .await?;
            Ok(())
        }
    })
    .await
}

/// Fill a queue with `n` messages, `SendMessageBatch` by 10.
async fn fill(client: &aws_sdk_sqs::Client, url: &str, n: usize) -> anyhow::Result<()> {
    for chunk in (0..n).collect::<Vec<_>>().chunks(10) {
        let mut batch = client.send_message_batch().queue_url(url);
        for i in chunk {
            batch = batch.entries(
                SendMessageBatchRequestEntry::builder()
                    .id(i.to_string())
                    .message_body(String::from_utf8(payload(*i))?)
                    .build()?,
            );
        }
        batch.send().await?;
    }
    Ok(())
}

/// Fill with `SendMessageBatch`, then a receive (10, long poll) / `DeleteMessageBatch`
/// loop, timed from the first receive that returns messages.
pub async fn consume(n: usize) -> anyhow::Result<Rate> {
    let (client, url) = queue().await?;
    fill(&client, &url, n).await?;
    let mut done = 0;
    let cpu0 = cpu_time();
    let mut t0 = None;
    while done < n {
        let out = client
            .receive_message()
            .queue_url(&url)
            .max_number_of_messages(10)
            .wait_time_seconds(1)
            .send()
            .await?;
        let messages = out.messages();
        if messages.is_empty() {
            continue;
        }
        t0.get_or_insert_with(Instant::now);
        delete(&client, &url, messages).await?;
        done += messages.len();
    }
    let t0 = t0.context("no delivery")?;
    Ok(Rate::since(n, t0, cpu0))
}

/// The fastest safe consume: [`receive_and_settle`]'s loop, each batch deleted
/// (`DeleteMessageBatch`) while the next is received, up to the prefetch.
pub async fn consume_fast(n: usize) -> anyhow::Result<Rate> {
    let (client, _) = queue().await?;
    receive_and_settle(n, n, move |url, messages| {
        let client = client.clone();
        Box::pin(async move {
            delete(&client, &url, &messages).await?;
            Ok(messages.len())
        })
    })
    .await
}

/// `DeleteMessageBatch` of `messages` (at most 10), every entry confirmed.
async fn delete(
    client: &aws_sdk_sqs::Client,
    url: &str,
    messages: &[Message],
) -> anyhow::Result<()> {
    let mut delete = client.delete_message_batch().queue_url(url);
    for (i, m) in messages.iter().enumerate() {
        delete = delete.entries(
            DeleteMessageBatchRequestEntry::builder()
                .id(i.to_string())
                .receipt_handle(m.receipt_handle().context("no receipt")?)
                .build()?,
        );
    }
    let out = delete.send().await?;
    ensure!(
        out.failed().is_empty(),
        "deletes failed: {:?}",
        out.failed()
    );
    Ok(())
}

/// The dead-letter path's broker work: each received batch copied to a second queue
/// (`SendMessageBatch`, every entry confirmed), then deleted.
pub async fn forward(n: usize) -> anyhow::Result<Rate> {
    let (client, dlq) = queue().await?;
    receive_and_settle(n, n, move |url, messages| {
        let (client, dlq) = (client.clone(), dlq.clone());
        Box::pin(async move {
            let mut copy = client.send_message_batch().queue_url(&dlq);
            for (i, m) in messages.iter().enumerate() {
                copy = copy.entries(
                    SendMessageBatchRequestEntry::builder()
                        .id(i.to_string())
                        .message_body(m.body().unwrap_or_default())
                        .build()?,
                );
            }
            let out = copy.send().await?;
            ensure!(out.failed().is_empty(), "copies failed: {:?}", out.failed());
            delete(&client, &url, &messages).await?;
            Ok(messages.len())
        })
    })
    .await
}

/// The retry path's broker work as reliq's SQS backend does it: a message's first
/// receipt made visible again after the tier (`ChangeMessageVisibilityBatch`, 1 s —
/// SQS counts whole seconds, and reliq rounds its 200 ms tier up to one), its second
/// receipt deleted.
pub async fn retry(n: usize) -> anyhow::Result<Rate> {
    use aws_sdk_sqs::types::ChangeMessageVisibilityBatchRequestEntry;
    let seen = Arc::new(std::sync::Mutex::new(std::collections::HashSet::new()));
    let (client, _) = queue().await?;
    receive_and_settle(n, 2 * n, move |url, messages| {
        let (client, seen) = (client.clone(), seen.clone());
        Box::pin(async move {
            let (again, first): (Vec<Message>, Vec<Message>) = {
                let mut seen = seen.lock().map_err(|_| anyhow::anyhow!("poisoned"))?;
                messages
                    .into_iter()
                    .partition(|m| !seen.insert(m.message_id().unwrap_or_default().to_owned()))
            };
            if !first.is_empty() {
                let mut hide = client.change_message_visibility_batch().queue_url(&url);
                for (i, m) in first.iter().enumerate() {
                    hide = hide.entries(
                        ChangeMessageVisibilityBatchRequestEntry::builder()
                            .id(i.to_string())
                            .receipt_handle(m.receipt_handle().context("no receipt")?)
                            .visibility_timeout(1)
                            .build()?,
                    );
                }
                let out = hide.send().await?;
                ensure!(
                    out.failed().is_empty(),
                    "visibility changes failed: {:?}",
                    out.failed()
                );
            }
            if !again.is_empty() {
                delete(&client, &url, &again).await?;
            }
            Ok(again.len())
        })
    })
    .await
}

/// A pipelined receive loop on a queue filled with `n`: receives (10 at a time, long
/// poll) one after another until `receipts` messages are received, each batch settled
/// by `settle` while the next is received — up to [`PREFETCH`] messages in flight, as reliq's
/// receiver holds them. `settle` returns how many of its messages are finished. Timed
/// from the first receive that returns messages to the n-th finished.
async fn receive_and_settle(
    n: usize,
    receipts: usize,
    settle: impl Fn(String, Vec<Message>) -> futures::future::BoxFuture<'static, anyhow::Result<usize>>,
) -> anyhow::Result<Rate> {
    use futures::FutureExt;
    let (client, url) = queue().await?;
    fill(&client, &url, n).await?;
    let cpu0 = cpu_time();
    let (mut t0, mut finished, mut held, mut received) = (None, 0usize, 0usize, 0usize);
    let mut in_flight = futures::stream::FuturesUnordered::new();
    while finished < n {
        if held + 10 > PREFETCH as usize || received >= receipts {
            if let Some((count, done)) = in_flight.next().await {
                (held, finished) = (held - count, finished + done?);
            }
            continue;
        }
        // Never a receive raced against a settlement: a receive dropped mid-poll
        // would leave its messages invisible for the queue's visibility timeout.
        while let Some(Some((count, done))) = in_flight.next().now_or_never() {
            (held, finished) = (held - count, finished + done?);
        }
        let out = client
            .receive_message()
            .queue_url(&url)
            .max_number_of_messages(10)
            .wait_time_seconds(1)
            .send()
            .await?;
        let messages = out.messages().to_vec();
        if messages.is_empty() {
            continue;
        }
        t0.get_or_insert_with(Instant::now);
        let count = messages.len();
        (held, received) = (held + count, received + count);
        in_flight.push(settle(url.clone(), messages).map(move |done| (count, done)));
    }
    let t0 = t0.context("no delivery")?;
    Ok(Rate::since(n, t0, cpu0))
}
