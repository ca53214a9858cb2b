//! The outbox: messages written in a business transaction, published by a relay.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use reliq_core::outbox::{
    OutboxColumns, OutboxError, OutboxRecord, OutboxStore, OutboxWakeup, RelayBuilder,
    encode_headers,
};
use reliq_core::{Broker, Destination, Message, Relay};
use sqlx::postgres::PgListener;
use sqlx::{PgConnection, PgPool};

use crate::{Error, seconds};

/// The channel the `reliq_outbox` trigger notifies on commit of an enqueue.
pub const OUTBOX_CHANNEL: &str = "reliq_outbox";

/// The PostgreSQL outbox (`reliq_outbox`). Cheap to clone.
///
/// Rows are **marked sent**, not deleted, when the broker confirmed them: the row records
/// what was published and when, and its unique id keeps [`PgOutbox::enqueue`] idempotent
/// for as long as it is kept. A partial index on unsent rows keeps the relay's claim as
/// cheap as with a table of pending rows only; [`PgOutbox::purge_sent`] bounds the table.
///
/// As an [`OutboxStore`], a claim is one short statement — `UPDATE … WHERE seq IN
/// (SELECT … ORDER BY seq LIMIT n FOR UPDATE SKIP LOCKED)` — that sets `lease_owner` and
/// `leased_until`: concurrent relays skip each other's rows instead of waiting, and no
/// transaction or connection stays open while the broker confirms. A relay that dies
/// leaves a lease that expires; the rows are then published again, with the same ids.
/// Each running relay holds one pool connection for `LISTEN`.
#[derive(Clone, Debug)]
pub struct PgOutbox {
    pool: PgPool,
}

impl PgOutbox {
    /// An outbox on `pool` (run [`crate::migrate`] first).
    pub fn new(pool: PgPool) -> Self {
        Self { pool }
    }

    /// Write `message` for `destination` inside the caller's transaction (`&mut tx`): it
    /// is published after that transaction commits, never if it rolls back. Returns
    /// `false` (and writes nothing) when a row with this message id already exists — the
    /// id is the message's identity, so enqueueing it again is a no-op.
    pub async fn enqueue(
        &self,
        tx: &mut PgConnection,
        destination: &Destination,
        message: &Message,
    ) -> Result<bool, Error> {
        let inserted = sqlx::query(
            "INSERT INTO reliq_outbox (message_id, topic, route, message_key, payload, headers) \
             VALUES ($1, $2, $3, $4, $5, $6) \
             ON CONFLICT (message_id) DO NOTHING RETURNING seq",
        )
        .bind(message.id().as_str())
        .bind(&destination.topic)
        .bind(destination.route.as_deref())
        .bind(message.key())
        .bind(message.payload().as_ref())
        .bind(encode_headers(message.headers()))
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
        let deleted = sqlx::query(
            "DELETE FROM reliq_outbox \
             WHERE sent_at IS NOT NULL AND sent_at < now() - make_interval(secs => $1)",
        )
        .bind(seconds(older_than)?)
        .execute(&self.pool)
        .await?;
        Ok(deleted.rows_affected())
    }
}

fn store_error(e: impl Into<Error>) -> OutboxError {
    OutboxError(Box::new(e.into()))
}

#[async_trait]
impl OutboxStore for PgOutbox {
    async fn claim_batch(
        &self,
        owner: &str,
        limit: usize,
        lease: Duration,
    ) -> Result<Vec<OutboxRecord>, OutboxError> {
        let rows: Vec<OutboxColumns> = sqlx::query_as(
            "UPDATE reliq_outbox o \
             SET lease_owner = $1, leased_until = now() + make_interval(secs => $2), \
                 attempts = o.attempts + 1 \
             FROM ( \
                 SELECT seq FROM reliq_outbox \
                 WHERE sent_at IS NULL AND (leased_until IS NULL OR leased_until < now()) \
                 ORDER BY seq LIMIT $3 \
                 FOR UPDATE SKIP LOCKED \
             ) c \
             WHERE o.seq = c.seq \
             RETURNING o.seq, o.message_id, o.topic, o.route, o.message_key, o.payload, o.headers",
        )
        .bind(owner)
        .bind(seconds(lease).map_err(store_error)?)
        .bind(i64::try_from(limit).unwrap_or(i64::MAX))
        .fetch_all(&self.pool)
        .await
        .map_err(store_error)?;
        rows.into_iter().map(OutboxRecord::from_columns).collect()
    }

    async fn mark_sent(&self, _owner: &str, seqs: &[i64]) -> Result<(), OutboxError> {
        sqlx::query(
            "UPDATE reliq_outbox \
             SET sent_at = now(), lease_owner = NULL, leased_until = NULL, last_error = NULL \
             WHERE seq = ANY($1) AND sent_at IS NULL",
        )
        .bind(seqs)
        .execute(&self.pool)
        .await
        .map_err(store_error)?;
        Ok(())
    }

    async fn release(&self, owner: &str, seqs: &[i64], error: &str) -> Result<(), OutboxError> {
        sqlx::query(
            "UPDATE reliq_outbox SET lease_owner = NULL, leased_until = NULL, last_error = $3 \
             WHERE seq = ANY($2) AND lease_owner = $1 AND sent_at IS NULL",
        )
        .bind(owner)
        .bind(seqs)
        .bind(error)
        .execute(&self.pool)
        .await
        .map_err(store_error)?;
        Ok(())
    }

    async fn listen(&self) -> Result<Box<dyn OutboxWakeup>, OutboxError> {
        let mut listener = PgListener::connect_with(&self.pool)
            .await
            .map_err(store_error)?;
        listener.listen(OUTBOX_CHANNEL).await.map_err(store_error)?;
        Ok(Box::new(Notified { listener }))
    }

    /// `NOTIFY` wakes an idle relay; the poll only covers notifications lost while the
    /// listening connection was down.
    fn default_poll_interval(&self) -> Duration {
        Duration::from_secs(5)
    }
}

/// Wakes on `NOTIFY reliq_outbox`.
struct Notified {
    listener: PgListener,
}

#[async_trait]
impl OutboxWakeup for Notified {
    async fn wait(&mut self, timeout: Duration) {
        let deadline = tokio::time::Instant::now() + timeout;
        match tokio::time::timeout_at(deadline, self.listener.try_recv()).await {
            // Woken (drop further buffered notifications: one claim round covers them),
            // or timed out.
            Ok(Ok(Some(_))) => while self.listener.next_buffered().is_some() {},
            Err(_) => {}
            // The connection was lost (reconnected on the next call): notifications may
            // have been missed, so let the relay claim now.
            Ok(Ok(None)) => {
                tracing::warn!("outbox LISTEN connection lost; reconnecting");
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "outbox LISTEN failed; polling until it is back");
                tokio::time::sleep_until(deadline).await;
            }
        }
    }
}
