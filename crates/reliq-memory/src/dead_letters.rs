//! A consumer's dead-letter queue, read in place.

use std::sync::Arc;

use async_trait::async_trait;
use reliq_core::{
    BrokerError, Cursor, DeadLetterCount, DeadLetterEntry, DeadLetterPage, DeadLetters, MessageId,
    seam::IdCounts,
};

use crate::queue::{Entry, Queue};

/// A consumer's dead-letter queue, read in place: entries stay in the queue in the order
/// they arrived; the cursor is the position of the last entry read.
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
        let mut entries = Vec::new();
        let mut last = after;
        let mut at_end = true;
        for e in s.ready.iter().filter(|e| e.seq > after) {
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
        let mut wanted = IdCounts::new(ids);
        let mut s = self.dlq.lock();
        let mut removed = Vec::new();
        s.ready.retain(|e| {
            let take = wanted.take(e.message.id());
            if take {
                removed.push(e.message.id().clone());
            }
            !take
        });
        Ok(removed)
    }

    async fn count(&self) -> Result<DeadLetterCount, BrokerError> {
        let s = self.dlq.lock();
        let mut count = DeadLetterCount {
            count: s.ready.len() as u64,
            oldest_dead_lettered_at: None,
        };
        for e in &s.ready {
            count.note(e.message.headers());
        }
        Ok(count)
    }
}
