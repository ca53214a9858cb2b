//! The inbox: which message ids a consumer already turned into an effect.

use std::time::Duration;

use async_trait::async_trait;
use reliq_core::{Claim, Inbox, InboxError, MessageId};
use sqlx::{PgConnection, PgPool};

use crate::{Error, seconds};

/// Rows deleted per statement by [`PgInbox::purge`].
const PURGE_BATCH: i64 = 10_000;

/// The PostgreSQL inbox (`reliq_inbox`). Cheap to clone.
///
/// Two ways to use it — pick one per consumer name:
/// - **transactional** (exactly-once effects): [`PgInbox::claim`] in the handler's own
///   transaction, and return [`reliq_core::Duplicate`] on [`Claim::Duplicate`] (see
///   [`Claim::first_or_skip`]);
/// - **runtime-driven**: give it to `ConsumerBuilder::inbox`; the runtime claims before
///   the handler and completes after it. The claim commits on its own, so a crash after
///   the effect but before `complete` lets the message be applied again once the
///   pending claim's lease ([`PgInbox::pending_lease`]) expired. Use it where the effect
///   is not in this database.
#[derive(Clone, Debug)]
pub struct PgInbox {
    pool: PgPool,
    pending_lease: Duration,
}

impl PgInbox {
    /// An inbox on `pool` (run [`crate::migrate`] first).
    pub fn new(pool: PgPool) -> Self {
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
    /// A concurrent transaction claiming the same id waits for this one: it gets
    /// [`Claim::Duplicate`] if this one commits, [`Claim::First`] if it rolls back.
    pub async fn claim(
        &self,
        tx: &mut PgConnection,
        consumer: &str,
        id: &MessageId,
    ) -> Result<Claim, Error> {
        let inserted = sqlx::query(
            "INSERT INTO reliq_inbox (consumer, message_id) VALUES ($1, $2) \
             ON CONFLICT DO NOTHING RETURNING 1",
        )
        .bind(consumer)
        .bind(id.as_str())
        .fetch_optional(tx)
        .await?;
        Ok(Claim::inserted(inserted.is_some()))
    }

    /// Is `id` claimed (and committed, not pending) for `consumer`?
    pub async fn contains(&self, consumer: &str, id: &MessageId) -> Result<bool, Error> {
        let row = sqlx::query(
            "SELECT 1 FROM reliq_inbox \
             WHERE consumer = $1 AND message_id = $2 AND pending_until IS NULL",
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
        let secs = seconds(older_than)?;
        let mut total = 0;
        loop {
            let deleted = sqlx::query(
                "DELETE FROM reliq_inbox i USING ( \
                     SELECT consumer, message_id FROM reliq_inbox \
                     WHERE claimed_at < now() - make_interval(secs => $1) LIMIT $2 \
                 ) old \
                 WHERE i.consumer = old.consumer AND i.message_id = old.message_id",
            )
            .bind(secs)
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

impl PgInbox {
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
impl Inbox for PgInbox {
    /// Claim in its own transaction, pending until [`Inbox::complete`]. A pending claim
    /// whose lease expired (its handler died) is taken over.
    async fn claim(&self, consumer: &str, id: &MessageId) -> Result<Claim, InboxError> {
        let lease = seconds(self.pending_lease).map_err(store_error)?;
        let claimed = sqlx::query(
            "INSERT INTO reliq_inbox (consumer, message_id, pending_until) \
             VALUES ($1, $2, now() + make_interval(secs => $3)) \
             ON CONFLICT (consumer, message_id) DO UPDATE \
                 SET pending_until = EXCLUDED.pending_until, claimed_at = now() \
                 WHERE reliq_inbox.pending_until < now() \
             RETURNING 1",
        )
        .bind(consumer)
        .bind(id.as_str())
        .bind(lease)
        .fetch_optional(&self.pool)
        .await
        .map_err(store_error)?;
        Ok(Claim::inserted(claimed.is_some()))
    }

    async fn complete(&self, consumer: &str, id: &MessageId) -> Result<(), InboxError> {
        self.settle(
            "UPDATE reliq_inbox SET pending_until = NULL \
             WHERE consumer = $1 AND message_id = $2",
            consumer,
            id,
        )
        .await
    }

    async fn abandon(&self, consumer: &str, id: &MessageId) -> Result<(), InboxError> {
        self.settle(
            "DELETE FROM reliq_inbox \
             WHERE consumer = $1 AND message_id = $2 AND pending_until IS NOT NULL",
            consumer,
            id,
        )
        .await
    }
}
