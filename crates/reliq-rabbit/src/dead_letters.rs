//! The dead-letter reader ([`RabbitDeadLetters`]) and the relay that moves the broker's own
//! dead letters from the landing queue into the dead-letter stream.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicGetOptions, BasicQosOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Channel};
use reliq_core::{
    BrokerError, Cursor, DeadLetterCount, DeadLetterEntry, DeadLetterPage, DeadLetters, Message,
    MessageId, Subscription, seam::CopyIndex,
};
use tokio::sync::{Mutex, watch};

use crate::backlog::message_count;
use crate::client::{Inner, Target};
use crate::error::reply_code;
use crate::names::{Names, short};
use crate::{codec, error::RabbitError};

/// How long a read waits for an offset it knows the stream holds.
const STALL: Duration = Duration::from_secs(15);
/// Past the last chunk's first offset, a quiet spell this long is the end of the stream.
const SETTLE: Duration = Duration::from_millis(300);
/// How long the `last` probe waits on a stream that reports no messages (the count of a
/// stream's `queue.declare-ok` lags behind publishes).
const EMPTY_PROBE: Duration = Duration::from_millis(500);
/// Deliveries in flight per stream read (a stream consumer needs a prefetch).
const READ_PREFETCH: u16 = 2048;
/// Landed messages in flight per relay.
const RELAY_PREFETCH: u16 = 32;

/// A consumer's dead letters on RabbitMQ: the dead-letter stream read by offset, with the
/// removal ledger applied. Made by
/// [`Broker::dead_letters`](reliq_core::Broker::dead_letters).
///
/// - **The DLQ is a stream** ([`Names::parking`]). reliq's dead letters are published to
///   it with confirms; a stream consumer (`x-stream-offset`, manual ack, a prefetch)
///   reads it without removing anything — an ack on a stream only returns credit, so a
///   browse changes no depth, no order and no delivery count. The cursor is the offset of
///   the next entry to read.
/// - **A read is complete wherever it is served.** RabbitMQ serves a stream consumer
///   from the stream's member on the connection's node, and a replica that is behind its
///   leader (a node just restarted, or cut off from the leader) holds a consistent but
///   short prefix. So browse, get and remove first attach their stream consumer, then
///   append a *fence* to the stream (an empty entry with a `reliq-fence` header, confirmed
///   by the leader) and read until that fence is delivered: every entry confirmed before
///   the read began precedes it, so none is missed; a member that does not deliver the
///   fence within 15 s fails the read, naming the stream, instead of answering short.
///   The ledger is read the same way. Fences are skipped by every read, and cost one
///   small entry per read in each stream.
/// - **Count** is the one read without a fence (gauges poll it: a fence per poll would
///   grow the streams without end): it reads on to the end of what the serving member
///   holds — a consumer started at `last` names the first offset of its last chunk, the
///   read waits (up to 15 s) for every offset up to it and past it treats a short quiet
///   spell (300 ms) as the end. On a cluster it can trail a replica that is catching up.
/// - **Copies of one dead letter count once.** A dead letter whose confirm was lost is
///   published again (the hold rule), and a consumer that crashed between the copy and
///   its ack parks the message again: the stream then holds two entries of one dead
///   letter. Each reader keeps an index of the stream ([`CopyIndex`]: offset, id, replay
///   count, payload), read once and then from where it was left, so a browse shows a
///   dead letter at its oldest copy only, `count` counts dead letters, and `remove`
///   takes every copy of the dead letter it removes.
/// - **Removal** appends a record of `(offset, id)` pairs to the removal ledger
///   ([`Names::removed`], a stream), confirmed before `remove` returns: a stream cannot
///   delete one message. Browse, get and count skip an entry whose offset *and* id are in
///   the ledger (so a recreated stream, whose offsets start again at 0, hides nothing).
///   The ledger is read whole once per reader and then from where it was left; what a
///   reader caches are facts that never change (a confirmed ledger record, the entry at
///   an offset), never a cursor.
/// - **The landing queue** ([`Names::landing`]) is where the consumer queue dead-letters
///   on its own (delivery limit, at-least-once). Each landed message is given a reliq
///   record from its `x-death` (reason `max-deliveries`, time, queue, exchange, routing
///   key), published to the stream with a confirm, and only then acked on the landing
///   queue: by a relay beside each running consumer's receiver and by every reader call
///   before it reads. A crash between the two gives a second copy in the stream, never a
///   loss.
pub struct RabbitDeadLetters {
    inner: Arc<Inner>,
    sub: Subscription,
    names: Names,
    /// The removals read from the ledger so far, and where the next ledger read starts.
    ledger: Mutex<Ledger>,
    /// Serialises this reader's removals, so two of its calls never pick the same entry.
    removing: Mutex<()>,
}

impl std::fmt::Debug for RabbitDeadLetters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RabbitDeadLetters")
            .field("stream", &self.names.parking)
            .finish_non_exhaustive()
    }
}

#[derive(Default)]
struct Ledger {
    /// The ledger offset the next read starts at.
    next: u64,
    /// The first offset of the ledger's last chunk when this reader last read the ledger
    /// to its end. A stream's chunks never change once written and every append makes a
    /// new one, so while a probe names the same last chunk nothing was appended since:
    /// the read (and its quiet-spell wait) is skipped.
    read_through_chunk: Option<u64>,
    /// Removed entries: (offset in the dead-letter stream, message id).
    removed: HashSet<(u64, MessageId)>,
    /// Every entry of the dead-letter stream below `indexed_to`, by offset: which are
    /// copies of one dead letter, and where each dead letter is — so `remove`, `get` and
    /// `count` read only what was appended since, and a browse shows each dead letter
    /// once. An entry at a stream offset never changes (only deleting and recreating the
    /// stream could, and that deletes the dead letters with it).
    index: CopyIndex<u64>,
    indexed_to: u64,
}

impl Ledger {
    fn hides(&self, offset: u64, id: &MessageId) -> bool {
        // Probing with a clone is cheap next to the network read of the entry.
        self.removed.contains(&(offset, id.clone()))
    }

    /// The entry with `id` at `offset` is neither removed nor a later copy of a dead
    /// letter shown at an earlier offset.
    fn shows(&self, offset: u64, id: &MessageId) -> bool {
        !self.hides(offset, id) && self.index.shows(id, &offset, |id, o| !self.hides(*o, id))
    }
}

/// One ledger record's payload: the `(offset, id)` pairs one `remove` took out.
#[derive(Default, serde::Serialize, serde::Deserialize)]
struct LedgerRecord {
    removed: Vec<(u64, String)>,
}

impl RabbitDeadLetters {
    /// A reader of `sub`'s dead letters: the stream, the ledger and the landing queue
    /// the consumer's subscribe declared. Opening creates nothing (passive declares): a
    /// missing one is [`BrokerError::NotFound`].
    pub(crate) async fn open(inner: Arc<Inner>, sub: &Subscription) -> Result<Self, BrokerError> {
        let names = Names::of(sub);
        for queue in [&names.parking, &names.removed, &names.landing] {
            if message_count(&inner, queue).await?.is_none() {
                return Err(sub.missing_dead_letters(format_args!("queue `{queue}`")));
            }
        }
        Ok(Self {
            inner,
            sub: sub.clone(),
            names,
            ledger: Mutex::new(Ledger::default()),
            removing: Mutex::new(()),
        })
    }

    /// Append `record` to the ledger, confirmed.
    async fn append_to_ledger(&self, record: &LedgerRecord) -> Result<(), BrokerError> {
        append_to_ledger(&self.inner, &self.names.removed, record).await
    }

    /// Move what landed in the landing queue into the stream, then bring the ledger up
    /// to date; the ledger, locked, and where a read of the stream stops. A
    /// [`Completeness::Complete`] read fences the ledger and the stream; a
    /// [`Completeness::Served`] one finds both ends at once.
    async fn refresh(
        &self,
        completeness: Completeness,
    ) -> Result<(tokio::sync::MutexGuard<'_, Ledger>, ReadTo), BrokerError> {
        drain_landing(&self.inner, &self.sub, &self.names).await?;
        match completeness {
            Completeness::Complete => Ok((self.read_ledger(completeness).await?, ReadTo::Fence)),
            Completeness::Served => {
                let (ledger, end) = tokio::join!(
                    self.read_ledger(completeness),
                    last_chunk_start(&self.inner, &self.names.parking)
                );
                Ok((ledger?, ReadTo::LastChunk(end?)))
            }
        }
    }

    /// The ledger, read on from where this reader left it.
    async fn read_ledger(
        &self,
        completeness: Completeness,
    ) -> Result<tokio::sync::MutexGuard<'_, Ledger>, BrokerError> {
        let mut ledger = self.ledger.lock().await;
        let to = match completeness {
            Completeness::Complete => ReadTo::Fence,
            Completeness::Served => {
                let end = last_chunk_start(&self.inner, &self.names.removed).await?;
                if end.is_some() && end == ledger.read_through_chunk {
                    return Ok(ledger);
                }
                ReadTo::LastChunk(end)
            }
        };
        let mut records = Vec::new();
        let scan = scan(&self.inner, &self.names.removed, ledger.next, to, |_, d| {
            match serde_json::from_slice::<LedgerRecord>(&d.data) {
                Ok(r) => records.push(r),
                Err(e) => {
                    tracing::warn!(ledger = %self.names.removed, error = %e, "unreadable removal-ledger record skipped");
                }
            }
            true
        })
        .await?;
        for record in records {
            for (offset, id) in record.removed {
                ledger.removed.insert((offset, MessageId::from(id)));
            }
        }
        ledger.next = scan.next;
        // A fence may share its chunk with records appended after it, which this read
        // stopped before: only a read to the last chunk may skip the next one.
        ledger.read_through_chunk = match to {
            ReadTo::LastChunk(end) if scan.at_end => end,
            _ => None,
        };
        Ok(ledger)
    }

    /// Bring the ledger's index of the stream up to `to`.
    async fn index(&self, ledger: &mut Ledger, to: ReadTo) -> Result<(), BrokerError> {
        let index = &mut ledger.index;
        let scan = scan(
            &self.inner,
            &self.names.parking,
            ledger.indexed_to,
            to,
            |offset, d| {
                index.add(offset, &codec::message(&d.properties, &d.data));
                true
            },
        )
        .await?;
        ledger.indexed_to = ledger.indexed_to.max(scan.next);
        Ok(())
    }

    fn entry(offset: u64, message: Message) -> DeadLetterEntry {
        DeadLetterEntry {
            message,
            position: format!("stream offset {offset}"),
        }
    }
}

fn parse_cursor(cursor: &Cursor) -> Result<u64, BrokerError> {
    match cursor.as_str() {
        None => Ok(0),
        Some(text) => text.parse().map_err(|_| BrokerError::Config {
            field: "cursor".into(),
            reason: format!("`{text}` is not a RabbitMQ dead-letter cursor (a stream offset)"),
        }),
    }
}

#[async_trait]
impl DeadLetters for RabbitDeadLetters {
    async fn browse(&self, from: &Cursor, max: usize) -> Result<DeadLetterPage, BrokerError> {
        let start = parse_cursor(from)?;
        let (mut ledger, to) = self.refresh(Completeness::Complete).await?;
        let ledger = &mut *ledger;
        // One read from where the index ends (or the cursor, if earlier): what lies before
        // the cursor is only indexed, so a copy shown on an earlier page is known.
        let first = ledger.indexed_to.min(start);
        let mut entries = Vec::new();
        let scan = scan(&self.inner, &self.names.parking, first, to, |offset, d| {
            let message = codec::message(&d.properties, &d.data);
            ledger.index.add(offset, &message);
            if offset < start || !ledger.shows(offset, message.id()) {
                return true;
            }
            if entries.len() == max {
                return false; // one more entry: the page is not at the end
            }
            entries.push(Self::entry(offset, message));
            true
        })
        .await?;
        ledger.indexed_to = ledger.indexed_to.max(scan.next);
        Ok(DeadLetterPage {
            entries,
            next: Cursor::from(scan.next.max(start).to_string()),
            at_end: scan.at_end,
        })
    }

    async fn get(&self, id: &MessageId) -> Result<Option<DeadLetterEntry>, BrokerError> {
        let (mut ledger, to) = self.refresh(Completeness::Complete).await?;
        let ledger = &mut *ledger;
        let mut read = std::collections::BTreeMap::new();
        let read_to = scan(
            &self.inner,
            &self.names.parking,
            ledger.indexed_to,
            to,
            |offset, d| {
                let message = codec::message(&d.properties, &d.data);
                ledger.index.add(offset, &message);
                if message.id() == id {
                    read.insert(offset, message);
                }
                true
            },
        )
        .await?
        .next;
        ledger.indexed_to = ledger.indexed_to.max(read_to);
        let Some(offset) = ledger.index.first(id, |id, o| !ledger.hides(*o, id)) else {
            return Ok(None);
        };
        if let Some(message) = read.remove(&offset) {
            return Ok(Some(Self::entry(offset, message)));
        }
        // Indexed by an earlier call: read that one entry.
        let mut found = None;
        scan(
            &self.inner,
            &self.names.parking,
            offset,
            ReadTo::Fence,
            |at, d| {
                if at == offset {
                    found = Some(Self::entry(at, codec::message(&d.properties, &d.data)));
                }
                false
            },
        )
        .await?;
        Ok(found)
    }

    async fn remove(&self, ids: &[MessageId]) -> Result<Vec<MessageId>, BrokerError> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let _serial = self.removing.lock().await;
        let (mut ledger, to) = self.refresh(Completeness::Complete).await?;
        self.index(&mut ledger, to).await?;
        // Each dead letter goes with every copy of it the stream holds.
        let picked = ledger.index.pick(ids, |id, o| !ledger.hides(*o, id));
        if picked.is_empty() {
            return Ok(Vec::new());
        }
        let taken: Vec<(u64, MessageId)> = picked
            .iter()
            .flat_map(|p| p.copies.iter().map(|o| (*o, p.id.clone())))
            .collect();
        let record = LedgerRecord {
            removed: taken
                .iter()
                .map(|(o, id)| (*o, id.as_str().to_owned()))
                .collect(),
        };
        self.append_to_ledger(&record).await?;
        ledger.removed.extend(taken);
        Ok(picked.into_iter().map(|p| p.id).collect())
    }

    async fn count(&self) -> Result<DeadLetterCount, BrokerError> {
        let (refreshed, first) = tokio::join!(
            self.refresh(Completeness::Served),
            first_offset(&self.inner, &self.names.parking)
        );
        let (mut ledger, to) = refreshed?;
        // A long-lived reader (the gauges') forgets what a retention policy dropped.
        if let Some(first) = first? {
            ledger.index.retain(|o| *o >= first);
        }
        self.index(&mut ledger, to).await?;
        Ok(ledger.index.count(|id, o| !ledger.hides(*o, id)))
    }
}

/// How complete a read of the stream and its ledger is.
#[derive(Clone, Copy, Debug)]
enum Completeness {
    /// Everything confirmed before the read began, whichever node serves it (a fence
    /// written to each stream, [`ReadTo::Fence`]): browse, get and remove.
    Complete,
    /// What the stream's member on the connection's node holds, without a write
    /// ([`ReadTo::LastChunk`]): count, which gauges poll — a fence per poll would grow
    /// the streams without end.
    Served,
}

/// Where a stream read starts.
#[derive(Clone, Copy, Debug)]
enum Start {
    /// At this offset (or the first one the stream still holds, if later).
    Offset(u64),
    /// At the first offset of the last chunk.
    Last,
}

/// One stream consumer on its own channel: on the shared connection, or on a connection
/// of its own to another node of the URL when the shared connection's node could not
/// serve the stream.
struct StreamRead {
    ch: Channel,
    /// The read's own connection, closed with it (`None`: the channel is on the shared
    /// connection).
    own: Option<lapin::Connection>,
    consumer: lapin::Consumer,
    stream: String,
    /// Deliveries taken and not yet acked, and the last one's tag: credit is given back a
    /// quarter of the prefetch at a time (one `multiple` ack), not per delivery.
    unacked: u16,
    last_tag: u64,
    ack_every: u16,
}

/// The offset a stream delivery carries in its `x-stream-offset` header.
fn offset_of(d: &lapin::message::Delivery) -> Option<u64> {
    match d
        .properties
        .headers()
        .as_ref()?
        .inner()
        .get("x-stream-offset")?
    {
        AMQPValue::LongLongInt(n) => u64::try_from(*n).ok(),
        AMQPValue::LongUInt(n) => Some(u64::from(*n)),
        AMQPValue::LongInt(n) => u64::try_from(*n).ok(),
        _ => None,
    }
}

impl StreamRead {
    /// Start reading `stream` at `start`; also the message count the broker reports for
    /// it (it lags behind publishes: a hint, never the truth).
    ///
    /// RabbitMQ serves a stream consumer only from a running member of the stream on the
    /// connection's node, and a node can have none: its member is not running yet (a
    /// node just restarted: `INTERNAL_ERROR`), or the stream coordinator knows no member
    /// of the stream there (`PRECONDITION_FAILED`, "does not have a replica on the local
    /// node": the stream's members were changed, or — seen 10 s after a rolling restart
    /// — the coordinator has not registered the restarted member yet). The read then
    /// goes round the URL's nodes, each other node on a connection of its own, with
    /// 500 ms between rounds, for up to 15 s: `reliq dlq` and the admin API read through
    /// any node that holds the stream.
    async fn open(
        inner: &Inner,
        stream: &str,
        start: Start,
        prefetch: u16,
    ) -> Result<(Self, u32), BrokerError> {
        let deadline = tokio::time::Instant::now() + STALL;
        let nodes = inner.node_count();
        let shared = inner.preferred_node();
        let mut turn = 0usize;
        loop {
            let node = (shared + turn) % nodes;
            let via = if node == shared {
                Via::Shared
            } else {
                Via::Node(node)
            };
            let refusal = match Self::open_once(inner, stream, start, prefetch, via).await {
                Ok(read) => {
                    if node != shared {
                        tracing::info!(
                            stream,
                            node,
                            "reading the stream through another node of the URL"
                        );
                    }
                    return Ok(read);
                }
                Err(Refused::Other(e)) => return Err(e),
                Err(Refused::NotServedHere(e)) => missing_or(stream, e),
                Err(Refused::Unreachable(e)) => e,
            };
            if tokio::time::Instant::now() >= deadline {
                return Err(refusal);
            }
            tracing::info!(stream, node, error = %refusal, "this node cannot serve the stream now; trying the next");
            turn += 1;
            if turn.is_multiple_of(nodes) {
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    }

    async fn open_once(
        inner: &Inner,
        stream: &str,
        start: Start,
        prefetch: u16,
        via: Via,
    ) -> Result<(Self, u32), Refused> {
        let (ch, own) = match via {
            Via::Shared => (inner.channel().await?, None),
            Via::Node(k) => {
                let conn = inner.connect_node(k).await.map_err(Refused::Unreachable)?;
                match conn.create_channel().await {
                    Ok(ch) => (ch, Some(conn)),
                    Err(e) => {
                        let _ = conn.close(200, "no channel".into()).await;
                        return Err(Refused::Unreachable(RabbitError::client(
                            "opening a channel",
                            e,
                        )));
                    }
                }
            }
        };
        let read = Self::attach(&ch, stream, start, prefetch).await;
        match read {
            Ok((consumer, count)) => Ok((
                Self {
                    ch,
                    own,
                    consumer,
                    stream: stream.to_owned(),
                    unacked: 0,
                    last_tag: 0,
                    ack_every: (prefetch / 4).max(1),
                },
                count,
            )),
            Err(refused) => {
                if let Some(conn) = own {
                    let _ = conn.close(200, "stream read refused".into()).await;
                }
                Err(refused)
            }
        }
    }

    /// Start the stream consumer on `ch` (its prefetch, its start offset); the message
    /// count the broker reports.
    async fn attach(
        ch: &Channel,
        stream: &str,
        start: Start,
        prefetch: u16,
    ) -> Result<(lapin::Consumer, u32), Refused> {
        let name = short("queue", stream)?;
        let declared = ch
            .queue_declare(
                name.clone(),
                QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(|e| missing_or(stream, e))?;
        ch.basic_qos(prefetch, BasicQosOptions::default())
            .await
            .map_err(|e| RabbitError::client("basic.qos", e))?;
        let mut args = FieldTable::default();
        args.insert(
            "x-stream-offset".into(),
            match start {
                Start::Offset(n) => AMQPValue::LongLongInt(i64::try_from(n).unwrap_or(i64::MAX)),
                Start::Last => AMQPValue::LongString(LongString::from("last")),
            },
        );
        match ch
            .basic_consume(name, "".into(), BasicConsumeOptions::default(), args)
            .await
        {
            Ok(consumer) => Ok((consumer, declared.message_count())),
            // The channel is closed by the refusal.
            Err(e) if no_member_here(&e) => Err(Refused::NotServedHere(e)),
            Err(e) => Err(missing_or(stream, e).into()),
        }
    }

    /// The next entry and its offset, or `None` after `wait` without one. Acked a quarter
    /// prefetch at a time: on a stream an ack removes nothing, it only returns the credit
    /// of the prefetch, and three quarters of it are always left to deliver into.
    async fn next(
        &mut self,
        wait: Duration,
    ) -> Result<Option<(u64, lapin::message::Delivery)>, BrokerError> {
        loop {
            let d = match tokio::time::timeout(wait, self.consumer.next()).await {
                Err(_) => return Ok(None),
                Ok(Some(Ok(d))) => d,
                Ok(Some(Err(e))) => return Err(RabbitError::client("reading a stream", e)),
                Ok(None) => {
                    return Err(BrokerError::connection(format!(
                        "the broker cancelled the reader of stream `{}`",
                        self.stream
                    )));
                }
            };
            self.unacked += 1;
            self.last_tag = d.delivery_tag;
            if self.unacked >= self.ack_every {
                self.ch
                    .basic_ack(self.last_tag, BasicAckOptions { multiple: true })
                    .await
                    .map_err(|e| RabbitError::client("basic.ack", e))?;
                self.unacked = 0;
            }
            match offset_of(&d) {
                Some(offset) => return Ok(Some((offset, d))),
                None => {
                    tracing::warn!(stream = %self.stream, "stream delivery without x-stream-offset skipped")
                }
            }
        }
    }

    async fn close(self) {
        let _ = self.ch.close(200, "read done".into()).await;
        if let Some(conn) = self.own {
            let _ = conn.close(200, "read done".into()).await;
        }
    }
}

/// Which connection a [`StreamRead`] is opened on.
#[derive(Clone, Copy, Debug)]
enum Via {
    /// The broker's shared connection.
    Shared,
    /// A connection of the read's own to node `k` of the URL.
    Node(usize),
}

/// RabbitMQ refused a stream consumer because the connection's node has no running
/// member of the stream ([`no_member_reply`]).
fn no_member_here(e: &lapin::Error) -> bool {
    match e.kind() {
        lapin::ErrorKind::ProtocolError(amqp) => {
            no_member_reply(amqp.get_id(), amqp.get_message().as_str())
        }
        _ => false,
    }
}

/// The replies of RabbitMQ 3.10–4.x to a stream consumer on a node without a running
/// member: `INTERNAL_ERROR` (541, the member is not running), `PRECONDITION_FAILED`
/// (406) "does not have a replica on the local node" (the stream coordinator knows no
/// member there) and `RESOURCE_ERROR` (506) "does not have a running local replica"
/// (the member went away between that check and the consumer's start). 406 and 506 are
/// matched with their text: 406 also answers arguments that do not match the queue
/// (which no other node would accept either), 506 other resource limits.
fn no_member_reply(code: u16, text: &str) -> bool {
    match code {
        541 => true,
        406 => text.contains("does not have a replica on the local node"),
        506 => text.contains("does not have a running local replica"),
        _ => false,
    }
}

/// Append `record` to the removal ledger `ledger`, confirmed.
async fn append_to_ledger(
    inner: &Inner,
    ledger: &str,
    record: &LedgerRecord,
) -> Result<(), BrokerError> {
    let payload = serde_json::to_vec(record).map_err(|e| BrokerError::Other(Box::new(e)))?;
    inner
        .publish_to(
            "",
            ledger,
            &Message::new(payload),
            Target::Stream("removal ledger", ledger),
        )
        .await
}

/// Run `declare` — which declares `names`' dead-letter objects, among others — and when
/// the removal ledger is empty (just created), append one empty record to it: an empty stream can only be
/// told from a slow one by waiting (`EMPTY_PROBE`), so a ledger holding a record lets every
/// read of it end at once. Declaring is the one place that writes it: opening a reader
/// changes nothing.
pub(crate) async fn declaring<T>(
    inner: &Inner,
    names: &Names,
    declare: impl Future<Output = Result<T, BrokerError>>,
) -> Result<T, BrokerError> {
    // Checked after the declare, not before with a passive one: a passive declare of a
    // missing queue closes its channel with a 404, which the client logs as an error on
    // every first subscribe.
    let declared = declare.await?;
    if last_chunk_start(inner, &names.removed).await?.is_none() {
        append_to_ledger(inner, &names.removed, &LedgerRecord::default()).await?;
    }
    Ok(declared)
}

/// Why a stream consumer could not be started.
enum Refused {
    /// The node has no running member of the stream ([`no_member_here`]): another node,
    /// or this one later, may serve it.
    NotServedHere(lapin::Error),
    /// Another node of the URL could not be reached; the next one may be.
    Unreachable(BrokerError),
    Other(BrokerError),
}

impl From<BrokerError> for Refused {
    fn from(e: BrokerError) -> Self {
        Self::Other(e)
    }
}

/// A missing stream (404) is named; anything else is a client error.
fn missing_or(stream: &str, e: lapin::Error) -> BrokerError {
    if reply_code(&e) == Some(404) {
        BrokerError::Unroutable(format!(
            "dead-letter stream `{stream}` does not exist (declare it with \
             RabbitBroker::declare_dead_letter_queue or by subscribing)"
        ))
    } else {
        RabbitError::client("opening a stream reader", e)
    }
}

/// How a [`scan`] ended.
struct Scan {
    /// The offset to read next: after the last entry visited, or the entry `visit`
    /// declined.
    next: u64,
    /// The scan reached the end of what the stream held when it began.
    at_end: bool,
}

/// The first offset of `stream`'s last chunk, `None` when it is empty.
async fn last_chunk_start(inner: &Inner, stream: &str) -> Result<Option<u64>, BrokerError> {
    first_delivered(inner, stream, Start::Last).await
}

/// The offset of `stream`'s first entry still held (retention drops whole segments),
/// `None` when it is empty.
async fn first_offset(inner: &Inner, stream: &str) -> Result<Option<u64>, BrokerError> {
    first_delivered(inner, stream, Start::Offset(0)).await
}

/// The offset of the first entry a read of `stream` from `start` delivers, `None` when
/// the stream is empty.
async fn first_delivered(
    inner: &Inner,
    stream: &str,
    start: Start,
) -> Result<Option<u64>, BrokerError> {
    let (mut read, reported) = StreamRead::open(inner, stream, start, 1).await?;
    let wait = if reported > 0 { STALL } else { EMPTY_PROBE };
    let first = read.next(wait).await;
    read.close().await;
    match first? {
        Some((offset, _)) => Ok(Some(offset)),
        None if reported > 0 => Err(BrokerError::Timeout(STALL)),
        None => Ok(None),
    }
}

/// Where a [`scan`] stops.
#[derive(Clone, Copy, Debug)]
enum ReadTo {
    /// At a fence this read writes once its stream consumer is attached: every entry
    /// confirmed before the read began is delivered before the fence, whichever member
    /// of the stream serves the read.
    Fence,
    /// At the end of what the serving member holds, found by [`last_chunk_start`]
    /// (`None`: empty) — no write, but a member that is behind its leader gives a
    /// consistent, short read.
    LastChunk(Option<u64>),
}

/// The header that marks a fence entry; its value is the fence's own id.
const FENCE_HEADER: &str = "reliq-fence";

/// The fence id of a fence entry, `None` for any other.
fn fence_of(d: &lapin::message::Delivery) -> Option<&[u8]> {
    match d.properties.headers().as_ref()?.inner().get(FENCE_HEADER)? {
        AMQPValue::LongString(s) => Some(s.as_bytes()),
        _ => Some(&[]),
    }
}

/// Read `stream` from offset `from` to where `to` says, handing each entry (fences
/// excepted) to `visit` until it returns `false` (that entry is then where the next read
/// starts).
async fn scan(
    inner: &Inner,
    stream: &str,
    from: u64,
    to: ReadTo,
    mut visit: impl FnMut(u64, &lapin::message::Delivery) -> bool + Send,
) -> Result<Scan, BrokerError> {
    let (start, last_chunk) = match to {
        ReadTo::Fence => (from, None),
        ReadTo::LastChunk(None) => {
            return Ok(Scan {
                next: from,
                at_end: true,
            });
        }
        // Start no later than the last chunk, so its first offset is always delivered:
        // until it is, every wait is for an entry known to exist; after it, the rest of
        // that chunk comes in the same burst, and a quiet spell is the end.
        ReadTo::LastChunk(Some(last)) => (from.min(last), Some(last)),
    };
    let (mut read, _) =
        StreamRead::open(inner, stream, Start::Offset(start), READ_PREFETCH).await?;
    // The consumer is attached (consume-ok): the fence lands after everything this
    // read must see, and the member serving it delivers entries in order.
    let fence = match to {
        ReadTo::Fence => match write_fence(inner, stream).await {
            Ok(id) => Some(id),
            Err(e) => {
                read.close().await;
                return Err(e);
            }
        },
        ReadTo::LastChunk(_) => None,
    };
    let mut position = from;
    let mut past_last_chunk = false;
    let result = loop {
        let wait = if past_last_chunk { SETTLE } else { STALL };
        match read.next(wait).await {
            Err(e) => break Err(e),
            Ok(None) if fence.is_some() => {
                break Err(BrokerError::connection(format!(
                    "stream `{stream}`: the fence written at the start of this read was not \
                     delivered within {STALL:?} (the stream member on the node of this \
                     connection is behind its leader)"
                )));
            }
            Ok(None) if !past_last_chunk => {
                break Err(BrokerError::connection(format!(
                    "stream `{stream}` delivered nothing for {STALL:?} before offset {}",
                    last_chunk.unwrap_or_default()
                )));
            }
            Ok(None) => {
                break Ok(Scan {
                    next: position,
                    at_end: true,
                });
            }
            Ok(Some((offset, d))) => {
                past_last_chunk |= last_chunk.is_some_and(|last| offset >= last);
                if let Some(id) = fence_of(&d) {
                    if fence.as_deref().is_some_and(|f| f.as_bytes() == id) {
                        break Ok(Scan {
                            next: position.max(offset + 1),
                            at_end: true,
                        });
                    }
                    if offset >= from {
                        position = offset + 1;
                    }
                    continue; // another read's fence
                }
                // A read starts at the chunk holding its start offset: skip what precedes.
                if offset < from {
                    continue;
                }
                if !visit(offset, &d) {
                    break Ok(Scan {
                        next: offset,
                        at_end: false,
                    });
                }
                position = offset + 1;
            }
        }
    };
    read.close().await;
    result
}

/// Append a fence to `stream`, confirmed; its id.
async fn write_fence(inner: &Inner, stream: &str) -> Result<String, BrokerError> {
    let id = MessageId::generate().as_str().to_owned();
    let fence = Message::new(Vec::new())
        .with_id(id.as_str())
        .with_header(FENCE_HEADER, id.as_str());
    inner
        .publish_to(
            "",
            stream,
            &fence,
            Target::Stream("read fence of stream", stream),
        )
        .await?;
    Ok(id)
}

/// Give a landed message its reliq record (from `x-death`, when it has none) and publish
/// it to the dead-letter stream, confirmed.
async fn move_landed(
    inner: &Inner,
    sub: &Subscription,
    names: &Names,
    properties: &BasicProperties,
    data: &[u8],
) -> Result<(), BrokerError> {
    let message = codec::translate_broker_dead_letter(
        codec::message(properties, data),
        properties,
        &sub.consumer,
        &sub.source,
        &names.queue,
    );
    inner
        .publish_to(
            "",
            &names.parking,
            &message,
            Target::Stream("dead-letter stream", &names.parking),
        )
        .await
}

/// Move everything in the landing queue into the stream (each confirmed, then acked).
async fn drain_landing(
    inner: &Inner,
    sub: &Subscription,
    names: &Names,
) -> Result<(), BrokerError> {
    let ch = inner.channel().await?;
    let result = drain_on(&ch, inner, sub, names).await;
    // Closing returns whatever was taken and not acked (a failed move) to the queue.
    let _ = ch.close(200, "drained".into()).await;
    result
}

async fn drain_on(
    ch: &Channel,
    inner: &Inner,
    sub: &Subscription,
    names: &Names,
) -> Result<(), BrokerError> {
    let queue = short("queue", &names.landing)?;
    let mut moved = 0u64;
    while let Some(m) = ch
        .basic_get(queue.clone(), BasicGetOptions::default())
        .await
        .map_err(|e| RabbitError::client("basic.get on the landing queue", e))?
    {
        move_landed(inner, sub, names, &m.delivery.properties, &m.delivery.data).await?;
        ch.basic_ack(m.delivery.delivery_tag, BasicAckOptions::default())
            .await
            .map_err(|e| RabbitError::client("basic.ack", e))?;
        moved += 1;
    }
    if moved > 0 {
        tracing::info!(landing = %names.landing, stream = %names.parking, moved, "moved broker dead letters into the dead-letter stream");
    }
    Ok(())
}

/// Stops a [`spawn_relay`] task when dropped (after the move in progress, if any).
pub(crate) struct RelayStop {
    _stop: watch::Sender<()>,
}

/// While the returned handle lives, move what lands in `sub`'s landing queue into its
/// dead-letter stream as it arrives (confirmed, then acked), reconnecting with the
/// broker's backoff.
pub(crate) fn spawn_relay(inner: Arc<Inner>, sub: Subscription) -> RelayStop {
    let (tx, rx) = watch::channel(());
    tokio::spawn(relay(inner, sub, rx));
    RelayStop { _stop: tx }
}

async fn relay(inner: Arc<Inner>, sub: Subscription, mut stop: watch::Receiver<()>) {
    let names = Names::of(&sub);
    let mut failures = 0u32;
    loop {
        let ch = match inner.channel().await {
            Ok(ch) => ch,
            Err(e) => {
                failures += 1;
                if !relay_pause(&inner, &names, failures, &e, &mut stop).await {
                    return;
                }
                continue;
            }
        };
        let result = relay_on(&ch, &inner, &sub, &names, &mut stop, &mut failures).await;
        // Closing returns an unacked landed message (a failed move) to the queue.
        let _ = ch.close(200, "relay stopped".into()).await;
        match result {
            Ok(()) => return,
            Err(e) => {
                failures += 1;
                if !relay_pause(&inner, &names, failures, &e, &mut stop).await {
                    return;
                }
            }
        }
    }
}

/// Wait out the backoff after a relay failure; `false` when stopped meanwhile.
async fn relay_pause(
    inner: &Inner,
    names: &Names,
    failures: u32,
    error: &BrokerError,
    stop: &mut watch::Receiver<()>,
) -> bool {
    let wait = inner.opts.reconnect.delay(failures);
    tracing::warn!(landing = %names.landing, error = %error, failures, retry_in = ?wait, "moving broker dead letters into the dead-letter stream failed");
    tokio::select! {
        _ = tokio::time::sleep(wait) => true,
        _ = stop.changed() => false,
    }
}

/// Consume the landing queue until stopped (`Ok`) or a failure.
async fn relay_on(
    ch: &Channel,
    inner: &Inner,
    sub: &Subscription,
    names: &Names,
    stop: &mut watch::Receiver<()>,
    failures: &mut u32,
) -> Result<(), BrokerError> {
    ch.basic_qos(RELAY_PREFETCH, BasicQosOptions::default())
        .await
        .map_err(|e| RabbitError::client("basic.qos", e))?;
    let mut consumer = ch
        .basic_consume(
            short("queue", &names.landing)?,
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(|e| RabbitError::client("basic.consume on the landing queue", e))?;
    loop {
        // The stop is only seen between moves: a move in progress finishes (confirm, ack).
        let next = tokio::select! {
            _ = stop.changed() => return Ok(()),
            next = consumer.next() => next,
        };
        let d = match next {
            Some(Ok(d)) => d,
            Some(Err(e)) => return Err(RabbitError::client("consuming the landing queue", e)),
            None => {
                return Err(BrokerError::connection(
                    "the broker cancelled the landing-queue relay",
                ));
            }
        };
        move_landed(inner, sub, names, &d.properties, &d.data).await?;
        ch.basic_ack(d.delivery_tag, BasicAckOptions::default())
            .await
            .map_err(|e| RabbitError::client("basic.ack", e))?;
        tracing::debug!(landing = %names.landing, message_id = ?d.properties.message_id(), "broker dead letter moved into the dead-letter stream");
        *failures = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::no_member_reply;

    #[test]
    fn a_node_without_a_running_member_is_told_from_other_refusals() {
        // The texts RabbitMQ 3.10.8 sends (rabbit_stream_queue, rabbit_channel).
        let q = "queue 'orders.billing.dlq.stream' in vhost '/'";
        assert!(no_member_reply(541, "INTERNAL_ERROR"));
        assert!(no_member_reply(
            406,
            &format!("PRECONDITION_FAILED - queue '{q}' does not have a replica on the local node")
        ));
        assert!(no_member_reply(
            506,
            &format!("RESOURCE_ERROR - {q} does not have a running local replica")
        ));
        assert!(!no_member_reply(
            406,
            "PRECONDITION_FAILED - inequivalent arg 'x-queue-type' for queue"
        ));
        assert!(!no_member_reply(506, "RESOURCE_ERROR - memory alarm"));
        assert!(!no_member_reply(404, "NOT_FOUND - no queue"));
    }
}
