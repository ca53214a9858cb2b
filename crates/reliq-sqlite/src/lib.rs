//! # reliq-sqlite
//!
//! SQLite stores for reliq, the embedded default: an **inbox** that makes a consumer's
//! effect happen once, and an **outbox** that publishes the events a transaction
//! produced, both written in the caller's own transaction.
//!
//! - [`SqliteInbox::claim`] records `(consumer, message id)` inside the business
//!   transaction (`INSERT … ON CONFLICT DO NOTHING RETURNING 1`): the claim and the
//!   business change commit or roll back together. A redelivered or replayed copy finds
//!   the claim, the handler returns [`reliq_core::Duplicate`], and the runtime
//!   acknowledges it, skips it and counts it (`reliq_messages_duplicate_total`).
//! - [`SqliteOutbox::enqueue`] writes a message (with its stable id) in the business
//!   transaction; a [`reliq_core::Relay`] publishes it after the commit through any
//!   broker, with the broker's confirm, and marks the row sent. SQLite cannot notify, so
//!   an idle relay polls (every 100 ms by default); rows are leased to one relay at a time
//!   through the `lease_owner` / `leased_until` columns.
//!
//! The schema comes with the crate: [`migrate`] creates `reliq_inbox` and `reliq_outbox`
//! and records its migrations in its own table, `_reliq_migrations`, so it never mixes
//! with the application's `_sqlx_migrations`. [`connect`] opens a pool with the settings
//! these stores want (WAL, a busy timeout, `synchronous = FULL`). The stores' logic is
//! [`reliq_sql`]'s, shared with reliq-postgres; this crate gives it the SQLite statements
//! ([`SqliteStore`]), the schema, the pool settings and the error rules.
//!
//! ```no_run
//! use std::sync::Arc;
//! use reliq_core::{BoxError, Classifier, Consumer, Delivery, Destination, Message};
//! use reliq_sqlite::{SqliteInbox, SqliteOutbox};
//!
//! # async fn demo(broker: Arc<dyn reliq_core::Broker>) -> Result<(), BoxError> {
//! let pool = reliq_sqlite::connect("sqlite://inventory.db").await?;
//! reliq_sqlite::migrate(&pool).await?;
//! let (inbox, outbox) = (SqliteInbox::new(pool.clone()), SqliteOutbox::new(pool.clone()));
//!
//! // Consumer: claim + effect + outgoing event in one transaction; ack after COMMIT.
//! let (p, i, o) = (pool.clone(), inbox.clone(), outbox.clone());
//! let consumer = Consumer::builder(broker.clone(), "inventory")
//!     .subscribe("orders")
//!     .classifier(reliq_sqlite::with_error_rules(Classifier::default()))
//!     .start(move |d: Delivery| {
//!         let (pool, inbox, outbox) = (p.clone(), i.clone(), o.clone());
//!         async move {
//!             // IMMEDIATE: take the write lock now, not on the first write.
//!             let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
//!             inbox.claim(&mut tx, "inventory", d.id()).await?.first_or_skip()?;
//!             sqlx::query("UPDATE stock SET reserved = reserved + 1 WHERE sku = ?")
//!                 .bind(d.text()?)
//!                 .execute(&mut *tx)
//!                 .await?;
//!             let event = Message::with_id_and_payload(format!("{}:reserved", d.id()), "…");
//!             outbox.enqueue(&mut tx, &Destination::new("inventory"), &event).await?;
//!             tx.commit().await?;
//!             Ok::<(), BoxError>(())
//!         }
//!     })
//!     .await?;
//!
//! // Relay: publishes committed outbox rows, in order, with confirms.
//! let relay = outbox.relay(broker).build()?.start();
//! # let _ = (consumer, relay); Ok(()) }
//! ```
//!
//! ## Database errors in handlers
//!
//! A `sqlx::Error` a handler returns is, to reliq's classifier, an unknown error (a small
//! retry budget, then parked). [`with_error_rules`] adds a rule ([`error_class`]) that
//! makes the failures a retry resolves transient — a database still locked by another writer after the busy timeout (`SQLITE_BUSY`), a locked table, an I/O error or a full pool — and leaves the rest
//! (constraint violations, bad SQL) unknown for your own rules to decide.
//!
//! ## Retention: the replay horizon
//!
//! An inbox row must live at least as long as a copy of its message can still arrive:
//! the broker's redelivery window, retry tiers, the DLQ's retention (a dead-lettered
//! message may be replayed by an operator), and any archive you replay from. Purge only
//! ids older than that horizon — [`SqliteInbox::purge`] deletes claims older than the age
//! you give. If events may be replayed from the DLQ for 14 days, purge after 14 days plus
//! a margin, never after a week: a replay past the purge applies its effect a second
//! time. Sent outbox rows are kept (they record what was published, and keep `enqueue`
//! idempotent for their id) until [`SqliteOutbox::purge_sent`].

mod classify;
mod store;

pub use classify::{error_class, with_error_rules};
pub use reliq_sql::MIGRATIONS_TABLE;
/// The sqlx version these stores are built with (its pools and transactions are what
/// the API takes).
pub use sqlx;
pub use store::{SqliteStore, connect, migrate};

/// Errors of the SQLite stores.
pub type Error = reliq_sql::Error<SqliteStore>;

/// The SQLite inbox (`reliq_inbox`): a [`reliq_sql::Inbox`], whose docs say the two ways
/// to use it. Cheap to clone.
///
/// SQLite has one writer at a time: a transaction claiming an id with
/// [`SqliteInbox::claim`] while another holds the write lock waits (busy timeout) until
/// that one ends, then gets [`Claim::Duplicate`] if it committed the same id,
/// [`Claim::First`] if it rolled back. Begin handler transactions with
/// `pool.begin_with("BEGIN IMMEDIATE")` so they take the write lock up front.
///
/// [`Claim::Duplicate`]: reliq_core::Claim::Duplicate
/// [`Claim::First`]: reliq_core::Claim::First
pub type SqliteInbox = reliq_sql::Inbox<SqliteStore>;

/// The SQLite outbox (`reliq_outbox`): a [`reliq_sql::Outbox`]. Cheap to clone.
///
/// As an [`OutboxStore`](reliq_core::OutboxStore), a claim is one `UPDATE … WHERE
/// seq IN (SELECT … ORDER BY seq LIMIT n) RETURNING …` that sets `lease_owner` and
/// `leased_until`. SQLite runs one writer at a time, so two relays (threads or processes
/// on one database file) never claim the same row while its lease holds. Leases use this
/// machine's clock (SQLite is local). SQLite cannot notify: an idle relay polls.
pub type SqliteOutbox = reliq_sql::Outbox<SqliteStore>;
