//! Batching of `SendMessage` and `DeleteMessage` calls: requests for one queue that
//! arrive within a short window ([`crate::SqsOptions::batch_window`]) go out as one
//! `SendMessageBatch` / `DeleteMessageBatch` (≤ 10 entries, ≤ 256 KiB). Each caller
//! still waits for its own entry's result: a per-entry failure is that caller's error,
//! never ignored.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use aws_sdk_sqs::types::{DeleteMessageBatchRequestEntry, SendMessageBatchRequestEntry};
use futures::future::BoxFuture;
use reliq_core::BrokerError;
use tokio::sync::{mpsc, oneshot};

use crate::codec::Encoded;
use crate::{SqsError, sdk_error};

const MAX_ENTRIES: usize = 10;
const MAX_BATCH_BYTES: usize = 250 * 1024;

type Done = oneshot::Sender<Result<(), BrokerError>>;

struct Job<E> {
    url: String,
    entry: E,
    size: usize,
    done: Done,
}

type FlushFn<E> =
    Arc<dyn Fn(String, Vec<E>) -> BoxFuture<'static, Vec<Result<(), BrokerError>>> + Send + Sync>;

/// A queue of entries flushed in batches by a background task.
pub(crate) struct Batcher<E> {
    tx: mpsc::UnboundedSender<Job<E>>,
}

impl<E: Send + 'static> Batcher<E> {
    fn start(window: Duration, flush: FlushFn<E>) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(run(rx, window, flush));
        Self { tx }
    }

    async fn submit(&self, url: &str, entry: E, size: usize) -> Result<(), BrokerError> {
        let (done, result) = oneshot::channel();
        self.tx
            .send(Job {
                url: url.to_owned(),
                entry,
                size,
                done,
            })
            .map_err(|_| BrokerError::Connection("the SQS batcher stopped".into()))?;
        result
            .await
            .map_err(|_| BrokerError::Connection("the SQS batcher dropped a request".into()))?
    }
}

async fn run<E: Send + 'static>(
    mut rx: mpsc::UnboundedReceiver<Job<E>>,
    window: Duration,
    flush: FlushFn<E>,
) {
    while let Some(first) = rx.recv().await {
        let mut jobs = vec![first];
        let deadline = tokio::time::sleep(window);
        tokio::pin!(deadline);
        while jobs.len() < 100 {
            tokio::select! {
                job = rx.recv() => match job {
                    Some(job) => jobs.push(job),
                    None => break,
                },
                _ = &mut deadline => break,
            }
        }
        let mut by_url: HashMap<String, Vec<Job<E>>> = HashMap::new();
        for job in jobs {
            by_url.entry(job.url.clone()).or_default().push(job);
        }
        for (url, jobs) in by_url {
            let mut chunk: Vec<Job<E>> = Vec::new();
            let mut bytes = 0;
            for job in jobs {
                if !chunk.is_empty()
                    && (chunk.len() == MAX_ENTRIES || bytes + job.size > MAX_BATCH_BYTES)
                {
                    tokio::spawn(flush_chunk(
                        url.clone(),
                        std::mem::take(&mut chunk),
                        flush.clone(),
                    ));
                    bytes = 0;
                }
                bytes += job.size;
                chunk.push(job);
            }
            if !chunk.is_empty() {
                tokio::spawn(flush_chunk(url, chunk, flush.clone()));
            }
        }
    }
}

async fn flush_chunk<E>(url: String, jobs: Vec<Job<E>>, flush: FlushFn<E>) {
    let (entries, dones): (Vec<E>, Vec<Done>) = jobs.into_iter().map(|j| (j.entry, j.done)).unzip();
    let results = flush(url, entries).await;
    for (done, result) in dones.into_iter().zip(results) {
        let _ = done.send(result);
    }
}

/// Spread one call's result over `n` entries, or map per-entry failures by entry id.
fn per_entry(
    n: usize,
    operation: &'static str,
    call: Result<Vec<(String, String, String)>, BrokerError>,
    ok_ids: impl FnOnce() -> Vec<String>,
) -> Vec<Result<(), BrokerError>> {
    match call {
        Err(e) => {
            let text = e.to_string();
            (0..n).map(|_| Err(clone_kind(&e, text.clone()))).collect()
        }
        Ok(failed) => {
            let ok = ok_ids();
            (0..n)
                .map(|i| {
                    let id = i.to_string();
                    if let Some((_, code, message)) = failed.iter().find(|(f, _, _)| *f == id) {
                        Err(BrokerError::Other(Box::new(SqsError::Service {
                            operation,
                            code: code.clone(),
                            message: message.clone(),
                        })))
                    } else if ok.contains(&id) {
                        Ok(())
                    } else {
                        Err(BrokerError::Other(Box::new(SqsError::Incomplete {
                            operation,
                            what: "result for a batch entry",
                        })))
                    }
                })
                .collect()
        }
    }
}

/// The same kind of error for every entry of a failed call.
fn clone_kind(e: &BrokerError, text: String) -> BrokerError {
    match e {
        BrokerError::Unroutable(_) => BrokerError::Unroutable(text),
        BrokerError::Connection(_) => BrokerError::Connection(text),
        BrokerError::Timeout(d) => BrokerError::Timeout(*d),
        _ => BrokerError::Rejected(text),
    }
}

/// Batched `SendMessage`.
pub(crate) fn sends(client: aws_sdk_sqs::Client, window: Duration) -> Batcher<Encoded> {
    Batcher::start(
        window,
        Arc::new(move |url: String, entries: Vec<Encoded>| {
            let client = client.clone();
            Box::pin(async move {
                let n = entries.len();
                let mut request = client.send_message_batch().queue_url(url);
                for (i, e) in entries.into_iter().enumerate() {
                    let (group, dedup) = e.fifo.unzip();
                    let entry = SendMessageBatchRequestEntry::builder()
                        .id(i.to_string())
                        .message_body(e.body)
                        .set_message_attributes(Some(e.attributes))
                        .set_message_group_id(group)
                        .set_message_deduplication_id(dedup)
                        .build();
                    match entry {
                        Ok(entry) => request = request.entries(entry),
                        Err(err) => return all_rejected(n, &err),
                    }
                }
                let out = request.send().await;
                let ok_ids = out
                    .as_ref()
                    .map(|o| o.successful().iter().map(|s| s.id().to_owned()).collect())
                    .unwrap_or_default();
                let call = out
                    .map(|o| failures(o.failed()))
                    .map_err(|e| sdk_error("SendMessageBatch", e));
                per_entry(n, "SendMessageBatch", call, || ok_ids)
            })
        }),
    )
}

/// The failed entries of a batch call: (entry id, code, message).
fn failures(failed: &[aws_sdk_sqs::types::BatchResultErrorEntry]) -> Vec<(String, String, String)> {
    failed
        .iter()
        .map(|f| {
            (
                f.id().to_owned(),
                f.code().to_owned(),
                f.message().unwrap_or_default().to_owned(),
            )
        })
        .collect()
}

/// Every entry of a batch that could not even be built fails with the same error.
fn all_rejected(n: usize, err: &impl std::fmt::Display) -> Vec<Result<(), BrokerError>> {
    (0..n)
        .map(|_| Err(BrokerError::Rejected(err.to_string())))
        .collect()
}

/// Batched `DeleteMessage` (entries are receipt handles).
pub(crate) fn deletes(client: aws_sdk_sqs::Client, window: Duration) -> Batcher<String> {
    Batcher::start(
        window,
        Arc::new(move |url: String, receipts: Vec<String>| {
            let client = client.clone();
            Box::pin(async move {
                let n = receipts.len();
                let mut request = client.delete_message_batch().queue_url(url);
                for (i, r) in receipts.into_iter().enumerate() {
                    match DeleteMessageBatchRequestEntry::builder()
                        .id(i.to_string())
                        .receipt_handle(r)
                        .build()
                    {
                        Ok(entry) => request = request.entries(entry),
                        Err(err) => return all_rejected(n, &err),
                    }
                }
                let out = request.send().await;
                let ok_ids = out
                    .as_ref()
                    .map(|o| o.successful().iter().map(|s| s.id().to_owned()).collect())
                    .unwrap_or_default();
                let call = out
                    .map(|o| failures(o.failed()))
                    .map_err(|e| sdk_error("DeleteMessageBatch", e));
                per_entry(n, "DeleteMessageBatch", call, || ok_ids)
            })
        }),
    )
}

impl Batcher<Encoded> {
    /// Send one message through the batcher.
    pub(crate) async fn send(&self, url: &str, encoded: Encoded) -> Result<(), BrokerError> {
        let size = encoded.body.len()
            + encoded
                .attributes
                .iter()
                .map(|(k, v)| k.len() + v.string_value().map_or(0, str::len) + 16)
                .sum::<usize>();
        self.submit(url, encoded, size).await
    }
}

impl Batcher<String> {
    /// Delete one message (by receipt handle) through the batcher.
    pub(crate) async fn delete(&self, url: &str, receipt: &str) -> Result<(), BrokerError> {
        self.submit(url, receipt.to_owned(), receipt.len()).await
    }
}
