//! # reliq-postgres
//!
//! PostgreSQL stores for reliq, for production: an **inbox** that makes a consumer's
//! effect happen once, and an **outbox** that publishes the events a transaction produced,
//! both written in the caller's own transaction.
//!
//! - [`PgInbox::claim`] records `(consumer, message id)` inside the business transaction
//!   (`INSERT … ON CONFLICT DO NOTHING RETURNING 1`): the claim and the business change
//!   commit or roll back together. A redelivered or replayed copy finds the claim, the
//!   handler returns [`reliq_core::Duplicate`], and the runtime acknowledges it, skips it
//!   and counts it (`reliq_messages_duplicate_total`).
//! - [`PgOutbox::enqueue`] writes a message (with its stable id) in the business
//!   transaction; a [`reliq_core::Relay`] publishes it after the commit through any
//!   broker, with the broker's confirm, and marks the row sent. Idle relays wake up on
//!   `LISTEN reliq_outbox` (a trigger notifies on commit), with a poll as fallback.
//!
//! The schema comes with the crate: [`migrate`] creates `reliq_inbox` and `reliq_outbox`
//! and records its migrations in its own table, `_reliq_migrations`, so it never mixes
//! with the application's `_sqlx_migrations`. The stores' logic is [`reliq_sql`]'s,
//! shared with reliq-sqlite; this crate gives it the PostgreSQL statements ([`PgStore`]),
//! the schema, the `LISTEN` wake-up and the error rules.
//!
//! ```no_run
//! use std::sync::Arc;
//! use reliq_core::{BoxError, Classifier, Consumer, Delivery, Destination, Message};
//! use reliq_postgres::{PgInbox, PgOutbox, sqlx::PgPool};
//!
//! # async fn demo(broker: Arc<dyn reliq_core::Broker>) -> Result<(), BoxError> {
//! let pool = PgPool::connect("postgres://reliq:reliq@127.0.0.1:5432/reliq").await?;
//! reliq_postgres::migrate(&pool).await?;
//! let (inbox, outbox) = (PgInbox::new(pool.clone()), PgOutbox::new(pool.clone()));
//!
//! // Consumer: claim + effect + outgoing event in one transaction; ack after COMMIT.
//! let (p, i, o) = (pool.clone(), inbox.clone(), outbox.clone());
//! let consumer = Consumer::builder(broker.clone(), "inventory")
//!     .subscribe("orders")
//!     .classifier(reliq_postgres::with_error_rules(Classifier::default()))
//!     .start(move |d: Delivery| {
//!         let (pool, inbox, outbox) = (p.clone(), i.clone(), o.clone());
//!         async move {
//!             let mut tx = pool.begin().await?;
//!             inbox.claim(&mut tx, "inventory", d.id()).await?.first_or_skip()?;
//!             sqlx::query("UPDATE stock SET reserved = reserved + 1 WHERE sku = $1")
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
//! makes the failures a retry resolves transient — a serialization failure (`40001`), a deadlock, a lock or statement timeout, a lost connection or a full pool — and leaves the rest
//! (constraint violations, bad SQL) unknown for your own rules to decide.
//!
//! ## Retention: the replay horizon
//!
//! An inbox row must live at least as long as a copy of its message can still arrive:
//! the broker's redelivery window, retry tiers, the DLQ's retention (a dead-lettered
//! message may be replayed by an operator), and any archive you replay from. Purge only
//! ids older than that horizon — [`PgInbox::purge`] deletes claims older than the age you
//! give. If events may be replayed from the DLQ for 14 days, purge after 14 days plus a
//! margin, never after a week: a replay past the purge applies its effect a second time.
//! Sent outbox rows are kept (they record what was published, and keep `enqueue`
//! idempotent for their id) until [`PgOutbox::purge_sent`].

mod classify;
mod listen;
mod store;

pub use classify::{error_class, with_error_rules};
pub use listen::OUTBOX_CHANNEL;
pub use reliq_sql::MIGRATIONS_TABLE;
/// The sqlx version these stores are built with (its pools and transactions are what
/// the API takes).
pub use sqlx;
pub use store::{PgStore, migrate};

/// Errors of the PostgreSQL stores.
pub type Error = reliq_sql::Error<PgStore>;

/// The PostgreSQL inbox (`reliq_inbox`): a [`reliq_sql::Inbox`], whose docs say the two
/// ways to use it. Cheap to clone.
///
/// Two transactions claiming the same id with [`PgInbox::claim`]: the second waits for
/// the first's row lock, then gets [`Claim::Duplicate`] if the first committed,
/// [`Claim::First`] if it rolled back.
///
/// [`Claim::Duplicate`]: reliq_core::Claim::Duplicate
/// [`Claim::First`]: reliq_core::Claim::First
pub type PgInbox = reliq_sql::Inbox<PgStore>;

/// The PostgreSQL outbox (`reliq_outbox`): a [`reliq_sql::Outbox`]. Cheap to clone.
///
/// As an [`OutboxStore`](reliq_core::OutboxStore), a claim is one short
/// statement — `UPDATE … WHERE seq IN (SELECT … ORDER BY seq LIMIT n FOR UPDATE SKIP
/// LOCKED)` — that sets `lease_owner` and `leased_until`: concurrent relays skip each
/// other's rows instead of waiting, and no transaction or connection stays open while
/// the broker confirms. Leases use the server's clock. Each running relay holds one pool
/// connection for `LISTEN` ([`OUTBOX_CHANNEL`]).
pub type PgOutbox = reliq_sql::Outbox<PgStore>;
