//! The PostgreSQL side of the stores: the statements for the schema of `migrations/`,
//! times from the server's clock, and the `LISTEN` wake-up.

use std::time::Duration;

use reliq_core::seam::OutboxWakeup;
use reliq_sql::{OutOfRange, Statement, StoreSql};
use sqlx::postgres::PgQueryResult;
use sqlx::{PgPool, Postgres};

use crate::{Error, listen};

/// The PostgreSQL store: what [`PgInbox`](crate::PgInbox) and
/// [`PgOutbox`](crate::PgOutbox) run on (never made; a type only).
#[derive(Clone, Copy, Debug)]
pub enum PgStore {}

/// A duration as seconds for `make_interval(secs => …)`.
fn seconds(d: Duration) -> Result<f64, OutOfRange> {
    let s = d.as_secs_f64();
    if s.is_finite() && s < 1e12 {
        Ok(s)
    } else {
        Err(OutOfRange(d))
    }
}

impl StoreSql for PgStore {
    type Db = Postgres;
    const NAME: &'static str = "postgres";

    /// The statements read the server's `now()`.
    type Now = ();
    /// Seconds, added to or subtracted from `now()` by the statement.
    type Moment = f64;
    type Seqs<'a> = &'a [i64];

    fn now() {}

    fn bind_now<'q>(statement: Statement<'q, Postgres>, (): ()) -> Statement<'q, Postgres> {
        statement
    }

    fn later((): (), by: Duration) -> Result<f64, OutOfRange> {
        seconds(by)
    }

    fn earlier((): (), by: Duration) -> Result<f64, OutOfRange> {
        seconds(by)
    }

    fn seqs(seqs: &[i64]) -> &[i64] {
        seqs
    }

    fn rows_affected(result: &PgQueryResult) -> u64 {
        result.rows_affected()
    }

    const INBOX_CLAIM: &'static str = "INSERT INTO reliq_inbox (consumer, message_id) \
         VALUES ($1, $2) ON CONFLICT DO NOTHING RETURNING 1";
    const INBOX_CONTAINS: &'static str = "SELECT 1 FROM reliq_inbox \
         WHERE consumer = $1 AND message_id = $2 AND pending_until IS NULL";
    const INBOX_PURGE: &'static str = "DELETE FROM reliq_inbox i USING ( \
             SELECT consumer, message_id FROM reliq_inbox \
             WHERE claimed_at < now() - make_interval(secs => $1) LIMIT $2 \
         ) old \
         WHERE i.consumer = old.consumer AND i.message_id = old.message_id";
    const INBOX_CLAIM_PENDING: &'static str = "INSERT INTO reliq_inbox (consumer, message_id, pending_until) \
         VALUES ($1, $2, now() + make_interval(secs => $3)) \
         ON CONFLICT (consumer, message_id) DO UPDATE \
             SET pending_until = EXCLUDED.pending_until, claimed_at = now() \
             WHERE reliq_inbox.pending_until < now() \
         RETURNING 1";
    const INBOX_COMPLETE: &'static str = "UPDATE reliq_inbox SET pending_until = NULL \
         WHERE consumer = $1 AND message_id = $2";
    const INBOX_ABANDON: &'static str = "DELETE FROM reliq_inbox \
         WHERE consumer = $1 AND message_id = $2 AND pending_until IS NOT NULL";

    const OUTBOX_ENQUEUE: &'static str = "INSERT INTO reliq_outbox (message_id, topic, route, message_key, payload, headers) \
         VALUES ($1, $2, $3, $4, $5, $6) \
         ON CONFLICT (message_id) DO NOTHING RETURNING seq";
    const OUTBOX_UNSENT: &'static str = "SELECT count(*) FROM reliq_outbox WHERE sent_at IS NULL";
    const OUTBOX_BACKLOG: &'static str = "SELECT count(*), \
         coalesce((extract(epoch FROM now() - min(created_at)) * 1000)::bigint, 0) \
         FROM reliq_outbox WHERE sent_at IS NULL";
    const OUTBOX_PURGE_SENT: &'static str = "DELETE FROM reliq_outbox \
         WHERE sent_at IS NOT NULL AND sent_at < now() - make_interval(secs => $1)";
    /// `FOR UPDATE SKIP LOCKED`: concurrent relays skip each other's rows instead of
    /// waiting.
    const OUTBOX_CLAIM: &'static str = "UPDATE reliq_outbox o \
         SET lease_owner = $1, leased_until = now() + make_interval(secs => $2), \
             attempts = o.attempts + 1 \
         FROM ( \
             SELECT seq FROM reliq_outbox \
             WHERE sent_at IS NULL AND (leased_until IS NULL OR leased_until < now()) \
             ORDER BY seq LIMIT $3 \
             FOR UPDATE SKIP LOCKED \
         ) c \
         WHERE o.seq = c.seq \
         RETURNING o.seq, o.message_id, o.topic, o.route, o.message_key, o.payload, o.headers";
    const OUTBOX_MARK_SENT: &'static str = "UPDATE reliq_outbox \
         SET sent_at = now(), lease_owner = NULL, leased_until = NULL, last_error = NULL \
         WHERE seq = ANY($1) AND sent_at IS NULL";
    const OUTBOX_RELEASE: &'static str = "UPDATE reliq_outbox SET lease_owner = NULL, leased_until = NULL, last_error = $3 \
         WHERE seq = ANY($2) AND lease_owner = $1 AND sent_at IS NULL";

    /// `NOTIFY` wakes an idle relay; the poll only covers notifications lost while the
    /// listening connection was down.
    const POLL_INTERVAL: Duration = Duration::from_secs(5);

    async fn listen(pool: &PgPool) -> Result<Box<dyn OutboxWakeup>, sqlx::Error> {
        listen::listen(pool).await
    }
}

/// Create or update the `reliq_inbox` and `reliq_outbox` tables (idempotent; safe to call
/// from several processes at once: sqlx takes an advisory lock).
pub async fn migrate(pool: &PgPool) -> Result<(), Error> {
    reliq_sql::migrate(sqlx::migrate!("./migrations"), pool).await
}
