//! The DLQ stream read by stream sequence, without consuming it.
//!
//! Browsing reads with direct gets (`$JS.API.DIRECT.GET`, next message on the DLQ subject
//! from a sequence): no consumer, no ack, no delivery count, nothing moves. A cursor is
//! the next stream sequence to read, so it is an input only and every method is cancel
//! safe. Removal deletes a message by its sequence (`STREAM.MSG.DELETE`, answered by the
//! server); a stream sequence is never reused, so a delete can only ever take the entry
//! that was read there.
//!
//! Copies of one dead letter are not folded here, as the other backends' readers do
//! (`reliq_core::seam::CopyIndex`): the stream drops them at the write, by their
//! `Nats-Msg-Id` (the source message's stream sequence) within the DLQ stream's duplicate
//! window, 10 minutes. A copy held longer than that — its DLQ unavailable for more than
//! ten minutes while the consumer kept sending it — is a second entry, counted and shown.

use async_nats::jetstream::stream::{DirectGetErrorKind, Stream};
use async_nats::jetstream::{self, message::StreamMessage};
use async_trait::async_trait;
use reliq_core::{
    BrokerError, Cursor, DeadLetterCount, DeadLetterEntry, DeadLetterPage, DeadLetters, MessageId,
    seam::IdCounts,
};

use crate::codec::from_nats;
use crate::error::{api, connection};

/// The server's error code for deleting a sequence the stream no longer holds.
const DELETE_FAILED: jetstream::ErrorCode = jetstream::ErrorCode::STREAM_MESSAGE_DELETE_FAILED;

/// A subscription's DLQ stream, browsed by stream sequence.
pub(crate) struct NatsDeadLetters {
    stream: Stream,
    subject: String,
}

impl NatsDeadLetters {
    pub(crate) fn new(stream: Stream, subject: String) -> Self {
        Self { stream, subject }
    }

    /// The first entry at or after `seq`, `None` past the end.
    async fn next_from(&self, seq: u64) -> Result<Option<StreamMessage>, BrokerError> {
        match self
            .stream
            .direct_get_next_for_subject(self.subject.as_str(), Some(seq.max(1)))
            .await
        {
            Ok(raw) => Ok(Some(raw)),
            Err(e) if e.kind() == DirectGetErrorKind::NotFound => Ok(None),
            Err(e) if e.kind() == DirectGetErrorKind::TimedOut => Err(connection(format!(
                "reading the DLQ stream at sequence {seq} (timed out)"
            ))(e)),
            Err(e) => Err(api(format!("reading the DLQ stream at sequence {seq}"))(e)),
        }
    }

    fn entry(raw: StreamMessage) -> DeadLetterEntry {
        let seq = raw.sequence;
        DeadLetterEntry {
            message: from_nats(Some(&raw.headers), raw.payload, format!("dlq:{seq}")),
            position: format!("stream sequence {seq}"),
        }
    }

    /// Delete the entry at `seq`; false if it was already gone.
    async fn delete(&self, seq: u64) -> Result<bool, BrokerError> {
        match self.stream.delete_message(seq).await {
            Ok(deleted) => Ok(deleted),
            Err(e) => match e.kind() {
                jetstream::stream::DeleteMessageErrorKind::JetStream(js)
                    if js.error_code() == DELETE_FAILED =>
                {
                    tracing::debug!(seq, error = %js, "dead letter already removed");
                    Ok(false)
                }
                _ => Err(api(format!(
                    "deleting the dead letter at stream sequence {seq}"
                ))(e)),
            },
        }
    }
}

/// The stream sequence a cursor points at (1 for the start).
fn sequence(cursor: &Cursor) -> Result<u64, BrokerError> {
    match cursor.as_str() {
        None => Ok(1),
        Some(text) => text.parse().map_err(|_| BrokerError::Config {
            field: "cursor".into(),
            reason: format!("`{text}` is not a NATS dead-letter cursor (a stream sequence)"),
        }),
    }
}

#[async_trait]
impl DeadLetters for NatsDeadLetters {
    async fn browse(&self, from: &Cursor, max: usize) -> Result<DeadLetterPage, BrokerError> {
        let mut seq = sequence(from)?;
        let mut entries = Vec::with_capacity(max.min(1024));
        let mut at_end = false;
        while entries.len() < max {
            let Some(raw) = self.next_from(seq).await? else {
                at_end = true;
                break;
            };
            seq = raw.sequence + 1;
            entries.push(Self::entry(raw));
        }
        if !at_end {
            // A full page: at the end only if nothing follows it now.
            let last = self
                .stream
                .get_info()
                .await
                .map_err(api("reading the DLQ stream info"))?
                .state
                .last_sequence;
            at_end = seq > last;
        }
        let next = if entries.is_empty() {
            from.clone()
        } else {
            Cursor::from(seq.to_string())
        };
        Ok(DeadLetterPage {
            entries,
            next,
            at_end,
        })
    }

    async fn remove(&self, ids: &[MessageId]) -> Result<Vec<MessageId>, BrokerError> {
        let mut wanted = IdCounts::new(ids);
        let mut removed = Vec::new();
        let mut seq = 1;
        // Oldest first, so an id held twice loses its oldest copy.
        while !wanted.is_done() {
            let Some(raw) = self.next_from(seq).await? else {
                break;
            };
            seq = raw.sequence + 1;
            let entry = Self::entry(raw);
            if wanted.take(entry.id()) && self.delete(seq - 1).await? {
                removed.push(entry.id().clone());
            }
        }
        Ok(removed)
    }

    async fn count(&self) -> Result<DeadLetterCount, BrokerError> {
        let state = self
            .stream
            .get_info()
            .await
            .map_err(api("reading the DLQ stream info"))?
            .state;
        let mut count = DeadLetterCount {
            count: state.messages,
            oldest_dead_lettered_at: None,
        };
        // Entries are in dead-lettering order: the first with a record is the oldest
        // (normally the very first; a foreign publish without one is stepped over).
        let mut seq = state.first_sequence;
        while count.count > 0 && count.oldest_dead_lettered_at.is_none() {
            let Some(raw) = self.next_from(seq).await? else {
                break;
            };
            seq = raw.sequence + 1;
            count.note(Self::entry(raw).headers());
        }
        Ok(count)
    }
}
