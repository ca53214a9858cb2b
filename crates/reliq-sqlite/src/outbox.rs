//! The outbox: messages written in a business transaction, published by a relay.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use reliq_core::outbox::{
    OutboxColumns, OutboxError, OutboxRecord, OutboxStore, RelayBuilder, encode_headers,
};
use reliq_core::{Broker, Destination, Message, Relay};
use sqlx::{SqliteConnection, SqlitePool};

use crate::{Error, millis, now_ms};

/// The SQLite outbox (`reliq_outbox`). Cheap to clone.
///
/// Rows are **marked sent**, not deleted, when the broker confirmed them: the row records
/// what was published and when, and its unique id keeps [`SqliteOutbox::enqueue`] idempotent
/// for as long as it is kept. A partial index on unsent rows keeps the relay's claim as
/// cheap as with a table of pending rows only; [`SqliteOutbox::purge_sent`] bounds the table.
///
/// As an [`OutboxStore`], a claim is one `UPDATE … WHERE seq IN (SELECT … ORDER BY seq
/// LIMIT n) RETURNING …` that sets `lease_owner` and `leased_until`. SQLite runs one
/// writer at a time, so two relays (threads or processes on one database file) never
/// claim the same row while its lease holds. A relay that dies leaves a lease that
/// expires; the rows are then published again, with the same ids. Leases use this
/// machine's clock (SQLite is local).
#[derive(Clone, Debug)]
pub struct SqliteOutbox {
    pool: SqlitePool,
}

impl SqliteOutbox {
    /// An outbox on `pool` (run [`crate::migrate`] first).
    pub fn new(pool: SqlitePool) -> Self {
        Self { pool }
    }

    /// Write `message` for `destination` inside the caller's transaction (`&mut tx`): it
    /// is published after that transaction commits, never if it rolls back. Returns
    /// `false` (and writes nothing) when a row with this message id already exists — the
    /// id is the message's identity, so enqueueing it again is a no-op.
    pub async fn enqueue(
        &self,
        tx: &mut SqliteConnection,
        destination: &Destination,
        message: &Message,
    ) -> Result<bool, Error> {
        let inserted = sqlx::query(
            "INSERT INTO reliq_outbox \
             (message_id, topic, route, message_key, payload, headers, created_at) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7) \
             ON CONFLICT (message_id) DO NOTHING RETURNING seq",
        )
        .bind(message.id().as_str())
        .bind(&destination.topic)
        .bind(destination.route.as_deref())
        .bind(message.key())
        .bind(message.payload().as_ref())
        .bind(encode_headers(message.headers()))
        .bind(now_ms())
        .fetch_optional(tx)
        .await?;
        Ok(inserted.is_some())
    }

    /// A relay builder for this outbox and `broker` (see [`reliq_core::outbox`]).
    pub fn relay(&self, broker: Arc<dyn Broker>) -> RelayBuilder {
        Relay::builder(Arc::new(self.clone()), broker)
    }

    /// How many rows are not sent yet (the relay's backlog).
    pub async fn unsent(&self) -> Result<u64, Error> {
        let (n,): (i64,) =
            sqlx::query_as("SELECT count(*) FROM reliq_outbox WHERE sent_at IS NULL")
                .fetch_one(&self.pool)
                .await?;
        Ok(u64::try_from(n).unwrap_or_default())
    }

    /// Delete rows sent more than `older_than` ago; returns how many. Unsent rows are
    /// never deleted.
    pub async fn purge_sent(&self, older_than: Duration) -> Result<u64, Error> {
        let before = now_ms().saturating_sub(millis(older_than)?);
        let deleted =
            sqlx::query("DELETE FROM reliq_outbox WHERE sent_at IS NOT NULL AND sent_at < ?1")
                .bind(before)
                .execute(&self.pool)
                .await?;
        Ok(deleted.rows_affected())
    }
}

/// A JSON array of row numbers, for `json_each` (SQLite has no array parameters).
fn json_list(seqs: &[i64]) -> String {
    let items: Vec<String> = seqs.iter().map(i64::to_string).collect();
    format!("[{}]", items.join(","))
}

fn store_error(e: impl Into<Error>) -> OutboxError {
    OutboxError(Box::new(e.into()))
}

#[async_trait]
impl OutboxStore for SqliteOutbox {
    async fn claim_batch(
        &self,
        owner: &str,
        limit: usize,
        lease: Duration,
    ) -> Result<Vec<OutboxRecord>, OutboxError> {
        let now = now_ms();
        let until = now.saturating_add(millis(lease).map_err(store_error)?);
        let rows: Vec<OutboxColumns> = sqlx::query_as(
            "UPDATE reliq_outbox \
             SET lease_owner = ?1, leased_until = ?2, attempts = attempts + 1 \
             WHERE seq IN ( \
                 SELECT seq FROM reliq_outbox \
                 WHERE sent_at IS NULL AND (leased_until IS NULL OR leased_until <= ?3) \
                 ORDER BY seq LIMIT ?4 \
             ) \
             RETURNING seq, message_id, topic, route, message_key, payload, headers",
        )
        .bind(owner)
        .bind(until)
        .bind(now)
        .bind(i64::try_from(limit).unwrap_or(i64::MAX))
        .fetch_all(&self.pool)
        .await
        .map_err(store_error)?;
        rows.into_iter().map(OutboxRecord::from_columns).collect()
    }

    async fn mark_sent(&self, _owner: &str, seqs: &[i64]) -> Result<(), OutboxError> {
        sqlx::query(
            "UPDATE reliq_outbox \
             SET sent_at = ?1, lease_owner = NULL, leased_until = NULL, last_error = NULL \
             WHERE seq IN (SELECT value FROM json_each(?2)) AND sent_at IS NULL",
        )
        .bind(now_ms())
        .bind(json_list(seqs))
        .execute(&self.pool)
        .await
        .map_err(store_error)?;
        Ok(())
    }

    async fn release(&self, owner: &str, seqs: &[i64], error: &str) -> Result<(), OutboxError> {
        sqlx::query(
            "UPDATE reliq_outbox SET lease_owner = NULL, leased_until = NULL, last_error = ?3 \
             WHERE seq IN (SELECT value FROM json_each(?2)) AND lease_owner = ?1 \
                 AND sent_at IS NULL",
        )
        .bind(owner)
        .bind(json_list(seqs))
        .bind(error)
        .execute(&self.pool)
        .await
        .map_err(store_error)?;
        Ok(())
    }

    /// SQLite cannot notify: an idle relay polls this often.
    fn default_poll_interval(&self) -> Duration {
        Duration::from_millis(100)
    }
}
