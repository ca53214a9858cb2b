//! Batching of `SendMessage` and `DeleteMessage` calls: requests for one queue that
//! arrive within a short window ([`crate::options::SqsOptions::batch_window`]) go out as one
//! `SendMessageBatch` / `DeleteMessageBatch` (≤ 10 entries, ≤ 256 KiB). Each caller
//! still waits for its own entry's result: a per-entry failure is that caller's error,
//! never ignored.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use aws_sdk_sqs::types::{
    BatchResultErrorEntry, DeleteMessageBatchRequestEntry, SendMessageBatchRequestEntry,
};
use futures::future::BoxFuture;
use reliq_core::BrokerError;
use tokio::sync::{mpsc, oneshot};

use crate::codec::Encoded;
use crate::error::SqsError;
use crate::error::sdk_error;

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
            .map_err(|_| BrokerError::connection("the SQS batcher stopped"))?;
        result.await.map_err(|e| {
            BrokerError::connection("the SQS batcher dropped a request").caused_by(e)
        })?
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

/// What a batch call reported: the entry ids it says succeeded, and its failed entries.
struct Reported<'a> {
    ok: Vec<&'a str>,
    failed: &'a [BatchResultErrorEntry],
}

/// Spread one call's result over `n` entries (ids `0..n`): a failed call fails every
/// entry; otherwise each entry is reported successful, failed (with the service's code
/// and message), or — if the response does not mention it — incomplete. Never assumed
/// successful.
fn per_entry(
    n: usize,
    operation: &'static str,
    call: Result<Reported<'_>, BrokerError>,
) -> Vec<Result<(), BrokerError>> {
    let reported = match call {
        Ok(reported) => reported,
        Err(e) => {
            let e = Arc::new(e);
            return (0..n).map(|_| Err(clone_kind(&e))).collect();
        }
    };
    (0..n)
        .map(|i| {
            let id = i.to_string();
            if let Some(f) = reported.failed.iter().find(|f| f.id() == id) {
                Err(BrokerError::Other(Box::new(SqsError::Service {
                    operation,
                    code: f.code().to_owned(),
                    message: f.message().unwrap_or_default().to_owned(),
                })))
            } else if reported.ok.contains(&id.as_str()) {
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

/// The same kind of error for every entry of a failed call, each with the call's error
/// (shared) as its source.
fn clone_kind(e: &Arc<BrokerError>) -> BrokerError {
    let text = e.to_string();
    match e.as_ref() {
        BrokerError::Unroutable(_) => BrokerError::Unroutable(text),
        BrokerError::Connection { context, .. } => {
            BrokerError::connection(format!("{context} (batch call)")).caused_by(e.clone())
        }
        BrokerError::Timeout(d) => BrokerError::Timeout(*d),
        _ => BrokerError::rejected(text).caused_by(e.clone()),
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
                        Err(err) => return all_rejected(n, err),
                    }
                }
                match request.send().await {
                    Ok(out) => {
                        let ok = out.successful().iter().map(|s| s.id()).collect();
                        per_entry(
                            n,
                            "SendMessageBatch",
                            Ok(Reported {
                                ok,
                                failed: out.failed(),
                            }),
                        )
                    }
                    Err(e) => {
                        per_entry(n, "SendMessageBatch", Err(sdk_error("SendMessageBatch", e)))
                    }
                }
            })
        }),
    )
}

/// Every entry of a batch that could not even be built fails with the same error, kept
/// (shared) as each one's source.
fn all_rejected<E>(n: usize, err: E) -> Vec<Result<(), BrokerError>>
where
    E: std::error::Error + Send + Sync + 'static,
{
    let err = Arc::new(err);
    (0..n)
        .map(|_| Err(BrokerError::rejected(err.to_string()).caused_by(Arc::clone(&err))))
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
                        Err(err) => return all_rejected(n, err),
                    }
                }
                match request.send().await {
                    Ok(out) => {
                        let ok = out.successful().iter().map(|s| s.id()).collect();
                        per_entry(
                            n,
                            "DeleteMessageBatch",
                            Ok(Reported {
                                ok,
                                failed: out.failed(),
                            }),
                        )
                    }
                    Err(e) => per_entry(
                        n,
                        "DeleteMessageBatch",
                        Err(sdk_error("DeleteMessageBatch", e)),
                    ),
                }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_entry_is_accounted_for_never_assumed_sent() -> Result<(), Box<dyn std::error::Error>> {
        let failed = [BatchResultErrorEntry::builder()
            .id("1")
            .code("InvalidParameterValue")
            .message("too big")
            .sender_fault(true)
            .build()?];
        // Entry 0 succeeded, 1 failed, 2 is missing from the response.
        let results = per_entry(
            3,
            "SendMessageBatch",
            Ok(Reported {
                ok: vec!["0"],
                failed: &failed,
            }),
        );
        assert!(results[0].is_ok());
        let text = |r: &Result<(), BrokerError>| r.as_ref().err().map(ToString::to_string);
        assert!(text(&results[1]).is_some_and(|t| t.contains("InvalidParameterValue")));
        assert!(text(&results[2]).is_some_and(|t| t.contains("result for a batch entry")));
        // A failed call fails every entry with the same kind of error.
        let results = per_entry(
            2,
            "DeleteMessageBatch",
            Err(BrokerError::connection("reset")),
        );
        assert!(
            results
                .iter()
                .all(|r| matches!(r, Err(BrokerError::Connection { context, .. }) if context.contains("reset")))
        );
        Ok(())
    }
}
