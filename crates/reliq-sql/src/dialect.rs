//! What each database gives the stores: its statements, how they take the time and a
//! list of rows, and how an idle relay waits.

use std::fmt::Debug;
use std::future::Future;
use std::time::Duration;

use reliq_core::seam::{OutboxWakeup, PollOnly};
use sqlx::{Database, Encode, Pool, Type};

use crate::driver::{Driver, Statement};

/// A duration the database cannot add to a moment (it becomes
/// [`Error::Duration`](crate::error::Error::Duration)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OutOfRange(pub Duration);

/// One database's side of the stores, implemented by reliq-postgres (`PgStore`) and
/// reliq-sqlite (`SqliteStore`) for the schema their migrations create.
///
/// Each statement's parameters are listed in the order [`Inbox`](crate::inbox::Inbox) and
/// [`Outbox`](crate::outbox::Outbox) bind them (`$1`, `$2`, … in PostgreSQL, `?1`, `?2`, … in
/// SQLite). A **time** parameter is a [`StoreSql::Moment`]; statements marked **now**
/// then take the current time through [`StoreSql::bind_now`], after their listed
/// parameters (a database whose statements read the clock themselves binds nothing).
/// Statements that return a row for "it happened" may return any column.
pub trait StoreSql: Debug + Send + Sync + Sized + 'static {
    /// The sqlx database.
    type Db: Driver;

    /// How this store's errors begin (`postgres`, `sqlite`).
    const NAME: &'static str;

    /// The current time, read once per call and given to [`StoreSql::later`],
    /// [`StoreSql::earlier`] and [`StoreSql::bind_now`] (`()` where the database reads
    /// its own clock).
    type Now: Copy + Send + Sync;

    /// A time parameter: a point some duration before or after [`StoreSql::Now`], as the
    /// statements take it (PostgreSQL: the seconds a statement adds to or takes from its
    /// `now()`; SQLite: the point itself).
    type Moment: for<'q> Encode<'q, Self::Db> + Type<Self::Db> + Copy + Send + Sync;

    /// A list of outbox row numbers, as the statements take it.
    type Seqs<'a>: Encode<'a, Self::Db> + Type<Self::Db> + Send;

    /// Read the clock.
    fn now() -> Self::Now;

    /// Bind `now` to a statement marked **now**, if this database's statements take it.
    fn bind_now<'q>(statement: Statement<'q, Self::Db>, now: Self::Now) -> Statement<'q, Self::Db>;

    /// `by` after `now`.
    fn later(now: Self::Now, by: Duration) -> Result<Self::Moment, OutOfRange>;

    /// `by` before `now`.
    fn earlier(now: Self::Now, by: Duration) -> Result<Self::Moment, OutOfRange>;

    /// `seqs` as one parameter.
    fn seqs(seqs: &[i64]) -> Self::Seqs<'_>;

    /// The rows a statement changed (sqlx has no generic accessor).
    fn rows_affected(result: &<Self::Db as Database>::QueryResult) -> u64;

    /// Claim in the caller's transaction: insert a committed claim, nothing if one
    /// exists; a row if it inserted. Parameters: consumer, message id; **now**.
    const INBOX_CLAIM: &'static str;
    /// A row if a committed (not pending) claim exists. Parameters: consumer, message id.
    const INBOX_CONTAINS: &'static str;
    /// Delete the claims made before a time, at most a limit of them. Parameters: time,
    /// limit.
    const INBOX_PURGE: &'static str;
    /// Claim on its own: insert a claim pending until a time, or take over one whose
    /// pending time passed; a row if it claimed. Parameters: consumer, message id, time;
    /// **now**.
    const INBOX_CLAIM_PENDING: &'static str;
    /// Make a claim committed. Parameters: consumer, message id.
    const INBOX_COMPLETE: &'static str;
    /// Delete a claim if it is pending. Parameters: consumer, message id.
    const INBOX_ABANDON: &'static str;
    /// Insert an outbox row, nothing if its message id exists; a row if it inserted.
    /// Parameters: message id, topic, route, key, payload, headers; **now**.
    const OUTBOX_ENQUEUE: &'static str;
    /// The number of unsent rows, one integer column. No parameters.
    const OUTBOX_UNSENT: &'static str;
    /// The unsent rows' count and the oldest one's age in milliseconds (0 when none), two
    /// integer columns. Parameters: **now**.
    const OUTBOX_BACKLOG: &'static str;
    /// Delete the rows sent before a time. Parameters: time.
    const OUTBOX_PURGE_SENT: &'static str;
    /// Lease unsent rows whose lease is free, oldest first, to an owner until a time,
    /// counting an attempt, and return them as
    /// [`OutboxColumns`](reliq_core::seam::OutboxColumns). Parameters: owner, time,
    /// limit; **now**.
    const OUTBOX_CLAIM: &'static str;
    /// Mark unsent rows sent and free their lease. Parameters: seqs; **now**.
    const OUTBOX_MARK_SENT: &'static str;
    /// Free the lease of the unsent rows an owner holds and record an error.
    /// Parameters: owner, seqs, error.
    const OUTBOX_RELEASE: &'static str;

    /// The poll interval of a relay unless told otherwise (a fallback where
    /// [`StoreSql::listen`] wakes it).
    const POLL_INTERVAL: Duration;

    /// What wakes an idle relay when rows may have been added. The default only waits
    /// for the poll interval.
    fn listen(
        pool: &Pool<Self::Db>,
    ) -> impl Future<Output = Result<Box<dyn OutboxWakeup>, sqlx::Error>> + Send {
        let _ = pool;
        std::future::ready(Ok(Box::new(PollOnly) as Box<dyn OutboxWakeup>))
    }
}
