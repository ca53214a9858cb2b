//! A consumer's dead-letter queue, read in place.

use std::sync::Arc;

use async_trait::async_trait;
use reliq_core::{
    BrokerError, Cursor, DeadLetterCount, DeadLetterEntry, DeadLetterPage, DeadLetters, MessageId,
    seam::CopyIndex,
};

use crate::queue::{Entry, Queue};

/// A consumer's dead-letter queue, read in place: entries stay in the queue in the order
/// they arrived; the cursor is the position of the last entry read. Copies of one dead
/// letter (a message published twice, delivered again after a dropped consumer) are
/// folded by a [`CopyIndex`] of the queue, built for each call.
pub(crate) struct MemoryDeadLetters {
    pub(crate) dlq: Arc<Queue>,
}

impl MemoryDeadLetters {
    fn entry(e: &Entry) -> DeadLetterEntry {
        DeadLetterEntry {
            message: e.message.clone(),
            position: format!("position {}", e.seq),
        }
    }
}

#[async_trait]
impl DeadLetters for MemoryDeadLetters {
    async fn browse(&self, from: &Cursor, max: usize) -> Result<DeadLetterPage, BrokerError> {
        let after: u64 = match from.as_str() {
            None => 0,
            Some(text) => text.parse().map_err(|_| BrokerError::Config {
                field: "cursor".into(),
                reason: format!("`{text}` is not a memory dead-letter cursor (a position)"),
            })?,
        };
        let s = self.dlq.lock();
        let index = index_of(&s.ready);
        let mut entries = Vec::new();
        let mut last = after;
        let mut at_end = true;
        let shown = s
            .ready
            .iter()
            .filter(|e| e.seq > after && index.shows(e.message.id(), &e.seq, |_, _| true));
        for e in shown {
            if entries.len() == max {
                at_end = false;
                break;
            }
            entries.push(Self::entry(e));
            last = e.seq;
        }
        Ok(DeadLetterPage {
            entries,
            next: Cursor::from(last.to_string()),
            at_end,
        })
    }

    async fn get(&self, id: &MessageId) -> Result<Option<DeadLetterEntry>, BrokerError> {
        let s = self.dlq.lock();
        Ok(s.ready
            .iter()
            .find(|e| e.message.id() == id)
            .map(Self::entry))
    }

    async fn remove(&self, ids: &[MessageId]) -> Result<Vec<MessageId>, BrokerError> {
        let mut s = self.dlq.lock();
        let picked = index_of(&s.ready).pick(ids, |_, _| true);
        let taken: std::collections::HashSet<u64> = picked
            .iter()
            .flat_map(|p| p.copies.iter().copied())
            .collect();
        s.ready.retain(|e| !taken.contains(&e.seq));
        Ok(picked.into_iter().map(|p| p.id).collect())
    }

    async fn count(&self) -> Result<DeadLetterCount, BrokerError> {
        let s = self.dlq.lock();
        Ok(index_of(&s.ready).count(|_, _| true))
    }
}

/// Every entry of the queue, by position.
fn index_of<'a>(entries: impl IntoIterator<Item = &'a Entry>) -> CopyIndex<u64> {
    entries.into_iter().map(|e| (e.seq, &e.message)).collect()
}
