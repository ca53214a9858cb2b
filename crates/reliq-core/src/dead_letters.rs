use std::fmt;
use std::time::SystemTime;

use async_trait::async_trait;

use crate::error::BrokerError;
use crate::headers::{DeadLetter, HeaderError};
use crate::message::{Message, MessageId};

/// Where a browse starts. Opaque text made by the backend (an offset per partition, a
/// stream sequence, an index) — printable, safe to carry in a URL or a CLI argument, and
/// parsed back with [`Cursor::from`]. [`Cursor::start`] is the oldest entry.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Cursor(Option<String>);

impl Cursor {
    /// The oldest entry the DLQ holds.
    pub fn start() -> Self {
        Self(None)
    }

    /// The backend's text, `None` for [`Cursor::start`].
    pub fn as_str(&self) -> Option<&str> {
        self.0.as_deref()
    }

    /// True for [`Cursor::start`].
    pub fn is_start(&self) -> bool {
        self.0.is_none()
    }
}

impl From<String> for Cursor {
    /// A cursor from its text (as [`Cursor`]'s `Display` wrote it); an empty text is
    /// the start.
    fn from(text: String) -> Self {
        Self((!text.is_empty()).then_some(text))
    }
}

impl From<&str> for Cursor {
    fn from(text: &str) -> Self {
        Self::from(text.to_owned())
    }
}

impl fmt::Display for Cursor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0.as_deref().unwrap_or(""))
    }
}

/// One dead letter as the DLQ holds it.
#[derive(Clone, Debug, PartialEq)]
pub struct DeadLetterEntry {
    /// The dead-lettered message: its id, key, payload and headers — the dead-letter
    /// record among them ([`DeadLetterEntry::record`]).
    pub message: Message,
    /// Where the DLQ holds it, in the broker's own terms (`partition 2 offset 17`,
    /// `stream sequence 40`); for people, not parsed.
    pub position: String,
}

impl DeadLetterEntry {
    /// The message id (stable across retry, dead-lettering and replay).
    pub fn id(&self) -> &MessageId {
        self.message.id()
    }

    /// The message's headers.
    pub fn headers(&self) -> &crate::headers::Headers {
        self.message.headers()
    }

    /// The payload bytes.
    pub fn payload(&self) -> &[u8] {
        self.message.payload()
    }

    /// The dead-letter record from the headers. An error for a message that reached the
    /// DLQ without one (a foreign publish); a broker's own delivery-limit move is
    /// translated by the backend into a record with reason `max-deliveries`.
    pub fn record(&self) -> Result<DeadLetter, HeaderError> {
        DeadLetter::read(self.message.headers())
    }
}

/// One page of a browse.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DeadLetterPage {
    /// The entries, oldest first where the broker keeps an order.
    pub entries: Vec<DeadLetterEntry>,
    /// Where the next page starts. At the end, browsing from it again later reads what
    /// was dead-lettered since (where the broker keeps an order).
    pub next: Cursor,
    /// This page reached the end of what the DLQ held when it was read.
    pub at_end: bool,
}

/// How many entries a DLQ holds and since when.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeadLetterCount {
    /// Entries in the DLQ.
    pub count: u64,
    /// The oldest entry's `reliq-dead-lettered-at` (reliq's own record, not the broker's
    /// enqueue time, which some brokers reset on a redrive); `None` when empty or when no
    /// entry carries a readable record.
    pub oldest_dead_lettered_at: Option<SystemTime>,
}

/// A consumer's dead-letter queue, read without consuming it. Made by
/// [`Broker::dead_letters`](crate::broker::Broker::dead_letters).
///
/// # Cancel safety
///
/// Every method is cancel safe: a cursor is an input, never state of the reader, so a
/// browse cancelled (or timed out) mid-read skips nothing — browsing again from the same
/// cursor reads the same entries. A cancelled [`DeadLetters::remove`] may have removed
/// some of its entries and not others; calling it again with the same ids removes the
/// rest (ids no longer there are not an error).
///
/// The dead-letter reader of the seam: what the replay engine and the operator tools use
/// to look at a consumer's dead-letter queue and to take entries out of it.
///
/// A [`DeadLetters`] reader **browses without consuming**: a page read from a [`Cursor`]
/// removes nothing, reorders nothing, redelivers nothing and counts as no delivery
/// attempt, so an operator can look at a DLQ at 3 a.m. as often as they like while the
/// consumer keeps dead-lettering into it. Entries leave the DLQ only through
/// [`DeadLetters::remove`] — after a confirmed replay, or a purge.
///
/// Each backend maps the four operations onto its broker's native mechanism and says how
/// in its mapping table (a log read by offset, a stream read by sequence, a queue
/// scanned under a short lease where the broker has nothing better).
///
/// ```
/// # async fn demo(broker: std::sync::Arc<dyn reliq_core::Broker>) -> Result<(), reliq_core::BrokerError> {
/// use reliq_core::{Cursor, Subscription};
/// let dlq = broker.dead_letters(&Subscription::new("inventory", "orders")).await?;
/// let mut cursor = Cursor::start();
/// loop {
///     let page = dlq.browse(&cursor, 100).await?;
///     for entry in &page.entries {
///         println!("{} at {}: {:?}", entry.id(), entry.position, entry.record().map(|r| r.reason));
///     }
///     if page.at_end {
///         break;
///     }
///     cursor = page.next;
/// }
/// # Ok(()) }
/// ```
#[async_trait]
pub trait DeadLetters: Send + Sync {
    /// Up to `max` entries from `from` on, without removing, reordering or redelivering
    /// anything, and without counting as a delivery attempt.
    async fn browse(&self, from: &Cursor, max: usize) -> Result<DeadLetterPage, BrokerError>;

    /// The entry with message id `id`, if the DLQ holds one (the oldest, if several). The
    /// default browses the whole DLQ; backends that index by id override it.
    async fn get(&self, id: &MessageId) -> Result<Option<DeadLetterEntry>, BrokerError> {
        let mut cursor = Cursor::start();
        loop {
            let page = self.browse(&cursor, SCAN_PAGE).await?;
            if let Some(found) = page.entries.into_iter().find(|e| e.id() == id) {
                return Ok(Some(found));
            }
            if page.at_end {
                return Ok(None);
            }
            cursor = page.next;
        }
    }

    /// Take the entries with these ids out of the DLQ, confirmed by the broker before it
    /// returns; the ids of the entries removed. Each id removes one entry with that id, the
    /// oldest (an id given twice removes two copies); an id the DLQ does not hold is
    /// skipped, not an error.
    async fn remove(&self, ids: &[MessageId]) -> Result<Vec<MessageId>, BrokerError>;

    /// How many entries the DLQ holds and the oldest one's dead-lettered-at time. The
    /// default browses the whole DLQ; backends that know the count override it (and then
    /// read only what the oldest time needs).
    async fn count(&self) -> Result<DeadLetterCount, BrokerError> {
        let mut cursor = Cursor::start();
        let mut count = DeadLetterCount::default();
        loop {
            let page = self.browse(&cursor, SCAN_PAGE).await?;
            count.count += page.entries.len() as u64;
            for entry in &page.entries {
                count.note(entry.headers());
            }
            if page.at_end {
                return Ok(count);
            }
            cursor = page.next;
        }
    }
}

/// How many entries of each id a [`DeadLetters::remove`] still has to remove: for
/// backends that walk their entries and take the ones asked for.
#[derive(Debug, Default)]
pub struct IdCounts(std::collections::HashMap<MessageId, usize>);

impl IdCounts {
    /// One entry per occurrence of each id in `ids`.
    pub fn new(ids: &[MessageId]) -> Self {
        let mut counts = std::collections::HashMap::new();
        for id in ids {
            *counts.entry(id.clone()).or_insert(0) += 1;
        }
        Self(counts)
    }

    /// True (and counted) if an entry with `id` is still to be removed.
    pub fn take(&mut self, id: &MessageId) -> bool {
        match self.0.get_mut(id) {
            Some(n) if *n > 0 => {
                *n -= 1;
                true
            }
            _ => false,
        }
    }

    /// True when nothing is left to remove.
    pub fn is_done(&self) -> bool {
        self.0.values().all(|n| *n == 0)
    }
}

/// Page size of the default `get` and `count` scans.
const SCAN_PAGE: usize = 500;

impl DeadLetterCount {
    /// Take the dead-lettered-at of an entry with these headers into account for the
    /// oldest time (for backends that count natively but find the oldest time by reading
    /// entries).
    pub fn note(&mut self, headers: &crate::headers::Headers) {
        if let Ok(record) = DeadLetter::read(headers) {
            let at = record.dead_lettered_at;
            self.oldest_dead_lettered_at = Some(match self.oldest_dead_lettered_at {
                Some(oldest) if oldest <= at => oldest,
                _ => at,
            });
        }
    }
}

impl fmt::Debug for dyn DeadLetters {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("DeadLetters")
    }
}
