//! The inbox: which message ids a consumer already turned into an effect.

use std::time::Duration;

use async_trait::async_trait;
use reliq_core::{Claim, InboxError, MessageId};
use sqlx::{Database, Pool};

use crate::driver::{Bind, Driver};
use crate::{dialect::StoreSql, error::Error};

/// Rows deleted per statement by [`Inbox::purge`].
const PURGE_BATCH: i64 = 10_000;

/// The inbox (`reliq_inbox`) on database `S` (`PgInbox`, `SqliteInbox`). Cheap to clone.
///
/// Two ways to use it — pick one per consumer name:
/// - **transactional** (exactly-once effects): [`Inbox::claim`] in the handler's own
///   transaction, and return [`reliq_core::Duplicate`] on [`Claim::Duplicate`] (see
///   [`Claim::first_or_skip`]);
/// - **runtime-driven**: give it to `ConsumerBuilder::inbox`; the runtime claims before
///   the handler and completes after it. The claim commits on its own, so a crash after
///   the effect but before `complete` lets the message be applied again once the
///   pending claim's lease ([`Inbox::pending_lease`]) expired. Use it where the effect
///   is not in this database.
#[derive(Debug)]
pub struct Inbox<S: StoreSql> {
    pool: Pool<S::Db>,
    pending_lease: Duration,
}

// Not derived: that would ask `S::Db: Clone` of the database type.
impl<S: StoreSql> Clone for Inbox<S> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
            pending_lease: self.pending_lease,
        }
    }
}

impl<S: StoreSql> Inbox<S> {
    /// An inbox on `pool` (run the store's `migrate` first).
    pub fn new(pool: Pool<S::Db>) -> Self {
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
    /// A concurrent transaction claiming the same id waits until this one ends, then
    /// gets [`Claim::Duplicate`] if this one committed, [`Claim::First`] if it rolled
    /// back.
    pub async fn claim(
        &self,
        tx: &mut <S::Db as Database>::Connection,
        consumer: &str,
        id: &MessageId,
    ) -> Result<Claim, Error<S>> {
        let statement = sqlx::query(S::INBOX_CLAIM).text(consumer).text(id.as_str());
        let inserted = S::bind_now(statement, S::now())
            .fetch_optional(S::Db::on_conn(tx))
            .await?;
        Ok(Claim::inserted(inserted.is_some()))
    }

    /// Is `id` claimed (and committed, not pending) for `consumer`?
    pub async fn contains(&self, consumer: &str, id: &MessageId) -> Result<bool, Error<S>> {
        let row = sqlx::query(S::INBOX_CONTAINS)
            .text(consumer)
            .text(id.as_str())
            .fetch_optional(S::Db::on_pool(&self.pool))
            .await?;
        Ok(row.is_some())
    }

    /// Delete the claims older than `older_than` (all consumers); returns how many.
    ///
    /// `older_than` must exceed the **replay horizon**: the longest time after its first
    /// delivery that a copy of a message can still arrive (redelivery, retry tiers, DLQ
    /// retention plus operator replay, archives). A copy arriving after its id was purged
    /// is applied again. Deletes in batches, so it does not hold long locks.
    pub async fn purge(&self, older_than: Duration) -> Result<u64, Error<S>> {
        let before = S::earlier(S::now(), older_than)?;
        let mut total = 0;
        loop {
            let result = sqlx::query(S::INBOX_PURGE)
                .bind(before)
                .int(PURGE_BATCH)
                .execute(S::Db::on_pool(&self.pool))
                .await?;
            let deleted = S::rows_affected(&result);
            total += deleted;
            if deleted < PURGE_BATCH as u64 {
                return Ok(total);
            }
        }
    }

    /// Run a runtime-style update or delete of one claim.
    async fn settle(
        &self,
        sql: &'static str,
        consumer: &str,
        id: &MessageId,
    ) -> Result<(), InboxError> {
        sqlx::query(sql)
            .text(consumer)
            .text(id.as_str())
            .execute(S::Db::on_pool(&self.pool))
            .await
            .map_err(Error::<S>::from)?;
        Ok(())
    }
}

#[async_trait]
impl<S: StoreSql> reliq_core::Inbox for Inbox<S> {
    /// Claim in its own transaction, pending until [`reliq_core::Inbox::complete`]. A
    /// pending claim whose lease expired (its handler died) is taken over.
    async fn claim(&self, consumer: &str, id: &MessageId) -> Result<Claim, InboxError> {
        let now = S::now();
        let until = S::later(now, self.pending_lease).map_err(Error::<S>::from)?;
        let statement = sqlx::query(S::INBOX_CLAIM_PENDING)
            .text(consumer)
            .text(id.as_str())
            .bind(until);
        let claimed = S::bind_now(statement, now)
            .fetch_optional(S::Db::on_pool(&self.pool))
            .await
            .map_err(Error::<S>::from)?;
        Ok(Claim::inserted(claimed.is_some()))
    }

    async fn complete(&self, consumer: &str, id: &MessageId) -> Result<(), InboxError> {
        self.settle(S::INBOX_COMPLETE, consumer, id).await
    }

    async fn abandon(&self, consumer: &str, id: &MessageId) -> Result<(), InboxError> {
        self.settle(S::INBOX_ABANDON, consumer, id).await
    }
}
