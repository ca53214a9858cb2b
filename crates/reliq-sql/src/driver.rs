//! What the stores need of a database's sqlx driver.

use sqlx::migrate::Migrate;
use sqlx::query::Query;
use sqlx::{Database, Encode, Executor, FromRow, IntoArguments, Pool, Type};

use reliq_core::seam::OutboxColumns;

/// A statement of `DB` with the parameters bound so far.
pub type Statement<'q, DB> = Query<'q, DB, <DB as Database>::Arguments>;

/// The sqlx driver features the stores use: statements run on a pool or on the caller's
/// connection, the value types they bind, the rows they read, and migrations.
///
/// Implemented for every sqlx database whose driver has them (PostgreSQL and SQLite
/// do). The requirements stand once, on that implementation: Rust does not carry a
/// trait's `where` clauses to the code that uses the trait, so without it every generic
/// `impl` of the stores would repeat them.
pub trait Driver: Database<Arguments: IntoArguments<Self>, Connection: Migrate> {
    /// A pool as an executor.
    type OnPool<'p>: Executor<'p, Database = Self>;
    /// A connection (the caller's transaction) as an executor.
    type OnConn<'c>: Executor<'c, Database = Self>;

    /// Run statements on `pool`.
    fn on_pool(pool: &Pool<Self>) -> Self::OnPool<'_>;
    /// Run statements on `conn`.
    fn on_conn(conn: &mut Self::Connection) -> Self::OnConn<'_>;
    /// Bind a text parameter.
    fn bind_text<'q>(statement: Statement<'q, Self>, value: &str) -> Statement<'q, Self>;
    /// Bind a text parameter that may be `NULL`.
    fn bind_opt_text<'q>(
        statement: Statement<'q, Self>,
        value: Option<&str>,
    ) -> Statement<'q, Self>;
    /// Bind a bytes parameter.
    fn bind_bytes<'q>(statement: Statement<'q, Self>, value: &[u8]) -> Statement<'q, Self>;
    /// Bind an integer parameter.
    fn bind_int<'q>(statement: Statement<'q, Self>, value: i64) -> Statement<'q, Self>;
    /// An outbox row, as the relay's claim returns it.
    fn outbox_columns(row: &Self::Row) -> Result<OutboxColumns, sqlx::Error>;
    /// The first column as an integer (a count).
    fn first_int(row: &Self::Row) -> Result<i64, sqlx::Error>;
    /// The first two columns as integers.
    fn two_ints(row: &Self::Row) -> Result<(i64, i64), sqlx::Error>;
}

impl<DB> Driver for DB
where
    DB: Database<Arguments: IntoArguments<DB>, Connection: Migrate>,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'a> &'a str: Encode<'a, DB> + Type<DB>,
    for<'a> Option<&'a str>: Encode<'a, DB> + Type<DB>,
    for<'a> &'a [u8]: Encode<'a, DB> + Type<DB>,
    i64: for<'a> Encode<'a, DB> + Type<DB>,
    OutboxColumns: for<'r> FromRow<'r, DB::Row>,
    (i64,): for<'r> FromRow<'r, DB::Row>,
    (i64, i64): for<'r> FromRow<'r, DB::Row>,
{
    type OnPool<'p> = &'p Pool<DB>;
    type OnConn<'c> = &'c mut DB::Connection;

    fn on_pool(pool: &Pool<DB>) -> &Pool<DB> {
        pool
    }

    fn on_conn(conn: &mut DB::Connection) -> &mut DB::Connection {
        conn
    }

    fn bind_text<'q>(statement: Statement<'q, DB>, value: &str) -> Statement<'q, DB> {
        statement.bind(value)
    }

    fn bind_opt_text<'q>(statement: Statement<'q, DB>, value: Option<&str>) -> Statement<'q, DB> {
        statement.bind(value)
    }

    fn bind_bytes<'q>(statement: Statement<'q, DB>, value: &[u8]) -> Statement<'q, DB> {
        statement.bind(value)
    }

    fn bind_int<'q>(statement: Statement<'q, DB>, value: i64) -> Statement<'q, DB> {
        statement.bind(value)
    }

    fn outbox_columns(row: &DB::Row) -> Result<OutboxColumns, sqlx::Error> {
        OutboxColumns::from_row(row)
    }

    fn first_int(row: &DB::Row) -> Result<i64, sqlx::Error> {
        <(i64,)>::from_row(row).map(|(n,)| n)
    }

    fn two_ints(row: &DB::Row) -> Result<(i64, i64), sqlx::Error> {
        <(i64, i64)>::from_row(row)
    }
}

/// [`Driver`]'s binds, chained like `Query::bind`.
pub(crate) trait Bind {
    fn text(self, value: &str) -> Self;
    fn opt_text(self, value: Option<&str>) -> Self;
    fn bytes(self, value: &[u8]) -> Self;
    fn int(self, value: i64) -> Self;
}

impl<DB: Driver> Bind for Statement<'_, DB> {
    fn text(self, value: &str) -> Self {
        DB::bind_text(self, value)
    }

    fn opt_text(self, value: Option<&str>) -> Self {
        DB::bind_opt_text(self, value)
    }

    fn bytes(self, value: &[u8]) -> Self {
        DB::bind_bytes(self, value)
    }

    fn int(self, value: i64) -> Self {
        DB::bind_int(self, value)
    }
}
