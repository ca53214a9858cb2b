//! Reading a consumer's dead-letter queue without consuming it: [`SqsDeadLetters`].

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use async_trait::async_trait;
use aws_sdk_sqs::types::{
    ChangeMessageVisibilityBatchRequestEntry, MessageSystemAttributeName, QueueAttributeName,
};
use reliq_core::{
    BrokerError, Cursor, DeadLetter, DeadLetterCount, DeadLetterEntry, DeadLetterPage,
    DeadLetterReason, DeadLetters, MessageId, Origin, Subscription, seam::CopyIndex,
};
use tokio_util::sync::CancellationToken;

use crate::client::whole_seconds;
use crate::error::sdk_error;
use crate::receiver::system_attributes;
use crate::{client::SqsBroker, codec};

/// How long a scan that saw fewer entries than SQS counts keeps trying again (another
/// scan may hold the rest for a moment).
const SETTLE: Duration = Duration::from_secs(2);

/// A consumer's SQS dead-letter queue, read without consuming it (what
/// [`Broker::dead_letters`](reliq_core::Broker::dead_letters) returns).
///
/// SQS has no non-destructive read: a message is found only by receiving it, a receive
/// hides it for a visibility timeout and adds one to its `ApproximateReceiveCount`, and a
/// standard queue keeps no order. Every operation here is therefore one **scan**:
///
/// 1. receive the whole DLQ (10 at a time, long polls of 1 s, so an empty answer means
///    empty and not "this server sample had none") under a short **scan lease**
///    (`VisibilityTimeout` = [`SqsOptions::dead_letter_lease`]): what a scan received
///    stays hidden from *its own* later receives, so it sees each message once, without
///    sampling the same few again;
/// 2. pick what the call needs (a page, one id, the ids to remove, the oldest time);
/// 3. delete the entries being removed with their fresh receipt handles while the lease
///    still hides them (`DeleteMessageBatch`, each entry confirmed), and make everything
///    else visible again at once (`ChangeMessageVisibilityBatch` to 0) **before the call
///    returns** — so between calls nothing is hidden, and a concurrent replay, another
///    operator or the next page sees the whole DLQ.
///
/// Cancel safety: each operation runs in a task of its own, one after the other in call
/// order. A call cancelled (or timed out) does not cut its scan off mid-request — a
/// `ReceiveMessage` already in flight has hidden its messages though no answer came back,
/// and only its task can give them back: the task stops receiving, gives back what it
/// holds (a `remove` then deletes nothing), and only then does the next call scan; an
/// operation whose caller left before its turn is skipped. Reading again from the same
/// cursor therefore reads the same entries. If the process dies mid-scan, what it held
/// shows again when the scan lease runs out.
///
/// Pages are cut from the scan in a total order — the entry's `reliq-dead-lettered-at`,
/// then its SQS message id — and the cursor is the last entry's (time, SQS id): tiny,
/// stable across calls, unaffected by removals between pages (the replay engine removes
/// what it replayed before reading on), oldest first. Each page costs a full scan (about
/// `n/10` receives and `n/10` visibility changes for `n` entries); a scan reads at most
/// [`SqsOptions::dead_letter_scan_max`] entries, and a DLQ holding more shows only those
/// (logged).
///
/// What SQS does not allow, and what reliq does about it:
///
/// - **Receive counts.** Every scan adds one to each entry's `ApproximateReceiveCount`.
///   That count means nothing here: the DLQ has no redrive policy of its own, and a dead
///   letter's attempts are in reliq's record (`reliq-attempt`, the dead-letter record),
///   which a scan never changes. A browse is no delivery attempt.
/// - **Concurrent scans.** While a scan runs (seconds), what it holds is hidden from
///   another scan. A scan that ends with fewer entries than `ApproximateNumberOfMessages +
///   NotVisible` promised gives everything back and scans again after a random pause, for
///   up to 2 s, so one of two colliding scans goes first; beyond that, scans that keep
///   colliding can each miss entries the other holds (never lose them), and a short scan
///   (a stale approximate count, a FIFO group past its first 10) costs those 2 s.
/// - **FIFO DLQs.** SQS hands out at most 10 messages of a message group at a time and
///   then holds the whole group until they are settled: a scan sees at most the first 10
///   entries of each group (reliq's own dead letters are grouped by message key; the
///   redrive policy moves messages with their group). The rest show once those are
///   removed (replay, purge); a scan that sees fewer entries than SQS counts says so in
///   the log.
/// - **No record.** A message the redrive policy moved (a crash loop: received
///   `maxReceiveCount` times, never settled) carries no reliq record: it is read as
///   `max-deliveries` with `attempts` = the delivery limit, and as dead-lettered-at its
///   `SentTimestamp` in the DLQ (SQS records no time of the move; on a standard queue it
///   is the original send, so the entry looks at most as old as the message is).
/// - **Copies of one dead letter** (a DLQ copy sent again after a lost answer, a message
///   parked again after a crash, a standard queue's own duplicate) are one entry: a page
///   shows a dead letter at its oldest copy, `remove` deletes every copy the scan holds.
/// - **Counts.** `count` scans up to [`SqsOptions::dead_letter_count_scan_max`] entries:
///   a scan that sees the whole DLQ counts its dead letters, copies folded; beyond the
///   limit it is `ApproximateNumberOfMessages + ApproximateNumberOfMessagesNotVisible` —
///   approximate, as SQS says, copies included — and the oldest dead-lettered-at is the
///   oldest of those read.
///
/// [`SqsOptions::dead_letter_lease`]: crate::options::SqsOptions::dead_letter_lease
/// [`SqsOptions::dead_letter_scan_max`]: crate::options::SqsOptions::dead_letter_scan_max
/// [`SqsOptions::dead_letter_count_scan_max`]: crate::options::SqsOptions::dead_letter_count_scan_max
pub struct SqsDeadLetters {
    reader: Arc<Reader>,
}

impl std::fmt::Debug for SqsDeadLetters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqsDeadLetters").finish_non_exhaustive()
    }
}

/// What a scan needs; each operation runs in a task of its own with a clone of it.
struct Reader {
    broker: SqsBroker,
    sub: Subscription,
    url: String,
    /// One operation at a time, in call order, each in a task that holds its turn to the
    /// end: an operation whose caller stopped waiting (a cancelled call) finishes — a
    /// receive in flight when the caller gave up still has its messages given back —
    /// before the next one scans, so that one does not miss what it still hides.
    serial: Arc<tokio::sync::Mutex<()>>,
}

/// Where an entry is in the order pages are cut in: its dead-lettered-at (ms since the
/// epoch), then its SQS message id (unique per DLQ entry, unlike the reliq id: a message
/// dead-lettered again after a replay is a second entry).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Key {
    at_ms: u64,
    sqs_id: String,
}

impl Key {
    fn cursor(&self) -> Cursor {
        Cursor::from(format!("{}.{}", self.at_ms, self.sqs_id))
    }

    fn parse(cursor: &Cursor) -> Result<Option<Self>, BrokerError> {
        let Some(text) = cursor.as_str() else {
            return Ok(None);
        };
        text.split_once('.')
            .and_then(|(at, id)| {
                Some(Self {
                    at_ms: at.parse().ok()?,
                    sqs_id: id.to_owned(),
                })
            })
            .map(Some)
            .ok_or_else(|| BrokerError::Config {
                field: "cursor".into(),
                reason: format!(
                    "`{text}` is not an SQS dead-letter cursor (`<dead-lettered-at ms>.<SQS message id>`)"
                ),
            })
    }
}

/// One DLQ message a scan received.
struct Scanned {
    key: Key,
    entry: DeadLetterEntry,
    /// From the scan's latest receive of it (only the latest deletes for sure).
    receipt: String,
}

/// What one scan received, hidden under its lease until [`Scan::give_back`] (or, if the
/// call is cancelled, until the task its drop spawns has run).
struct Scan {
    broker: SqsBroker,
    url: String,
    /// By SQS message id: a standard queue may hand one message out twice.
    held: HashMap<String, Scanned>,
}

impl Scan {
    /// Everything held, oldest first.
    fn sorted(&self) -> Vec<&Scanned> {
        let mut all: Vec<&Scanned> = self.held.values().collect();
        all.sort_by(|a, b| a.key.cmp(&b.key));
        all
    }

    /// Which entries held are copies of one dead letter.
    fn copies(&self) -> CopyIndex<Key> {
        self.held
            .values()
            .map(|s| (s.key.clone(), &s.entry.message))
            .collect()
    }

    /// Each dead letter held once (its oldest copy), oldest first.
    fn shown(&self) -> Vec<&Scanned> {
        let copies = self.copies();
        let mut shown = self.sorted();
        shown.retain(|s| copies.shows(s.entry.id(), &s.key, |_, _| true));
        shown
    }

    /// Make everything still held visible again, now.
    async fn give_back(mut self) {
        let receipts = self.held.drain().map(|(_, s)| s.receipt).collect();
        make_visible(&self.broker, &self.url, receipts).await;
    }
}

impl Drop for Scan {
    fn drop(&mut self) {
        if self.held.is_empty() {
            return;
        }
        // Only if an operation panicked: give back from a task (else the lease runs out).
        let receipts: Vec<String> = self.held.drain().map(|(_, s)| s.receipt).collect();
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let (broker, url) = (self.broker.clone(), self.url.clone());
            runtime.spawn(async move { make_visible(&broker, &url, receipts).await });
        }
    }
}

/// `ChangeMessageVisibilityBatch` to 0 for `receipts` (10 per call). A failure is only
/// logged: that message becomes visible when the scan lease runs out.
async fn make_visible(broker: &SqsBroker, url: &str, receipts: Vec<String>) {
    let calls = receipts.chunks(10).map(|chunk| async move {
        let mut request = broker
            .inner
            .client
            .change_message_visibility_batch()
            .queue_url(url);
        for (i, receipt) in chunk.iter().enumerate() {
            let entry = ChangeMessageVisibilityBatchRequestEntry::builder()
                .id(i.to_string())
                .receipt_handle(receipt)
                .visibility_timeout(0)
                .build();
            match entry {
                Ok(entry) => request = request.entries(entry),
                Err(e) => tracing::warn!(error = %e, "cannot build a visibility change"),
            }
        }
        match request.send().await {
            Ok(out) if out.failed().is_empty() => {}
            Ok(out) => {
                for f in out.failed() {
                    tracing::warn!(code = f.code(), message = f.message().unwrap_or_default(),
                        "a scanned dead letter stays hidden until the scan lease runs out");
                }
            }
            Err(e) => {
                let e = sdk_error("ChangeMessageVisibilityBatch", e);
                tracing::warn!(error = %e, "scanned dead letters stay hidden until the scan lease runs out");
            }
        }
    });
    futures::future::join_all(calls).await;
}

impl SqsDeadLetters {
    pub(crate) fn new(broker: SqsBroker, sub: Subscription, url: String) -> Self {
        Self {
            reader: Arc::new(Reader {
                broker,
                sub,
                url,
                serial: Arc::default(),
            }),
        }
    }

    /// Run `op` in a task of its own, after the operations called before it. Cancel
    /// safety: if this call is dropped, the task still runs — an operation not started
    /// yet is skipped, one scanning stops receiving — and gives back what its scan holds.
    async fn run<T, F, Fut>(&self, op: F) -> Result<T, BrokerError>
    where
        T: Send + 'static,
        F: FnOnce(Arc<Reader>, CancellationToken) -> Fut,
        Fut: std::future::Future<Output = Result<T, BrokerError>> + Send + 'static,
    {
        let gone = CancellationToken::new();
        let work = op(self.reader.clone(), gone.clone());
        let serial = self.reader.serial.clone();
        let (tx, rx) = tokio::sync::oneshot::channel();
        let skip = gone.clone();
        tokio::spawn(async move {
            let _turn = serial.lock_owned().await;
            if !skip.is_cancelled() {
                let _ = tx.send(work.await);
            }
        });
        let _on_drop = gone.drop_guard();
        rx.await.map_err(|e| {
            BrokerError::connection("a dead-letter scan task stopped without an answer")
                .caused_by(e)
        })?
    }
}

impl Reader {
    /// `ApproximateNumberOfMessages + ApproximateNumberOfMessagesNotVisible`.
    async fn approximate_count(&self) -> Result<u64, BrokerError> {
        let out = self
            .broker
            .inner
            .client
            .get_queue_attributes()
            .queue_url(&self.url)
            .attribute_names(QueueAttributeName::ApproximateNumberOfMessages)
            .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesNotVisible)
            .send()
            .await
            .map_err(|e| sdk_error("GetQueueAttributes", e))?;
        let get = |name: &QueueAttributeName| {
            out.attributes()
                .and_then(|a| a.get(name))
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0)
        };
        Ok(get(&QueueAttributeName::ApproximateNumberOfMessages)
            + get(&QueueAttributeName::ApproximateNumberOfMessagesNotVisible))
    }

    /// Receive the DLQ (at most `limit` entries) under the scan lease; `expected` is what
    /// SQS counted before. A scan that sees fewer gives everything back and tries again
    /// after a random pause, for at most [`SETTLE`]: two scans at the same moment each
    /// hold part of the DLQ, and this lets one of them go first.
    async fn scan(
        &self,
        limit: usize,
        expected: u64,
        gone: &CancellationToken,
    ) -> Result<Scan, BrokerError> {
        let mut scan = Scan {
            broker: self.broker.clone(),
            url: self.url.clone(),
            held: HashMap::new(),
        };
        // Received entries stay held (hidden) while the scan goes on receiving: an empty
        // answer before SQS's count is reached is a slow or sampled receive (moto under
        // load answers a long poll empty while it works) or entries another scan holds
        // for a moment. The window restarts whenever the scan grows.
        let mut deadline = Instant::now() + SETTLE;
        loop {
            let before = scan.held.len();
            if let Err(e) = self.fill(&mut scan, limit, gone).await {
                scan.give_back().await;
                return Err(e);
            }
            let seen = scan.held.len();
            if seen as u64 >= expected || seen >= limit || gone.is_cancelled() {
                if expected > limit as u64 {
                    tracing::warn!(limit, counted = expected, queue = %self.url,
                        "the DLQ holds more entries than one scan reads (SqsOptions::dead_letter_scan_max, dead_letter_count_scan_max): only the first received are used");
                }
                return Ok(scan);
            }
            if seen > before {
                deadline = Instant::now() + SETTLE;
            } else if Instant::now() >= deadline {
                tracing::info!(seen, counted = expected, queue = %self.url,
                    "a dead-letter scan saw fewer entries than SQS counts (approximate; held by another scan, or beyond the first 10 of a FIFO message group)");
                return Ok(scan);
            }
            let jitter = u64::try_from(crate::receiver::unique_suffix() % 350).unwrap_or(0);
            tokio::time::sleep(Duration::from_millis(50 + jitter)).await;
        }
    }

    /// Receive into `scan` until an empty answer (or `limit` entries), under the scan
    /// lease. On an error `scan` keeps what it holds (the caller gives it back).
    async fn fill(
        &self,
        scan: &mut Scan,
        limit: usize,
        gone: &CancellationToken,
    ) -> Result<(), BrokerError> {
        let options = &self.broker.inner.options;
        let lease = whole_seconds(options.dead_letter_lease).max(1);
        // A cancelled caller needs no more: stop, and give back what is held.
        while scan.held.len() < limit && !gone.is_cancelled() {
            let want = (limit - scan.held.len()).min(10);
            let out = self
                .broker
                .inner
                .client
                .receive_message()
                .queue_url(&self.url)
                .max_number_of_messages(i32::try_from(want).unwrap_or(10))
                // A long poll: an empty answer means empty, not "none on the servers
                // this short poll sampled".
                .wait_time_seconds(1)
                .visibility_timeout(lease)
                .message_attribute_names("All")
                .message_system_attribute_names(MessageSystemAttributeName::SentTimestamp)
                .message_system_attribute_names(MessageSystemAttributeName::MessageGroupId)
                .send()
                .await;
            let out = out.map_err(|e| sdk_error("ReceiveMessage", e))?;
            let messages = out.messages();
            if messages.is_empty() {
                break;
            }
            let mut new = 0;
            for m in messages {
                let Some(s) = self.convert(m) else { continue };
                match scan.held.get_mut(&s.key.sqs_id) {
                    // Handed out twice (standard queues): keep the newest receipt.
                    Some(known) => known.receipt = s.receipt,
                    None => {
                        scan.held.insert(s.key.sqs_id.clone(), s);
                        new += 1;
                    }
                }
            }
            if new == 0 {
                // Only what this scan holds came back: the scan outlasted its lease.
                tracing::warn!(lease = ?options.dead_letter_lease, seen = scan.held.len(),
                    "a dead-letter scan outlasted its lease; raise SqsOptions::dead_letter_lease");
                break;
            }
        }
        Ok(())
    }

    /// A full scan for browse, get and remove.
    async fn scan_all(&self, gone: &CancellationToken) -> Result<Scan, BrokerError> {
        let expected = self.approximate_count().await?;
        self.scan(
            self.broker.inner.options.dead_letter_scan_max,
            expected,
            gone,
        )
        .await
    }

    fn convert(&self, m: &aws_sdk_sqs::types::Message) -> Option<Scanned> {
        let receipt = m.receipt_handle()?.to_owned();
        let sqs_id = m.message_id()?.to_owned();
        let (_, sent) = system_attributes(m);
        let decoded = codec::decode(m.body(), m.message_attributes(), &sqs_id);
        let mut message = decoded.message;
        let record = match DeadLetter::read(message.headers()) {
            Ok(record) => Some(record),
            Err(_)
                if message
                    .headers()
                    .get(reliq_core::seam::headers::DEAD_LETTER_VERSION)
                    .is_none() =>
            {
                // Moved by the redrive policy (a crash loop): no record of reliq's.
                let record = DeadLetter {
                    reason: DeadLetterReason::MaxDeliveries,
                    error_class: None,
                    error: None,
                    attempts: self.sub.delivery_limit,
                    first_failure_at: None,
                    dead_lettered_at: sent.unwrap_or(SystemTime::UNIX_EPOCH),
                    consumer: self.sub.consumer.clone(),
                    origin: Origin {
                        destination: self.sub.source.as_str().into(),
                        route: decoded.route,
                        ..Origin::default()
                    },
                };
                record.write(message.headers_mut());
                Some(record)
            }
            // A record reliq cannot read: shown as it is, ordered by its send time.
            Err(_) => None,
        };
        let at = record.map_or(sent.unwrap_or(SystemTime::UNIX_EPOCH), |r| {
            r.dead_lettered_at
        });
        let at_ms = at
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        let group = m
            .attributes()
            .and_then(|a| a.get(&MessageSystemAttributeName::MessageGroupId));
        let position = match group {
            Some(g) => format!("SQS message {sqs_id} (group {g})"),
            None => format!("SQS message {sqs_id}"),
        };
        Some(Scanned {
            key: Key { at_ms, sqs_id },
            entry: DeadLetterEntry { message, position },
            receipt,
        })
    }
}

/// The entries of `scan` after `after`, at most `max`, oldest first; the last one's key;
/// whether none is left after them.
fn page_of(
    scan: &Scan,
    after: Option<&Key>,
    max: usize,
) -> (Vec<DeadLetterEntry>, Option<Key>, bool) {
    let rest: Vec<&Scanned> = scan
        .shown()
        .into_iter()
        .filter(|s| after.is_none_or(|a| &s.key > a))
        .collect();
    let page = &rest[..rest.len().min(max)];
    (
        page.iter().map(|s| s.entry.clone()).collect(),
        page.last().map(|s| s.key.clone()),
        page.len() == rest.len(),
    )
}

impl Reader {
    async fn browse(
        &self,
        after: Option<Key>,
        from: Cursor,
        max: usize,
        gone: CancellationToken,
    ) -> Result<DeadLetterPage, BrokerError> {
        let scan = self.scan_all(&gone).await?;
        let (entries, last, at_end) = page_of(&scan, after.as_ref(), max);
        scan.give_back().await;
        Ok(DeadLetterPage {
            entries,
            next: last.map_or(from, |k| k.cursor()),
            at_end,
        })
    }

    async fn get(
        &self,
        id: MessageId,
        gone: CancellationToken,
    ) -> Result<Option<DeadLetterEntry>, BrokerError> {
        let scan = self.scan_all(&gone).await?;
        let found = scan
            .shown()
            .into_iter()
            .find(|s| s.entry.id() == &id)
            .map(|s| s.entry.clone());
        scan.give_back().await;
        Ok(found)
    }

    async fn remove(
        &self,
        ids: Vec<MessageId>,
        gone: CancellationToken,
    ) -> Result<Vec<MessageId>, BrokerError> {
        let mut scan = self.scan_all(&gone).await?;
        if gone.is_cancelled() {
            // The caller gave up mid-scan (maybe before seeing every id): delete nothing.
            scan.give_back().await;
            return Ok(Vec::new());
        }
        // Each dead letter with every copy of it the scan holds.
        let picked = scan.copies().pick(&ids, |_, _| true);
        let chosen: Vec<(String, String, MessageId)> = picked
            .iter()
            .flat_map(|p| p.copies.iter().map(|key| (key, &p.id)))
            .filter_map(|(key, id)| {
                let held = scan.held.get(&key.sqs_id)?;
                Some((key.sqs_id.clone(), held.receipt.clone(), id.clone()))
            })
            .collect();
        // Deleted while this scan's lease still hides them, with the receipts of its
        // own receives: each entry's success is the broker's confirmation.
        let results = futures::future::join_all(
            chosen
                .iter()
                .map(|(_, receipt, _)| self.broker.delete(&self.url, receipt)),
        )
        .await;
        let mut failure = None;
        for ((sqs_id, _, id), result) in chosen.into_iter().zip(results) {
            match result {
                Ok(()) => {
                    scan.held.remove(&sqs_id);
                }
                Err(e) => {
                    tracing::warn!(message_id = %id, error = %e, "removing a dead letter failed; it stays in the DLQ");
                    failure.get_or_insert(e);
                }
            }
        }
        // A dead letter is removed once every copy of it is (the rest: call again).
        let removed = picked
            .into_iter()
            .filter(|p| p.copies.iter().all(|k| !scan.held.contains_key(&k.sqs_id)))
            .map(|p| p.id)
            .collect();
        scan.give_back().await;
        match failure {
            None => Ok(removed),
            Some(e) => Err(e),
        }
    }

    async fn count(&self, gone: CancellationToken) -> Result<DeadLetterCount, BrokerError> {
        let counted = self.approximate_count().await?;
        if counted == 0 {
            return Ok(DeadLetterCount::default());
        }
        let scan = self
            .scan(
                self.broker.inner.options.dead_letter_count_scan_max,
                counted,
                &gone,
            )
            .await?;
        let seen = scan.held.len() as u64;
        let mut count = scan.copies().count(|_, _| true);
        // A scan that saw the whole DLQ counts dead letters, copies folded; one cut short
        // by the count-scan limit gives SQS's approximate depth, copies included.
        if seen < counted {
            count.count = counted;
        }
        scan.give_back().await;
        Ok(count)
    }
}

#[async_trait]
impl DeadLetters for SqsDeadLetters {
    async fn browse(&self, from: &Cursor, max: usize) -> Result<DeadLetterPage, BrokerError> {
        let after = Key::parse(from)?;
        let from = from.clone();
        self.run(move |r, gone| async move { r.browse(after, from, max, gone).await })
            .await
    }

    async fn get(&self, id: &MessageId) -> Result<Option<DeadLetterEntry>, BrokerError> {
        let id = id.clone();
        self.run(move |r, gone| async move { r.get(id, gone).await })
            .await
    }

    async fn remove(&self, ids: &[MessageId]) -> Result<Vec<MessageId>, BrokerError> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let ids = ids.to_vec();
        self.run(move |r, gone| async move { r.remove(ids, gone).await })
            .await
    }

    async fn count(&self) -> Result<DeadLetterCount, BrokerError> {
        self.run(|r, gone| async move { r.count(gone).await }).await
    }
}
