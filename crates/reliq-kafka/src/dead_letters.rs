//! The dead-letter reader: a consumer's DLQ topic read by offset, without a group, and
//! removals kept in a ledger topic, since Kafka cannot delete one record.
//!
//! - **browse** assigns the DLQ's partitions at the cursor's offsets to a consumer of
//!   the reader's own (group `<consumer>.dlq-browse`, never joined: no rebalance, no
//!   commit) and reads up to the
//!   high watermarks taken when the page starts. The cursor is each partition's next
//!   offset (`0:17,1:4,2:0`); a partition it does not name starts at its low watermark.
//! - **remove** produces one record per removed entry to the compacted ledger topic
//!   `<dlq>.removed` (key `<partition>:<offset>`, value the message id) with `acks=all`
//!   and returns after the broker confirmed every one. Browse, get and count read the
//!   ledger and skip what it names. Then every partition's prefix of removed entries is
//!   truncated with the admin DeleteRecords API, and only after the broker confirmed the
//!   new low watermark are the ledger's keys below it tombstoned (compaction drops them),
//!   so neither the DLQ nor the ledger grows with removals, and an entry is never shown
//!   again: until the truncation is confirmed its ledger record stays.
//! - **Copies of one dead letter count once.** A DLQ copy whose confirm was lost (a
//!   leader change, a DLQ outage) is produced again, and a consumer that crashed between
//!   the copy and its offset commit parks the record again: the topic then holds two
//!   records of one dead letter. Every call first brings an index of the DLQ up to the
//!   high watermarks ([`CopyIndex`]: every record from a partition's low watermark on,
//!   each read once per reader) — so a browse shows a dead letter at its oldest copy
//!   only, **count** counts dead letters (and takes the oldest time from the index), and
//!   **remove** records every copy of the dead letters it removes in the ledger. A
//!   gauge's long-lived reader reads only what was dead-lettered since its last count;
//!   the replay engine's browse-then-remove reads the DLQ once.
//!
//! The reader's caches (ledger, index) are copies of what the broker holds, brought up
//! to date at the start of every call, never a position: a cancelled call skips nothing.
//!
//! Limits, stated honestly: a ledger record hides an entry only if its id matches the
//! record at that position, so a DLQ topic deleted and created again is not hidden by
//! the old ledger. Two readers (processes) removing the same entry at the same time both
//! record it and both report it removed; the entry goes once.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use rdkafka::ClientContext;
use rdkafka::admin::AdminOptions;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::error::KafkaError as RdError;
use rdkafka::message::{BorrowedMessage, Message as _};
use rdkafka::producer::FutureRecord;
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::util::Timeout;
use reliq_core::{
    BrokerError, Cursor, DeadLetterCount, DeadLetterEntry, DeadLetterPage, DeadLetters, MessageId,
    Subscription,
    seam::{CopyIndex, lock},
};

use crate::client::Inner;
use crate::codec::decode;
use crate::error::{KafkaError, client_error, passes_with_an_election};
use crate::names::{browse_group, ledger_topic};
use crate::oauth::{SignIn, TokenSource};

/// Longest one read (a page, the ledger, the index) may take.
const READ_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest a metadata or watermark request may take.
const META_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest one poll blocks, so the deadline is checked.
const POLL: Duration = Duration::from_millis(100);

/// A record's place: (partition, offset).
type Position = (i32, i64);

/// A partition and its watermarks when a call started.
#[derive(Clone, Copy, Debug)]
struct Span {
    partition: i32,
    low: i64,
    high: i64,
}

/// What a scan's visitor wants after a record.
enum Next {
    /// The record is taken; read on in its partition.
    More,
    /// The record is taken; its partition is done.
    Done,
    /// The record is taken; the scan is done.
    Last,
}

/// One entry of the index: (timestamp ms, partition, offset) — ordered oldest first.
type Slot = (i64, i32, i64);

#[derive(Default)]
struct Index {
    /// Per DLQ partition: every record from the low watermark up to this offset is in
    /// `copies`.
    next: HashMap<i32, i64>,
    /// Every record read, by slot: which are copies of one dead letter.
    copies: CopyIndex<Slot>,
}

/// What the reader knows of the broker, brought up to date at the start of each call.
#[derive(Default)]
struct Cache {
    /// The ledger's removals: position → the id of the entry removed there.
    removed: HashMap<Position, MessageId>,
    /// Next ledger offset to read, per ledger partition.
    ledger_next: HashMap<i32, i64>,
    index: Index,
}

impl Cache {
    /// The entry at `at` with `id` was removed. A ledger record naming another id at this
    /// position is from an earlier topic of the same name (deleted and created again):
    /// it hides nothing.
    fn is_removed(&self, at: Position, id: &MessageId) -> bool {
        self.removed.get(&at) == Some(id)
    }

    /// The ledger removed the entry the index holds at `at` (the id checked as in
    /// [`Cache::is_removed`]): what may be truncated.
    fn removed_here(&self, at: Position) -> bool {
        self.removed.get(&at).is_some_and(|id| {
            self.index
                .copies
                .positions(id)
                .any(|(_, p, o)| (*p, *o) == at)
        })
    }

    /// The record with `id` at `slot` is still in the DLQ: inside the watermarks, not
    /// removed.
    fn live(&self, spans: &[Span], id: &MessageId, (_, p, o): Slot) -> bool {
        spans
            .iter()
            .any(|s| s.partition == p && (s.low..s.high).contains(&o))
            && !self.is_removed((p, o), id)
    }
}

/// The reader's consumer: assigned partitions only (its group is never joined).
type ReaderConsumer = BaseConsumer<ReaderContext>;

/// The reader consumer's context. A read ends by unassigning its partitions, and the
/// end-of-partition events librdkafka still had on the way then reach its error
/// callback, which by default logs each as an ERROR — one per DLQ partition on every
/// browse, on a reader that did nothing wrong. They are dropped here; every other error
/// is logged as before.
struct ReaderContext(TokenSource);

impl ClientContext for ReaderContext {
    crate::oauth::oauth_token_requests!(0);

    fn error(&self, error: RdError, reason: &str) {
        if matches!(error, RdError::Global(RDKafkaErrorCode::PartitionEOF)) {
            tracing::trace!(reason, "end of a DLQ partition after its read ended");
        } else {
            tracing::error!(error = %error, reason, "the Kafka dead-letter reader's client reports an error");
        }
    }
}

impl ConsumerContext for ReaderContext {}

struct Reader {
    consumer: ReaderConsumer,
    /// Its OAUTHBEARER token, renewed before each read (MSK IAM; see `oauth`).
    sign_in: SignIn,
    dlq: String,
    ledger: String,
    cache: Cache,
}

/// A consumer's dead letters on Kafka (see the module docs).
pub(crate) struct KafkaDeadLetters {
    inner: Arc<Inner>,
    reader: Arc<Mutex<Reader>>,
    /// Removals through this reader one at a time (each picks entries, then records
    /// them).
    removing: tokio::sync::Mutex<()>,
}

fn read_error(e: RdError, what: &str) -> BrokerError {
    BrokerError::connection(format!("reading {what}: {e}")).caused_by(e)
}

impl KafkaDeadLetters {
    /// The reader of `sub`'s DLQ and its ledger, which the consumer's subscribe created.
    /// Opening creates nothing (the metadata lookups never auto-create a topic): a
    /// missing topic is [`BrokerError::NotFound`].
    pub(crate) async fn open(inner: Arc<Inner>, sub: &Subscription) -> Result<Self, BrokerError> {
        let dlq = sub.dead_letter_name();
        let ledger = ledger_topic(&dlq);
        for topic in [&dlq, &ledger] {
            if !inner.topic_exists(topic).await? {
                return Err(sub.missing_dead_letters(format_args!("topic `{topic}`")));
            }
        }
        let consumer: ReaderConsumer = inner
            .config
            .reader(&browse_group(sub))
            .create_with_context(ReaderContext(inner.tokens.clone()))
            .map_err(|e| BrokerError::from(KafkaError::Client(e)))?;
        Ok(Self {
            inner,
            reader: Arc::new(Mutex::new(Reader {
                consumer,
                sign_in: SignIn::default(),
                dlq,
                ledger,
                cache: Cache::default(),
            })),
            removing: tokio::sync::Mutex::new(()),
        })
    }

    /// Run `f` on the reader, off the runtime (librdkafka's calls block).
    async fn with<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Reader) -> Result<T, BrokerError> + Send + 'static,
    ) -> Result<T, BrokerError> {
        let reader = self.reader.clone();
        let tokens = self.inner.tokens.clone();
        tokio::task::spawn_blocking(move || {
            let mut reader = lock(&reader);
            let reader = &mut *reader;
            tokens.renew(reader.consumer.client(), &mut reader.sign_in);
            f(reader)
        })
        .await
        .map_err(|e| BrokerError::Other(Box::new(e)))?
    }

    /// Produce `records` (key, value; `None` = tombstone) to the ledger and wait for
    /// every confirmation; the keys confirmed, and the first error.
    async fn produce_ledger(
        &self,
        ledger: &str,
        records: &[(String, Option<String>)],
    ) -> (Vec<String>, Option<BrokerError>) {
        let timeout = Timeout::After(self.inner.config.send_timeout);
        let sends = records.iter().map(|(key, value)| {
            let mut record = FutureRecord::<str, str>::to(ledger).key(key.as_str());
            if let Some(v) = value {
                record = record.payload(v.as_str());
            }
            self.inner.route_producer.send(record, timeout)
        });
        let results = futures::future::join_all(sends).await;
        let mut confirmed = Vec::new();
        let mut error = None;
        for ((key, _), r) in records.iter().zip(results) {
            match r {
                Ok(_) => confirmed.push(key.clone()),
                Err((e, _)) => {
                    error.get_or_insert_with(|| {
                        client_error(e, "recording dead-letter removals in", ledger)
                    });
                }
            }
        }
        (confirmed, error)
    }

    /// Truncate each partition's prefix of removed entries (DeleteRecords), then tombstone
    /// the ledger's keys below the confirmed new low watermarks. Failures are logged:
    /// the removals are durable in the ledger already, and the next removal tries again.
    async fn truncate(&self) -> Result<(), BrokerError> {
        let (dlq, ledger, cut) = self
            .with(|r| {
                let spans = partitions(&r.consumer, &r.dlq)?;
                let cut: Vec<(i32, i64)> = spans
                    .iter()
                    .filter_map(|s| {
                        let mut low = s.low;
                        while low < s.high && r.cache.removed_here((s.partition, low)) {
                            low += 1;
                        }
                        // Also when nothing moves: ledger keys below `low` may be left
                        // from a truncation whose tombstones did not go out.
                        let stale = r
                            .cache
                            .removed
                            .keys()
                            .any(|(p, o)| *p == s.partition && *o < low);
                        (low > s.low || stale).then_some((s.partition, low))
                    })
                    .collect();
                Ok((r.dlq.clone(), r.ledger.clone(), cut))
            })
            .await?;
        if cut.is_empty() {
            return Ok(());
        }
        let mut tpl = TopicPartitionList::new();
        for (p, low) in &cut {
            tpl.add_partition_offset(&dlq, *p, Offset::Offset(*low))
                .map_err(|e| {
                    BrokerError::rejected(format!("truncating {dlq}: {e}")).caused_by(e)
                })?;
        }
        let opts = AdminOptions::new().operation_timeout(Some(META_TIMEOUT));
        let truncated: Vec<(i32, i64)> = match self.inner.admin.delete_records(&tpl, &opts).await {
            Ok(result) => result
                .elements()
                .iter()
                .filter_map(|e| match (e.error(), e.offset()) {
                    (Ok(()), Offset::Offset(low)) => Some((e.partition(), low)),
                    (Err(err), _) => {
                        tracing::warn!(topic = %dlq, partition = e.partition(), error = %err,
                            "truncating removed dead letters failed; they stay hidden by the ledger");
                        None
                    }
                    _ => None,
                })
                .collect(),
            Err(e) => {
                tracing::warn!(topic = %dlq, error = %e,
                    "truncating removed dead letters failed; they stay hidden by the ledger");
                return Ok(());
            }
        };
        let below = move |r: &mut Reader| -> Vec<(String, Option<String>)> {
            // The index forgets what is gone.
            r.cache
                .index
                .copies
                .retain(|(_, p, o)| !truncated.iter().any(|(tp, low)| tp == p && o < low));
            r.cache
                .removed
                .keys()
                .filter(|(p, o)| truncated.iter().any(|(tp, low)| tp == p && o < low))
                .map(|(p, o)| (format!("{p}:{o}"), None))
                .collect()
        };
        let tombstones = self.with(move |r| Ok(below(r))).await?;
        let (confirmed, error) = self.produce_ledger(&ledger, &tombstones).await;
        self.with(move |r| {
            for key in &confirmed {
                if let Some(at) = parse_key(key) {
                    r.cache.removed.remove(&at);
                }
            }
            Ok(())
        })
        .await?;
        if let Some(e) = error {
            tracing::warn!(topic = %ledger, error = %e,
                "tombstoning truncated ledger keys failed; the next removal tries again");
        }
        Ok(())
    }
}

/// `topic`'s partitions and their watermarks.
fn partitions(consumer: &ReaderConsumer, topic: &str) -> Result<Vec<Span>, BrokerError> {
    let metadata = consumer
        .fetch_metadata(Some(topic), META_TIMEOUT)
        .map_err(|e| read_error(e, &format!("the metadata of {topic}")))?;
    let Some(t) = metadata
        .topics()
        .iter()
        .find(|t| t.name() == topic && t.error().is_none() && !t.partitions().is_empty())
    else {
        return Err(BrokerError::Unroutable(topic.to_owned()));
    };
    let mut spans = Vec::with_capacity(t.partitions().len());
    for p in t.partitions() {
        let (low, high) = watermarks(consumer, topic, p.id())?;
        spans.push(Span {
            partition: p.id(),
            low,
            high,
        });
    }
    spans.sort_by_key(|s| s.partition);
    Ok(spans)
}

/// A partition's watermarks. A topic created a moment ago (the DLQ or its ledger, made
/// by this reader's `open`) is in the metadata before its partitions have a leader, and
/// the broker then answers "not leader" or "leader not available"; a node lost in a
/// cluster fails requests until a new leader is elected: asked again until
/// `META_TIMEOUT` has passed, on this blocking thread.
fn watermarks(
    consumer: &ReaderConsumer,
    topic: &str,
    partition: i32,
) -> Result<(i64, i64), BrokerError> {
    let deadline = std::time::Instant::now() + META_TIMEOUT;
    loop {
        match consumer.fetch_watermarks(topic, partition, META_TIMEOUT) {
            Ok(marks) => return Ok(marks),
            Err(e) if std::time::Instant::now() < deadline && passes_with_an_election(&e) => {
                tracing::debug!(error = %e, topic, partition, "reading watermarks again");
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => {
                return Err(read_error(
                    e,
                    &format!("the watermarks of {topic} [{partition}]"),
                ));
            }
        }
    }
}

/// Read `topic`'s partitions over `ranges` (partition, first offset, end offset
/// exclusive), handing each record to `visit`; each partition's next position after the
/// scan (its first offset if nothing was taken, its end if it was read to the end).
fn scan(
    consumer: &ReaderConsumer,
    topic: &str,
    ranges: &[(i32, i64, i64)],
    mut visit: impl FnMut(&BorrowedMessage<'_>) -> Next,
) -> Result<HashMap<i32, i64>, BrokerError> {
    let mut pos: HashMap<i32, i64> = ranges.iter().map(|(p, start, _)| (*p, *start)).collect();
    let mut open: HashMap<i32, i64> = ranges
        .iter()
        .filter(|(_, start, end)| start < end)
        .map(|(p, _, end)| (*p, *end))
        .collect();
    if open.is_empty() {
        return Ok(pos);
    }
    let mut tpl = TopicPartitionList::new();
    for (p, start, end) in ranges {
        if start < end {
            tpl.add_partition_offset(topic, *p, Offset::Offset(*start))
                .map_err(|e| read_error(e, topic))?;
        }
    }
    consumer.assign(&tpl).map_err(|e| read_error(e, topic))?;
    let deadline = Instant::now() + READ_TIMEOUT;
    let result = loop {
        if open.is_empty() {
            break Ok(());
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break Err(BrokerError::Timeout(READ_TIMEOUT));
        }
        let m = match consumer.poll(left.min(POLL)) {
            None => continue,
            // Everything up to the log end was read (and the end is past `end`).
            Some(Err(RdError::PartitionEOF(p))) => {
                if let Some(end) = open.remove(&p) {
                    pos.insert(p, end);
                }
                continue;
            }
            // librdkafka reconnects and follows a new leader by itself: a lost node is
            // reported here, then the reads go on (bounded by READ_TIMEOUT).
            Some(Err(e)) if passes_with_an_election(&e) => {
                tracing::debug!(error = %e, topic, "reading the DLQ through a broker failure");
                continue;
            }
            Some(Err(e)) => break Err(read_error(e, topic)),
            Some(Ok(m)) => m,
        };
        let (p, offset) = (m.partition(), m.offset());
        let (Some(&end), Some(&at)) = (open.get(&p), pos.get(&p)) else {
            continue;
        };
        if m.topic() != topic || offset < at {
            continue;
        }
        if offset >= end {
            // Nothing left below the end (a gap up to it).
            open.remove(&p);
            pos.insert(p, end);
            continue;
        }
        pos.insert(p, offset + 1);
        match visit(&m) {
            Next::Last => break Ok(()),
            Next::Done => {
                open.remove(&p);
            }
            Next::More if offset + 1 >= end => {
                open.remove(&p);
            }
            Next::More => {}
        }
    };
    if let Err(e) = consumer.unassign() {
        tracing::debug!(error = %e, "unassigning the dead-letter reader failed");
    }
    result.map(|()| pos)
}

fn parse_key(key: &str) -> Option<Position> {
    let (p, o) = key.split_once(':')?;
    Some((p.parse().ok()?, o.parse().ok()?))
}

/// A cursor's per-partition offsets (`0:17,1:4`); the start is empty.
fn parse_cursor(cursor: &Cursor) -> Result<BTreeMap<i32, i64>, BrokerError> {
    let Some(text) = cursor.as_str() else {
        return Ok(BTreeMap::new());
    };
    text.split(',')
        .map(|part| {
            parse_key(part).ok_or_else(|| BrokerError::Config {
                field: "cursor".into(),
                reason: format!("`{text}` is not a Kafka dead-letter cursor (partition:offset,…)"),
            })
        })
        .collect()
}

fn timestamp(m: &BorrowedMessage<'_>) -> i64 {
    m.timestamp().to_millis().unwrap_or(0)
}

impl Reader {
    /// Read the ledger from where this reader left it.
    fn sync_ledger(&mut self) -> Result<(), BrokerError> {
        let spans = partitions(&self.consumer, &self.ledger)?;
        let ranges: Vec<(i32, i64, i64)> = spans
            .iter()
            .map(|s| {
                let next = self.cache.ledger_next.get(&s.partition).copied();
                (s.partition, next.unwrap_or(s.low).max(s.low), s.high)
            })
            .collect();
        let removed = &mut self.cache.removed;
        let pos = scan(&self.consumer, &self.ledger, &ranges, |m| {
            let at = m
                .key()
                .and_then(|k| std::str::from_utf8(k).ok())
                .and_then(parse_key);
            match (at, m.payload()) {
                (Some(at), Some(id)) => {
                    removed.insert(at, MessageId::from(&*String::from_utf8_lossy(id)));
                }
                (Some(at), None) => {
                    removed.remove(&at);
                }
                (None, _) => {
                    tracing::warn!(topic = %m.topic(), offset = m.offset(), "a ledger record without a position key; ignored")
                }
            }
            Next::More
        })?;
        self.cache.ledger_next.extend(pos);
        Ok(())
    }

    /// The ledger read, and the DLQ's partitions with their watermarks.
    fn refresh(&mut self) -> Result<Vec<Span>, BrokerError> {
        self.sync_ledger()?;
        let spans = partitions(&self.consumer, &self.dlq)?;
        for s in &spans {
            // Truncated below the index (by a removal or the retention): nothing there.
            let next = self.cache.index.next.entry(s.partition).or_insert(s.low);
            *next = (*next).max(s.low);
        }
        Ok(spans)
    }

    /// Index every record up to the high watermarks.
    fn extend_index(&mut self, spans: &[Span]) -> Result<(), BrokerError> {
        let ranges: Vec<(i32, i64, i64)> = spans
            .iter()
            .map(|s| (s.partition, self.cache.index.next[&s.partition], s.high))
            .collect();
        let (dlq, index) = (&self.dlq, &mut self.cache.index);
        let pos = scan(&self.consumer, dlq, &ranges, |m| {
            let message = decode(m, dlq).message;
            index
                .copies
                .add((timestamp(m), m.partition(), m.offset()), &message);
            Next::More
        })?;
        self.cache.index.next.extend(pos);
        Ok(())
    }

    /// A page: up to `max` live entries of each partition from the cursor are read, then
    /// merged oldest first (record timestamp, then partition and offset), so the same
    /// cursor always gives the same page, whatever order librdkafka fetched in. The index
    /// is brought up to the high watermarks first, so a later copy of a dead letter is
    /// known as one wherever its first copy is (an earlier page, another partition).
    fn browse(
        &mut self,
        from: &BTreeMap<i32, i64>,
        max: usize,
    ) -> Result<DeadLetterPage, BrokerError> {
        let spans = self.refresh()?;
        self.extend_index(&spans)?;
        let ranges: Vec<(i32, i64, i64)> = spans
            .iter()
            .map(|s| {
                let start = from.get(&s.partition).copied().unwrap_or(s.low).max(s.low);
                (s.partition, start, s.high)
            })
            .collect();
        // Per partition, in offset order: the live entries read, with their timestamps.
        let mut read: HashMap<i32, VecDeque<(i64, i64, DeadLetterEntry)>> = HashMap::new();
        let Self {
            consumer,
            dlq,
            cache,
            ..
        } = self;
        let mut pos = if max == 0 {
            ranges.iter().map(|(p, start, _)| (*p, *start)).collect()
        } else {
            scan(consumer, dlq, &ranges, |m| {
                let (p, o, ts) = (m.partition(), m.offset(), timestamp(m));
                let message = decode(m, dlq).message;
                let id = message.id();
                if !cache.live(&spans, id, (ts, p, o))
                    || !cache
                        .index
                        .copies
                        .shows(id, &(ts, p, o), |id, slot| cache.live(&spans, id, *slot))
                {
                    return Next::More;
                }
                let live = read.entry(p).or_default();
                live.push_back((
                    ts,
                    o,
                    DeadLetterEntry {
                        message,
                        position: format!("partition {p} offset {o}"),
                    },
                ));
                if live.len() >= max {
                    Next::Done
                } else {
                    Next::More
                }
            })?
        };
        let mut entries = Vec::new();
        while entries.len() < max {
            let oldest = read
                .iter()
                .filter_map(|(p, live)| live.front().map(|(ts, o, _)| (*ts, *p, *o)))
                .min();
            let Some((_, p, _)) = oldest else { break };
            if let Some((_, _, entry)) = read.get_mut(&p).and_then(VecDeque::pop_front) {
                entries.push(entry);
            }
        }
        // A partition with live entries read but not taken resumes at the first of them.
        for (p, live) in &read {
            if let Some((_, o, _)) = live.front() {
                pos.insert(*p, *o);
            }
        }
        let next: Vec<String> = spans
            .iter()
            .map(|s| {
                let at = pos.get(&s.partition).copied().unwrap_or(s.low);
                format!("{}:{at}", s.partition)
            })
            .collect();
        let at_end = spans
            .iter()
            .all(|s| pos.get(&s.partition).is_some_and(|at| *at >= s.high));
        Ok(DeadLetterPage {
            entries,
            next: Cursor::from(next.join(",")),
            at_end,
        })
    }

    /// The entry at `at`, read again (`None` if it is gone meanwhile).
    fn read_one(&self, at: Position) -> Result<Option<DeadLetterEntry>, BrokerError> {
        let (p, o) = at;
        let mut found = None;
        scan(&self.consumer, &self.dlq, &[(p, o, o + 1)], |m| {
            if m.offset() == o {
                found = Some(DeadLetterEntry {
                    message: decode(m, &self.dlq).message,
                    position: format!("partition {p} offset {o}"),
                });
            }
            Next::Last
        })?;
        Ok(found)
    }

    /// `f` of the index brought up to the high watermarks, with what is live in it.
    fn with_index<T>(
        &mut self,
        f: impl FnOnce(&CopyIndex<Slot>, &dyn Fn(&MessageId, &Slot) -> bool) -> T,
    ) -> Result<T, BrokerError> {
        let spans = self.refresh()?;
        self.extend_index(&spans)?;
        let cache = &self.cache;
        Ok(f(&cache.index.copies, &|id, slot| {
            cache.live(&spans, id, *slot)
        }))
    }

    fn get(&mut self, id: &MessageId) -> Result<Option<DeadLetterEntry>, BrokerError> {
        match self.with_index(|index, live| index.first(id, live))? {
            Some((_, p, o)) => self.read_one((p, o)),
            None => Ok(None),
        }
    }

    /// The dead letters `ids` remove (each id its oldest live one), each with the
    /// positions of all its copies.
    fn pick(&mut self, ids: &[MessageId]) -> Result<Vec<(MessageId, Vec<Position>)>, BrokerError> {
        let picked = self.with_index(|index, live| index.pick(ids, live))?;
        Ok(picked
            .into_iter()
            .map(|p| (p.id, p.copies.iter().map(|(_, p, o)| (*p, *o)).collect()))
            .collect())
    }

    /// Every record is indexed once per reader (then only what came since), so the count
    /// is of dead letters, copies folded, with the oldest one's time from the index.
    fn count(&mut self) -> Result<DeadLetterCount, BrokerError> {
        self.with_index(|index, live| index.count(live))
    }
}

#[async_trait]
impl DeadLetters for KafkaDeadLetters {
    async fn browse(&self, from: &Cursor, max: usize) -> Result<DeadLetterPage, BrokerError> {
        let from = parse_cursor(from)?;
        self.with(move |r| r.browse(&from, max)).await
    }

    async fn get(&self, id: &MessageId) -> Result<Option<DeadLetterEntry>, BrokerError> {
        let id = id.clone();
        self.with(move |r| r.get(&id)).await
    }

    async fn remove(&self, ids: &[MessageId]) -> Result<Vec<MessageId>, BrokerError> {
        let _one = self.removing.lock().await;
        let ids = ids.to_vec();
        let (ledger, picked) = self
            .with(move |r| Ok((r.ledger.clone(), r.pick(&ids)?)))
            .await?;
        if picked.is_empty() {
            return Ok(Vec::new());
        }
        let records: Vec<(String, Option<String>)> = picked
            .iter()
            .flat_map(|(id, copies)| {
                copies
                    .iter()
                    .map(|(p, o)| (format!("{p}:{o}"), Some(id.as_str().to_owned())))
            })
            .collect();
        let (confirmed, error) = self.produce_ledger(&ledger, &records).await;
        let confirmed: std::collections::HashSet<String> = confirmed.into_iter().collect();
        let mut removed: Vec<(Position, MessageId)> = Vec::new();
        let mut ids: Vec<MessageId> = Vec::new();
        for (id, copies) in picked {
            let gone = |(p, o): &Position| confirmed.contains(&format!("{p}:{o}"));
            // A dead letter is removed once every copy of it is (the rest: call again).
            if copies.iter().all(gone) {
                ids.push(id.clone());
            }
            removed.extend(copies.into_iter().filter(gone).map(|at| (at, id.clone())));
        }
        self.with(move |r| {
            r.cache.removed.extend(removed);
            Ok(())
        })
        .await?;
        if let Some(e) = error {
            // Those confirmed are removed; calling again removes the rest.
            return Err(e);
        }
        if let Err(e) = self.truncate().await {
            tracing::warn!(error = %e, "truncating removed dead letters failed; they stay hidden by the ledger");
        }
        Ok(ids)
    }

    async fn count(&self) -> Result<DeadLetterCount, BrokerError> {
        self.with(Reader::count).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursors_round_trip_and_reject_foreign_text() {
        let parsed = parse_cursor(&Cursor::from("0:17,1:4,2:0")).ok();
        assert_eq!(parsed, Some(BTreeMap::from([(0, 17), (1, 4), (2, 0)])));
        assert_eq!(parse_cursor(&Cursor::start()).ok(), Some(BTreeMap::new()));
        assert!(parse_cursor(&Cursor::from("12/3")).is_err());
        assert!(parse_cursor(&Cursor::from("0:x")).is_err());
    }
}
