//! The inbox: which message ids a consumer already turned into an effect.

use std::time::Duration;

use async_trait::async_trait;
use reliq_core::{Claim, Inbox, InboxError, MessageId};
use sqlx::{SqliteConnection, SqlitePool};

use crate::{Error, millis, now_ms};

/// Rows deleted per statement by [`SqliteInbox::purge`].
const PURGE_BATCH: i64 = 10_000;

/// The SQLite inbox (`reliq_inbox`). Cheap to clone.
///
/// Two ways to use it — pick one per consumer name:
/// - **transactional** (exactly-once effects): [`SqliteInbox::claim`] in the handler's own
///   transaction, and return [`reliq_core::Duplicate`] on [`Claim::Duplicate`] (see
///   [`Claim::first_or_skip`]);
/// - **runtime-driven**: give it to `ConsumerBuilder::inbox`; the runtime claims before
///   the handler and completes after it. The claim commits on its own, so a crash after
///   the effect but before `complete` lets the message be applied again once the
///   pending claim's lease ([`SqliteInbox::pending_lease`]) expired. Use it where the effect
///   is not in this database.
#[derive(Clone, Debug)]
pub struct SqliteInbox {
    pool: SqlitePool,
    pending_lease: Duration,
}

impl SqliteInbox {
    /// An inbox on `pool` (run [`crate::migrate`] first).
    pub fn new(pool: SqlitePool) -> Self {
        Self {
            pool,
            pending_lease: Duration::from_secs(300),
        }
    }

    /// Runtime-driven style only: how long a claim whose handler is still running (or
    /// died) blocks other deliveries of the same id (default 5 min). Make it longer than
    /// the handler timeout.
    pub fn pending_lease(mut self, lease: Duration) -> Self {
        self.pending_lease = lease;
        self
    }

    /// Claim `id` for `consumer` inside the caller's transaction (`&mut tx`). The claim
    /// becomes durable when that transaction commits and disappears when it rolls back.
    ///
    /// SQLite has one writer at a time: a concurrent transaction claiming the same id
    /// waits (busy timeout) until this one ends, then gets [`Claim::Duplicate`] if this
    /// one committed, [`Claim::First`] if it rolled back. Begin handler transactions with
    /// `pool.begin_with("BEGIN IMMEDIATE")` so they take the write lock up front.
    pub async fn claim(
        &self,
        tx: &mut SqliteConnection,
        consumer: &str,
        id: &MessageId,
    ) -> Result<Claim, Error> {
        let inserted = sqlx::query(
            "INSERT INTO reliq_inbox (consumer, message_id, claimed_at) VALUES (?1, ?2, ?3) \
             ON CONFLICT DO NOTHING RETURNING 1",
        )
        .bind(consumer)
        .bind(id.as_str())
        .bind(now_ms())
        .fetch_optional(tx)
        .await?;
        Ok(Claim::inserted(inserted.is_some()))
    }

    /// Is `id` claimed (and committed, not pending) for `consumer`?
    pub async fn contains(&self, consumer: &str, id: &MessageId) -> Result<bool, Error> {
        let row = sqlx::query(
            "SELECT 1 FROM reliq_inbox \
             WHERE consumer = ?1 AND message_id = ?2 AND pending_until IS NULL",
        )
        .bind(consumer)
        .bind(id.as_str())
        .fetch_optional(&self.pool)
        .await?;
        Ok(row.is_some())
    }

    /// Delete the claims older than `older_than` (all consumers); returns how many.
    ///
    /// `older_than` must exceed the **replay horizon**: the longest time after its first
    /// delivery that a copy of a message can still arrive (redelivery, retry tiers, DLQ
    /// retention plus operator replay, archives). A copy arriving after its id was purged
    /// is applied again. Deletes in batches, so it does not hold long locks.
    pub async fn purge(&self, older_than: Duration) -> Result<u64, Error> {
        let before = now_ms().saturating_sub(millis(older_than)?);
        let mut total = 0;
        loop {
            let deleted = sqlx::query(
                "DELETE FROM reliq_inbox WHERE (consumer, message_id) IN ( \
                     SELECT consumer, message_id FROM reliq_inbox WHERE claimed_at < ?1 LIMIT ?2 \
                 )",
            )
            .bind(before)
            .bind(PURGE_BATCH)
            .execute(&self.pool)
            .await?
            .rows_affected();
            total += deleted;
            if deleted < PURGE_BATCH as u64 {
                return Ok(total);
            }
        }
    }
}

fn store_error(e: impl Into<Error>) -> InboxError {
    InboxError(Box::new(e.into()))
}

impl SqliteInbox {
    /// Run a runtime-style update or delete of one claim.
    async fn settle(
        &self,
        sql: &'static str,
        consumer: &str,
        id: &MessageId,
    ) -> Result<(), InboxError> {
        sqlx::query(sql)
            .bind(consumer)
            .bind(id.as_str())
            .execute(&self.pool)
            .await
            .map_err(store_error)?;
        Ok(())
    }
}

#[async_trait]
impl Inbox for SqliteInbox {
    /// Claim in its own transaction, pending until [`Inbox::complete`]. A pending claim
    /// whose lease expired (its handler died) is taken over.
    async fn claim(&self, consumer: &str, id: &MessageId) -> Result<Claim, InboxError> {
        let now = now_ms();
        let until = now.saturating_add(millis(self.pending_lease).map_err(store_error)?);
        let claimed = sqlx::query(
            "INSERT INTO reliq_inbox (consumer, message_id, claimed_at, pending_until) \
             VALUES (?1, ?2, ?3, ?4) \
             ON CONFLICT (consumer, message_id) DO UPDATE \
                 SET pending_until = excluded.pending_until, claimed_at = excluded.claimed_at \
                 WHERE reliq_inbox.pending_until < ?3 \
             RETURNING 1",
        )
        .bind(consumer)
        .bind(id.as_str())
        .bind(now)
        .bind(until)
        .fetch_optional(&self.pool)
        .await
        .map_err(store_error)?;
        Ok(Claim::inserted(claimed.is_some()))
    }

    async fn complete(&self, consumer: &str, id: &MessageId) -> Result<(), InboxError> {
        self.settle(
            "UPDATE reliq_inbox SET pending_until = NULL \
             WHERE consumer = ?1 AND message_id = ?2",
            consumer,
            id,
        )
        .await
    }

    async fn abandon(&self, consumer: &str, id: &MessageId) -> Result<(), InboxError> {
        self.settle(
            "DELETE FROM reliq_inbox \
             WHERE consumer = ?1 AND message_id = ?2 AND pending_until IS NOT NULL",
            consumer,
            id,
        )
        .await
    }
}
