//! The outbox: messages written in a business transaction, published by a relay.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use reliq_core::{
    Broker, Destination, Message, OutboxBacklog, OutboxError, OutboxRecord, OutboxStore, Relay,
    RelayBuilder,
    seam::{OutboxWakeup, encode_headers},
};
use sqlx::{Database, Pool};

use crate::driver::{Bind, Driver};
use crate::{dialect::StoreSql, error::Error};

/// The outbox (`reliq_outbox`) on database `S` (`PgOutbox`, `SqliteOutbox`). Cheap to
/// clone.
///
/// Rows are **marked sent**, not deleted, when the broker confirmed them: the row records
/// what was published and when, and its unique id keeps [`Outbox::enqueue`] idempotent
/// for as long as it is kept. A partial index on unsent rows keeps the relay's claim as
/// cheap as with a table of pending rows only; [`Outbox::purge_sent`] bounds the table.
///
/// As an [`OutboxStore`], a claim is one statement that leases rows to the relay
/// (`lease_owner`, `leased_until`); a relay that dies leaves a lease that expires, and
/// the rows are then published again, with the same ids.
#[derive(Debug)]
pub struct Outbox<S: StoreSql> {
    pool: Pool<S::Db>,
}

// Not derived: that would ask `S::Db: Clone` of the database type.
impl<S: StoreSql> Clone for Outbox<S> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
        }
    }
}

impl<S: StoreSql> Outbox<S> {
    /// An outbox on `pool` (run the store's `migrate` first).
    pub fn new(pool: Pool<S::Db>) -> Self {
        Self { pool }
    }

    /// Write `message` for `destination` inside the caller's transaction (`&mut tx`): it
    /// is published after that transaction commits, never if it rolls back. Returns
    /// `false` (and writes nothing) when a row with this message id already exists — the
    /// id is the message's identity, so enqueueing it again is a no-op.
    pub async fn enqueue(
        &self,
        tx: &mut <S::Db as Database>::Connection,
        destination: &Destination,
        message: &Message,
    ) -> Result<bool, Error<S>> {
        let headers = encode_headers(message.headers());
        let statement = sqlx::query(S::OUTBOX_ENQUEUE)
            .text(message.id().as_str())
            .text(&destination.topic)
            .opt_text(destination.route.as_deref())
            .opt_text(message.key())
            .bytes(message.payload().as_ref())
            .text(&headers);
        let inserted = S::bind_now(statement, S::now())
            .fetch_optional(S::Db::on_conn(tx))
            .await?;
        Ok(inserted.is_some())
    }

    /// A relay builder for this outbox and `broker` (see [`reliq_core::OutboxStore`]).
    pub fn relay(&self, broker: Arc<dyn Broker>) -> RelayBuilder {
        Relay::builder(Arc::new(self.clone()), broker)
    }

    /// How many rows are not sent yet (the relay's backlog).
    pub async fn unsent(&self) -> Result<u64, Error<S>> {
        let row = sqlx::query(S::OUTBOX_UNSENT)
            .fetch_one(S::Db::on_pool(&self.pool))
            .await?;
        let n = S::Db::first_int(&row)?;
        Ok(u64::try_from(n).unwrap_or_default())
    }

    /// The unsent rows: how many, and how long the oldest has waited.
    pub async fn backlog(&self) -> Result<OutboxBacklog, Error<S>> {
        let row = S::bind_now(sqlx::query(S::OUTBOX_BACKLOG), S::now())
            .fetch_one(S::Db::on_pool(&self.pool))
            .await?;
        let (rows, oldest_ms) = S::Db::two_ints(&row)?;
        Ok(OutboxBacklog {
            rows: u64::try_from(rows).unwrap_or_default(),
            oldest_age: Duration::from_millis(u64::try_from(oldest_ms).unwrap_or_default()),
        })
    }

    /// Delete rows sent more than `older_than` ago; returns how many. Unsent rows are
    /// never deleted.
    pub async fn purge_sent(&self, older_than: Duration) -> Result<u64, Error<S>> {
        let result = sqlx::query(S::OUTBOX_PURGE_SENT)
            .bind(S::earlier(S::now(), older_than)?)
            .execute(S::Db::on_pool(&self.pool))
            .await?;
        Ok(S::rows_affected(&result))
    }
}

#[async_trait]
impl<S: StoreSql> OutboxStore for Outbox<S> {
    async fn claim_batch(
        &self,
        owner: &str,
        limit: usize,
        lease: Duration,
    ) -> Result<Vec<OutboxRecord>, OutboxError> {
        let now = S::now();
        let statement = sqlx::query(S::OUTBOX_CLAIM)
            .text(owner)
            .bind(S::later(now, lease).map_err(Error::<S>::from)?)
            .int(i64::try_from(limit).unwrap_or(i64::MAX));
        let rows = S::bind_now(statement, now)
            .fetch_all(S::Db::on_pool(&self.pool))
            .await
            .map_err(Error::<S>::from)?;
        rows.iter()
            .map(|row| {
                let columns = S::Db::outbox_columns(row).map_err(Error::<S>::from)?;
                OutboxRecord::from_columns(columns)
            })
            .collect()
    }

    async fn mark_sent(&self, _owner: &str, seqs: &[i64]) -> Result<(), OutboxError> {
        let statement = sqlx::query(S::OUTBOX_MARK_SENT).bind(S::seqs(seqs));
        S::bind_now(statement, S::now())
            .execute(S::Db::on_pool(&self.pool))
            .await
            .map_err(Error::<S>::from)?;
        Ok(())
    }

    async fn release(&self, owner: &str, seqs: &[i64], error: &str) -> Result<(), OutboxError> {
        sqlx::query(S::OUTBOX_RELEASE)
            .text(owner)
            .bind(S::seqs(seqs))
            .text(error)
            .execute(S::Db::on_pool(&self.pool))
            .await
            .map_err(Error::<S>::from)?;
        Ok(())
    }

    async fn backlog(&self) -> Result<Option<OutboxBacklog>, OutboxError> {
        Ok(Some(Outbox::backlog(self).await?))
    }

    async fn listen(&self) -> Result<Box<dyn OutboxWakeup>, OutboxError> {
        Ok(S::listen(&self.pool).await.map_err(Error::<S>::from)?)
    }

    fn default_poll_interval(&self) -> Duration {
        S::POLL_INTERVAL
    }
}
