//! How an idle relay waits: `LISTEN reliq_outbox`, notified by the trigger of
//! `migrations/` when a transaction that enqueued commits.

use std::time::Duration;

use async_trait::async_trait;
use reliq_core::seam::OutboxWakeup;
use sqlx::PgPool;
use sqlx::postgres::PgListener;

/// The channel the `reliq_outbox` trigger notifies on commit of an enqueue.
pub const OUTBOX_CHANNEL: &str = "reliq_outbox";

/// A wake-up on a connection of its own from `pool`, listening on [`OUTBOX_CHANNEL`].
pub(crate) async fn listen(pool: &PgPool) -> Result<Box<dyn OutboxWakeup>, sqlx::Error> {
    let mut listener = PgListener::connect_with(pool).await?;
    listener.listen(OUTBOX_CHANNEL).await?;
    Ok(Box::new(Notified { listener }))
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
