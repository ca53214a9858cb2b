//! # reliq-sql
//!
//! The inbox and the outbox of reliq, written once over [sqlx]: [`Inbox`] makes a
//! consumer's effect happen once, [`Outbox`] publishes the events a transaction produced
//! through a relay, both in the caller's own transaction. What depends on the database
//! lives in the store crates: the migrations, a [`StoreSql`] implementation (statements,
//! time, row lists, the relay's wake-up) and the error rules for handlers:
//!
//! | | reliq-postgres (`PgStore`) | reliq-sqlite (`SqliteStore`) |
//! |---|---|---|
//! | statements | `$n` parameters, `ON CONFLICT`, `FOR UPDATE SKIP LOCKED` | `?n` parameters, `ON CONFLICT`, one writer at a time |
//! | time | the server's `now()`; durations bound as seconds | this machine's clock, bound as Unix milliseconds |
//! | a list of rows | an array (`= ANY($n)`) | a JSON array (`json_each(?n)`) |
//! | idle relay | woken by `LISTEN reliq_outbox`, polls every 5 s as a fallback | polls every 100 ms |
//! | error rules | SQLSTATEs (`with_error_rules`) | `SQLITE_BUSY` / `SQLITE_LOCKED` (`with_error_rules`) |
//!
//! Applications use the store crates (`PgInbox` = `Inbox<PgStore>`, …); their docs have
//! the examples.

mod dialect;
mod driver;
mod error;
mod inbox;
mod migrate;
mod outbox;

pub use dialect::{OutOfRange, StoreSql};
pub use driver::{Driver, Statement};
pub use error::Error;
pub use inbox::Inbox;
pub use migrate::{MIGRATIONS_TABLE, migrate};
pub use outbox::Outbox;
