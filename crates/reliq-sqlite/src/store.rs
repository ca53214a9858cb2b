//! The SQLite side of the stores: the statements for the schema of `migrations/`, times
//! from this machine's clock (Unix milliseconds), and the pool settings they want.

use std::str::FromStr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use reliq_sql::{OutOfRange, Statement, StoreSql};
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteQueryResult,
    SqliteSynchronous,
};
use sqlx::{Sqlite, SqlitePool};

use crate::Error;

/// The SQLite store: what [`SqliteInbox`](crate::SqliteInbox) and
/// [`SqliteOutbox`](crate::SqliteOutbox) run on (never made; a type only).
#[derive(Clone, Copy, Debug)]
pub enum SqliteStore {}

/// Now as Unix milliseconds (the schema's time unit).
fn now_ms() -> i64 {
    let since = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    i64::try_from(since.as_millis()).unwrap_or(i64::MAX)
}

/// A duration as milliseconds.
fn millis(d: Duration) -> Result<i64, OutOfRange> {
    i64::try_from(d.as_millis()).map_err(|_| OutOfRange(d))
}

impl StoreSql for SqliteStore {
    type Db = Sqlite;
    const NAME: &'static str = "sqlite";

    /// Unix milliseconds from this machine's clock (SQLite is local).
    type Now = i64;
    /// Unix milliseconds.
    type Moment = i64;
    /// A JSON array, for `json_each` (SQLite has no array parameters).
    type Seqs<'a> = String;

    fn now() -> i64 {
        now_ms()
    }

    fn bind_now<'q>(statement: Statement<'q, Sqlite>, now: i64) -> Statement<'q, Sqlite> {
        statement.bind(now)
    }

    fn later(now: i64, by: Duration) -> Result<i64, OutOfRange> {
        Ok(now.saturating_add(millis(by)?))
    }

    fn earlier(now: i64, by: Duration) -> Result<i64, OutOfRange> {
        Ok(now.saturating_sub(millis(by)?))
    }

    fn seqs(seqs: &[i64]) -> String {
        let items: Vec<String> = seqs.iter().map(i64::to_string).collect();
        format!("[{}]", items.join(","))
    }

    fn rows_affected(result: &SqliteQueryResult) -> u64 {
        result.rows_affected()
    }

    const INBOX_CLAIM: &'static str = "INSERT INTO reliq_inbox (consumer, message_id, claimed_at) VALUES (?1, ?2, ?3) \
         ON CONFLICT DO NOTHING RETURNING 1";
    const INBOX_CONTAINS: &'static str = "SELECT 1 FROM reliq_inbox \
         WHERE consumer = ?1 AND message_id = ?2 AND pending_until IS NULL";
    const INBOX_PURGE: &'static str = "DELETE FROM reliq_inbox WHERE (consumer, message_id) IN ( \
             SELECT consumer, message_id FROM reliq_inbox WHERE claimed_at < ?1 LIMIT ?2 \
         )";
    const INBOX_CLAIM_PENDING: &'static str = "INSERT INTO reliq_inbox (consumer, message_id, claimed_at, pending_until) \
         VALUES (?1, ?2, ?4, ?3) \
         ON CONFLICT (consumer, message_id) DO UPDATE \
             SET pending_until = excluded.pending_until, claimed_at = excluded.claimed_at \
             WHERE reliq_inbox.pending_until < ?4 \
         RETURNING 1";
    const INBOX_COMPLETE: &'static str = "UPDATE reliq_inbox SET pending_until = NULL \
         WHERE consumer = ?1 AND message_id = ?2";
    const INBOX_ABANDON: &'static str = "DELETE FROM reliq_inbox \
         WHERE consumer = ?1 AND message_id = ?2 AND pending_until IS NOT NULL";

    const OUTBOX_ENQUEUE: &'static str = "INSERT INTO reliq_outbox \
         (message_id, topic, route, message_key, payload, headers, created_at) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7) \
         ON CONFLICT (message_id) DO NOTHING RETURNING seq";
    const OUTBOX_UNSENT: &'static str = "SELECT count(*) FROM reliq_outbox WHERE sent_at IS NULL";
    const OUTBOX_BACKLOG: &'static str = "SELECT count(*), coalesce(?1 - min(created_at), 0) \
         FROM reliq_outbox WHERE sent_at IS NULL";
    const OUTBOX_PURGE_SENT: &'static str =
        "DELETE FROM reliq_outbox WHERE sent_at IS NOT NULL AND sent_at < ?1";
    /// SQLite runs one writer at a time, so two relays never claim the same row while its
    /// lease holds.
    const OUTBOX_CLAIM: &'static str = "UPDATE reliq_outbox \
         SET lease_owner = ?1, leased_until = ?2, attempts = attempts + 1 \
         WHERE seq IN ( \
             SELECT seq FROM reliq_outbox \
             WHERE sent_at IS NULL AND (leased_until IS NULL OR leased_until <= ?4) \
             ORDER BY seq LIMIT ?3 \
         ) \
         RETURNING seq, message_id, topic, route, message_key, payload, headers";
    const OUTBOX_MARK_SENT: &'static str = "UPDATE reliq_outbox \
         SET sent_at = ?2, lease_owner = NULL, leased_until = NULL, last_error = NULL \
         WHERE seq IN (SELECT value FROM json_each(?1)) AND sent_at IS NULL";
    const OUTBOX_RELEASE: &'static str = "UPDATE reliq_outbox SET lease_owner = NULL, leased_until = NULL, last_error = ?3 \
         WHERE seq IN (SELECT value FROM json_each(?2)) AND lease_owner = ?1 \
             AND sent_at IS NULL";

    /// SQLite cannot notify: an idle relay polls this often.
    const POLL_INTERVAL: Duration = Duration::from_millis(100);
}

/// Open a pool on `url` (`sqlite://path.db`, created if missing) with WAL journaling,
/// `synchronous = FULL` (a committed claim survives a power cut) and a 5 s busy timeout.
pub async fn connect(url: &str) -> Result<SqlitePool, Error> {
    let options = SqliteConnectOptions::from_str(url)?
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Full)
        .busy_timeout(Duration::from_secs(5));
    Ok(SqlitePoolOptions::new().connect_with(options).await?)
}

/// Create or update the `reliq_inbox` and `reliq_outbox` tables (idempotent).
pub async fn migrate(pool: &SqlitePool) -> Result<(), Error> {
    reliq_sql::migrate(sqlx::migrate!("./migrations"), pool).await
}
