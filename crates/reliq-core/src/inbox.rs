use crate::sync::lock;
use std::collections::HashMap;
use std::error::Error as StdError;
use std::sync::Mutex;

use async_trait::async_trait;

use crate::message::MessageId;

/// Result of a claim.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Claim {
    /// First time this consumer sees the id: apply the effect.
    First,
    /// Already applied (or being applied right now by another delivery of the same id):
    /// acknowledge and skip.
    Duplicate,
}

impl Claim {
    /// The claim of a store's insert: [`Claim::First`] if it inserted the row,
    /// [`Claim::Duplicate`] if the row was already there.
    pub fn inserted(inserted: bool) -> Self {
        if inserted {
            Claim::First
        } else {
            Claim::Duplicate
        }
    }

    /// `Ok(())` for [`Claim::First`], `Err(Duplicate)` for [`Claim::Duplicate`]: lets a
    /// handler write `claim(…).await?.first_or_skip()?` and hand a duplicate to the
    /// runtime.
    pub fn first_or_skip(self) -> Result<(), Duplicate> {
        match self {
            Claim::First => Ok(()),
            Claim::Duplicate => Err(Duplicate),
        }
    }
}

/// A handler's answer "this message was already applied: acknowledge it and skip it".
///
/// Return it — alone, or anywhere in the `source()` chain of the error the handler
/// returns, like the classification markers — when a transactional inbox claim answered
/// [`Claim::Duplicate`]. The runtime then acknowledges the delivery, does not retry or
/// dead-letter it, and counts it in `StatsSnapshot::duplicates` and
/// `reliq_messages_duplicate_total`, as it does for duplicates its own [`Inbox`] finds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, thiserror::Error)]
#[error("already handled by this consumer (inbox duplicate)")]
pub struct Duplicate;

impl Duplicate {
    /// Is a [`Duplicate`] anywhere in `error`'s `source()` chain?
    pub fn is_in(error: &(dyn StdError + 'static)) -> bool {
        let mut link = Some(error);
        while let Some(e) = link {
            if e.is::<Duplicate>() {
                return true;
            }
            link = e.source();
        }
        false
    }
}

/// The inbox store failed.
#[derive(Debug, thiserror::Error)]
#[error("inbox store error: {0}")]
pub struct InboxError(#[from] pub crate::classify::BoxError);

/// An inbox store.
///
/// Idempotent consumers: the inbox.
///
/// The inbox records which message ids a consumer has already turned into an effect, so
/// a redelivered or replayed copy is acknowledged and skipped instead of applied twice.
///
/// A durable inbox (reliq-postgres, reliq-sqlite) claims the id **inside the business
/// transaction** (`INSERT … ON CONFLICT DO NOTHING RETURNING 1`), so the claim and the
/// effect commit or roll back together. The runtime-driven protocol below models the same
/// thing for stores that cannot share the handler's transaction: `claim` before the
/// handler, `complete` after it succeeded, `abandon` when it failed (the retry must be
/// able to claim again).
///
/// With the transactional style the handler itself learns that a message is a duplicate
/// (its claim answered [`Claim::Duplicate`]); it returns the [`Duplicate`] marker, and the
/// runtime acknowledges the delivery, does not retry it, and counts it as a duplicate:
///
/// ```
/// use reliq_core::{BoxError, Claim, Delivery};
/// # async fn claim_in_tx(_: &Delivery) -> Result<Claim, BoxError> { Ok(Claim::First) }
/// async fn handle(d: Delivery) -> Result<(), BoxError> {
///     // let mut tx = pool.begin().await?;
///     claim_in_tx(&d).await?.first_or_skip()?;   // a duplicate returns `Duplicate` here
///     // … the business change, in the same transaction …
///     // tx.commit().await?;
///     Ok(())
/// }
/// ```
#[async_trait]
pub trait Inbox: Send + Sync + 'static {
    /// Claim `(consumer, id)`.
    async fn claim(&self, consumer: &str, id: &MessageId) -> Result<Claim, InboxError>;
    /// The effect for a claimed id is durable.
    async fn complete(&self, consumer: &str, id: &MessageId) -> Result<(), InboxError>;
    /// The effect for a claimed id did not happen; forget the claim.
    async fn abandon(&self, consumer: &str, id: &MessageId) -> Result<(), InboxError>;
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Pending,
    Done,
}

/// An in-memory inbox, for tests and the embedded broker. Unbounded: it keeps every id
/// it completed (purge by dropping it).
#[derive(Debug, Default)]
pub struct MemoryInbox {
    seen: Mutex<HashMap<(String, MessageId), State>>,
}

impl MemoryInbox {
    /// An empty inbox.
    pub fn new() -> Self {
        Self::default()
    }

    /// How many ids are recorded as done for `consumer`.
    pub fn completed(&self, consumer: &str) -> usize {
        self.lock()
            .iter()
            .filter(|((c, _), s)| c == consumer && **s == State::Done)
            .count()
    }

    /// Is `id` recorded as done for `consumer`?
    pub fn contains(&self, consumer: &str, id: &MessageId) -> bool {
        self.lock().get(&(consumer.to_owned(), id.clone())) == Some(&State::Done)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(String, MessageId), State>> {
        // A panic while holding this lock cannot leave the map half-updated (single
        // insert/remove), so a poisoned lock is still consistent.
        lock(&self.seen)
    }
}

#[async_trait]
impl Inbox for MemoryInbox {
    async fn claim(&self, consumer: &str, id: &MessageId) -> Result<Claim, InboxError> {
        let mut seen = self.lock();
        let key = (consumer.to_owned(), id.clone());
        if seen.contains_key(&key) {
            return Ok(Claim::Duplicate);
        }
        seen.insert(key, State::Pending);
        Ok(Claim::First)
    }

    async fn complete(&self, consumer: &str, id: &MessageId) -> Result<(), InboxError> {
        self.lock()
            .insert((consumer.to_owned(), id.clone()), State::Done);
        Ok(())
    }

    async fn abandon(&self, consumer: &str, id: &MessageId) -> Result<(), InboxError> {
        let mut seen = self.lock();
        let key = (consumer.to_owned(), id.clone());
        if seen.get(&key) == Some(&State::Pending) {
            seen.remove(&key);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn claim_complete_abandon() {
        let inbox = MemoryInbox::new();
        let id = MessageId::from("m1");
        assert_eq!(inbox.claim("c", &id).await.unwrap(), Claim::First);
        assert_eq!(inbox.claim("c", &id).await.unwrap(), Claim::Duplicate);
        assert_eq!(inbox.claim("other", &id).await.unwrap(), Claim::First);
        inbox.abandon("c", &id).await.unwrap();
        assert_eq!(inbox.claim("c", &id).await.unwrap(), Claim::First);
        inbox.complete("c", &id).await.unwrap();
        inbox.abandon("c", &id).await.unwrap();
        assert_eq!(inbox.claim("c", &id).await.unwrap(), Claim::Duplicate);
        assert!(inbox.contains("c", &id));
        assert_eq!(inbox.completed("c"), 1);
    }

    #[derive(Debug, thiserror::Error)]
    #[error("handler failed")]
    struct Wrapper(#[source] Duplicate);

    #[test]
    fn duplicate_is_found_through_the_source_chain() {
        assert_eq!(Claim::First.first_or_skip(), Ok(()));
        assert_eq!(Claim::Duplicate.first_or_skip(), Err(Duplicate));
        let direct: crate::classify::BoxError = Box::new(Duplicate);
        assert!(Duplicate::is_in(direct.as_ref()));
        let wrapped: crate::classify::BoxError =
            Box::new(crate::classify::Transient::new(Wrapper(Duplicate)));
        assert!(Duplicate::is_in(wrapped.as_ref()));
        // Text never counts, only the type.
        let text: crate::classify::BoxError =
            "already handled by this consumer (inbox duplicate)".into();
        assert!(!Duplicate::is_in(text.as_ref()));
    }
}
