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
    /// anything, and without counting as a delivery attempt. Each dead letter shows once,
    /// however many copies of it the broker holds (its oldest; see [`CopyIndex`]).
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
    /// returns; the ids of the dead letters removed. Each id removes one dead letter with
    /// that id, the oldest, with every copy of it the broker holds (an id given twice
    /// removes two dead letters of that id, e.g. one parked again after a replay); an id
    /// the DLQ does not hold is skipped, not an error.
    async fn remove(&self, ids: &[MessageId]) -> Result<Vec<MessageId>, BrokerError>;

    /// How many dead letters the DLQ holds (copies of one counted once, where the
    /// backend's docs do not say otherwise) and the oldest one's dead-lettered-at time. The
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

/// Which entries of a DLQ are copies of one dead letter, for readers that fold them.
///
/// A dead letter can be written more than once: its copy was confirmed but the confirm
/// was lost (a broker failover, a DLQ outage) and the consumer held it and sent it again;
/// a consumer crashed between the DLQ copy and settling the source and the message was
/// delivered and dead-lettered again; a producer published the message twice. Those
/// entries are **one dead letter**: a DLQ reader shows it once (its oldest copy), counts
/// it once, and removing it takes every copy — so `reliq dlq stats`, the console and the
/// `reliq_dlq_messages` gauge count failures, not writes, and a replay sends it once.
///
/// Copies of one dead letter are the same message: the same id, key, payload and headers
/// — except the headers of the failure itself ([`FAILURE_HEADERS`]: time, attempts,
/// error, origin), which differ between two parkings and are not compared. The replay
/// marker (`reliq-replay-count`) is compared: a message dead-lettered again after a
/// replay is a new failure, which must outlive the removal of the old one. So are the
/// payload and the other headers: a producer outside reliq may give distinct messages
/// one id, and those stay distinct entries.
///
/// [`FAILURE_HEADERS`]: crate::headers::FAILURE_HEADERS
///
/// `P` is the backend's position of an entry, ordered oldest first (a stream offset;
/// Kafka's (timestamp, partition, offset)). The index holds what the reader has read;
/// whether an entry is still there (not removed, not truncated) is the backend's to say,
/// through the `live` predicates.
#[derive(Debug)]
pub struct CopyIndex<P> {
    by_id: std::collections::HashMap<MessageId, Vec<Copy<P>>>,
}

#[derive(Clone, Debug)]
struct Copy<P> {
    at: P,
    /// Which dead letter of the id: a hash of the message without its failure headers.
    letter: u64,
    dead_lettered_at: Option<SystemTime>,
}

/// The entries of one dead letter a [`CopyIndex::pick`] chose to remove.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Picked<P> {
    /// The dead letter's message id.
    pub id: MessageId,
    /// Where each of its live copies is, oldest first.
    pub copies: Vec<P>,
}

impl<P> Default for CopyIndex<P> {
    fn default() -> Self {
        Self {
            by_id: std::collections::HashMap::new(),
        }
    }
}

impl<P: Ord + Clone> CopyIndex<P> {
    /// An empty index.
    pub fn new() -> Self {
        Self::default()
    }

    /// An entry read at `at`. Adding the same position twice keeps one.
    pub fn add(&mut self, at: P, message: &Message) {
        let copies = self.by_id.entry(message.id().clone()).or_default();
        if copies.iter().any(|c| c.at == at) {
            return;
        }
        copies.push(Copy {
            at,
            letter: letter_of(message),
            dead_lettered_at: DeadLetter::read(message.headers())
                .ok()
                .map(|r| r.dead_lettered_at),
        });
    }

    /// Where the index holds entries with `id`.
    pub fn positions(&self, id: &MessageId) -> impl Iterator<Item = &P> {
        self.by_id.get(id).into_iter().flatten().map(|c| &c.at)
    }

    /// True when the entry with `id` at `at` is the oldest live copy of its dead letter:
    /// the one a browse shows. An entry the index does not hold is shown (nothing is known
    /// to precede it).
    pub fn shows(&self, id: &MessageId, at: &P, live: impl Fn(&MessageId, &P) -> bool) -> bool {
        let Some(copies) = self.by_id.get(id) else {
            return true;
        };
        let Some(this) = copies.iter().find(|c| &c.at == at) else {
            return true;
        };
        !copies
            .iter()
            .any(|c| c.letter == this.letter && c.at < this.at && live(id, &c.at))
    }

    /// The oldest live copy of the oldest dead letter with `id`: what `get` returns.
    pub fn first(&self, id: &MessageId, live: impl Fn(&MessageId, &P) -> bool) -> Option<P> {
        self.by_id
            .get(id)?
            .iter()
            .filter(|c| live(id, &c.at))
            .map(|c| c.at.clone())
            .min()
    }

    /// What removing `ids` takes: each id its oldest live dead letter not taken yet, with
    /// every live copy of it (an id given twice takes two dead letters of that id).
    pub fn pick(&self, ids: &[MessageId], live: impl Fn(&MessageId, &P) -> bool) -> Vec<Picked<P>> {
        let mut taken: std::collections::HashMap<&MessageId, Vec<u64>> =
            std::collections::HashMap::new();
        let mut picked = Vec::new();
        for id in ids {
            let Some(copies) = self.by_id.get(id) else {
                continue;
            };
            let done = taken.entry(id).or_default();
            let oldest = copies
                .iter()
                .filter(|c| !done.contains(&c.letter) && live(id, &c.at))
                .min_by(|a, b| a.at.cmp(&b.at));
            let Some(oldest) = oldest else { continue };
            let letter = oldest.letter;
            done.push(letter);
            let mut at: Vec<P> = copies
                .iter()
                .filter(|c| c.letter == letter && live(id, &c.at))
                .map(|c| c.at.clone())
                .collect();
            at.sort();
            picked.push(Picked {
                id: id.clone(),
                copies: at,
            });
        }
        picked
    }

    /// The live dead letters (each counted once, however many copies) and the oldest
    /// one's dead-lettered-at.
    pub fn count(&self, live: impl Fn(&MessageId, &P) -> bool) -> DeadLetterCount {
        let mut count = DeadLetterCount::default();
        let mut letters: Vec<u64> = Vec::new();
        for (id, copies) in &self.by_id {
            letters.clear();
            for c in copies.iter().filter(|c| live(id, &c.at)) {
                if !letters.contains(&c.letter) {
                    letters.push(c.letter);
                    count.count += 1;
                }
                if let Some(at) = c.dead_lettered_at {
                    count.oldest_dead_lettered_at = Some(match count.oldest_dead_lettered_at {
                        Some(oldest) if oldest <= at => oldest,
                        _ => at,
                    });
                }
            }
        }
        count
    }

    /// Forget the entries for which `keep` is false (truncated, deleted for good).
    pub fn retain(&mut self, keep: impl Fn(&P) -> bool) {
        for copies in self.by_id.values_mut() {
            copies.retain(|c| keep(&c.at));
        }
        self.by_id.retain(|_, copies| !copies.is_empty());
    }
}

/// An index of entries given as (position, message), e.g. every entry of one scan.
impl<'a, P: Ord + Clone> FromIterator<(P, &'a Message)> for CopyIndex<P> {
    fn from_iter<I: IntoIterator<Item = (P, &'a Message)>>(entries: I) -> Self {
        let mut index = Self::new();
        for (at, message) in entries {
            index.add(at, message);
        }
        index
    }
}

/// Which dead letter of its id an entry is a copy of: a hash of its key, payload and
/// headers, the failure headers left out.
fn letter_of(message: &Message) -> u64 {
    use std::hash::{Hash as _, Hasher as _};
    let mut headers: Vec<(&str, &str)> = message
        .headers()
        .iter()
        .filter(|(name, _)| !crate::headers::FAILURE_HEADERS.contains(name))
        .collect();
    headers.sort_unstable();
    let mut hash = std::collections::hash_map::DefaultHasher::new();
    (message.key(), message.payload(), headers).hash(&mut hash);
    hash.finish()
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::headers::REPLAY_COUNT;

    fn copy_of(id: &str, payload: &str) -> Message {
        Message::with_id_and_payload(id, payload.to_owned())
    }

    fn all_live(_: &MessageId, _: &u64) -> bool {
        true
    }

    #[test]
    fn copies_of_one_dead_letter_show_and_count_once_and_go_together() {
        let mut index = CopyIndex::new();
        let a = copy_of("a", "order 1");
        index.add(0, &a);
        index.add(1, &copy_of("b", "order 2"));
        index.add(2, &a); // its confirm was lost: written again
        index.add(2, &a); // read twice: still one entry
        let id = MessageId::from("a");
        assert!(index.shows(&id, &0, all_live));
        assert!(!index.shows(&id, &2, all_live));
        assert_eq!(index.count(all_live).count, 2);
        assert_eq!(
            index.pick(std::slice::from_ref(&id), all_live),
            vec![Picked {
                id: id.clone(),
                copies: vec![0, 2]
            }]
        );
        // With the oldest copy removed, the next one is what a browse shows.
        let removed = |_: &MessageId, at: &u64| *at != 0;
        assert!(index.shows(&id, &2, removed));
        assert_eq!(index.first(&id, removed), Some(2));
    }

    #[test]
    fn a_replayed_dead_letter_and_a_foreign_one_with_the_same_id_stay_apart() {
        let mut index = CopyIndex::new();
        let id = MessageId::from("a");
        index.add(0, &copy_of("a", "order 1"));
        index.add(1, &copy_of("a", "order 1").with_header(REPLAY_COUNT, "1"));
        index.add(2, &copy_of("a", "another payload"));
        assert_eq!(index.count(all_live).count, 3);
        assert!((0..3).all(|at| index.shows(&id, &at, all_live)));
        // One id removes the oldest dead letter only; given twice, the next one too.
        let once = index.pick(std::slice::from_ref(&id), all_live);
        assert_eq!(once.len(), 1);
        assert_eq!(once[0].copies, vec![0]);
        let twice = index.pick(&[id.clone(), id.clone()], all_live);
        let taken: Vec<Vec<u64>> = twice.into_iter().map(|p| p.copies).collect();
        assert_eq!(taken, vec![vec![0], vec![1]]);
    }

    #[test]
    fn failure_headers_differ_between_copies_other_headers_tell_messages_apart() {
        use crate::headers::{ATTEMPT, DEAD_LETTERED_AT, LAST_ERROR};
        let mut index = CopyIndex::new();
        let id = MessageId::from("a");
        let parked = |attempt: &str, at: &str| {
            copy_of("a", "")
                .with_header("fuzz-seq", "1")
                .with_header(ATTEMPT, attempt)
                .with_header(DEAD_LETTERED_AT, at)
                .with_header(LAST_ERROR, format!("attempt {attempt} failed"))
        };
        index.add(0, &parked("1", "2026-12-07T10:00:00.000Z"));
        index.add(1, &parked("2", "2026-12-07T10:05:00.000Z"));
        // Another message a foreign producer gave the same id and payload.
        index.add(2, &copy_of("a", "").with_header("fuzz-seq", "2"));
        assert!(index.shows(&id, &0, all_live));
        assert!(!index.shows(&id, &1, all_live));
        assert!(index.shows(&id, &2, all_live));
        assert_eq!(index.count(all_live).count, 2);
    }

    #[test]
    fn retain_forgets_truncated_entries() {
        let mut index = CopyIndex::new();
        index.add(0, &copy_of("a", "x"));
        index.add(1, &copy_of("a", "x"));
        index.retain(|at| *at >= 1);
        let id = MessageId::from("a");
        assert_eq!(index.positions(&id).collect::<Vec<_>>(), vec![&1]);
        assert!(index.shows(&id, &1, all_live));
        assert_eq!(index.count(all_live).count, 1);
    }
}
