use std::time::Duration;

use async_trait::async_trait;

use crate::classify::BoxError;
use crate::headers::Headers;
use crate::message::Message;
use crate::subscription::Destination;

mod relay;
#[cfg(test)]
mod tests;

pub use relay::{Relay, RelayBuilder, RelayConfigError, RelayError, RelayHandle, RelayStats};

/// One unsent outbox row, as the store hands it to the relay.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutboxRecord {
    /// The store's sequence number: the enqueue order, and the row's handle for
    /// [`OutboxStore::mark_sent`] / [`OutboxStore::release`].
    pub seq: i64,
    /// Where to publish.
    pub destination: Destination,
    /// What to publish (its id is the stable id given at enqueue).
    pub message: Message,
}

/// An outbox row's columns as the SQL stores read them: `(seq, message_id, topic, route,
/// message_key, payload, headers)`, the headers as written by [`encode_headers`].
pub type OutboxColumns = (
    i64,
    String,
    String,
    Option<String>,
    Option<String>,
    Vec<u8>,
    String,
);

impl OutboxRecord {
    /// Build a record from a row's columns; headers that do not decode are an error
    /// naming the row.
    pub fn from_columns(
        (seq, id, topic, route, key, payload, headers): OutboxColumns,
    ) -> Result<Self, OutboxError> {
        let headers = decode_headers(&headers)
            .map_err(|e| OutboxError(format!("outbox row {seq}: bad headers: {e}").into()))?;
        Ok(Self {
            seq,
            destination: Destination { topic, route },
            message: Message::from_parts(id.into(), key, payload.into(), headers),
        })
    }
}

/// An outbox's unsent rows ([`OutboxStore::backlog`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OutboxBacklog {
    /// Rows not sent yet.
    pub rows: u64,
    /// How long the oldest of them has waited (zero when there is none).
    pub oldest_age: Duration,
}

/// The outbox store failed (the database is unreachable, a row cannot be decoded, …).
#[derive(Debug, thiserror::Error)]
#[error("outbox store error: {0}")]
pub struct OutboxError(#[from] pub BoxError);

/// The SQL side of an outbox: how a relay claims, marks and releases rows. Implemented
/// by reliq-postgres (`FOR UPDATE SKIP LOCKED` + lease columns) and reliq-sqlite (lease
/// columns).
///
/// The transactional outbox: the relay, written once for every store.
///
/// A producer that changes its database *and* publishes an event cannot make both happen
/// atomically (the dual-write problem). With an outbox it writes the event as a row in the
/// **same transaction** as the business change (`enqueue` of reliq-postgres /
/// reliq-sqlite), with the message's stable id. A [`Relay`] then claims unsent rows,
/// publishes them through any [`Broker`](crate::broker::Broker) (whose `publish` returns
/// only after the broker confirmed), and marks them sent.
///
/// Guarantees:
/// - **Nothing is lost**: a row is marked sent only after the broker confirmed it; a failed
///   publish keeps the row (released for the next attempt, after a back-off).
/// - **At-least-once, same id**: a crash between the confirm and the mark publishes the row
///   again, with the same message id, once its lease expired. Consumers absorb the copy
///   with an inbox.
/// - **Several relays may run at once**: a claim leases rows to one relay
///   ([`OutboxStore::claim_batch`]); while the lease holds no other relay claims them, and
///   a relay stops publishing a batch before its lease ends (leaving a safety margin of a
///   tenth of the lease), so a row is not published twice while its lease holds.
/// - **Order**: one relay publishes in enqueue order (the store's sequence), one message
///   at a time, and stops at the first failure, so a later row never overtakes an earlier
///   one. A row that can never be published (say, an unroutable destination) therefore
///   holds back the rows behind it until an operator fixes the destination or deletes
///   the row; its `attempts` and `last_error` columns say why. With several relays,
///   batches run in parallel and order between batches is not kept.
///
/// The store supplies the SQL ([`OutboxStore`]); the relay loop, back-off, lease guard,
/// counters and metrics are here.
///
/// ```
/// # async fn demo(store: std::sync::Arc<dyn reliq_core::OutboxStore>,
/// #               broker: std::sync::Arc<dyn reliq_core::Broker>) -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::Duration;
/// use reliq_core::Relay;
///
/// let relay = Relay::builder(store, broker)
///     .name("orders")                       // the `relay` metric label
///     .batch_size(100)
///     .lease(Duration::from_secs(30))
///     .build()?
///     .start();
/// // … on shutdown: finishes the batch in progress, then stops.
/// let stats = relay.shutdown().await;
/// # let _ = stats; Ok(()) }
/// ```
#[async_trait]
pub trait OutboxStore: Send + Sync + 'static {
    /// Lease up to `limit` unsent rows whose lease is free (never leased, released, or
    /// expired) to `owner` for `lease`, oldest first, and return them. Two concurrent
    /// calls never return the same row while its lease holds.
    async fn claim_batch(
        &self,
        owner: &str,
        limit: usize,
        lease: Duration,
    ) -> Result<Vec<OutboxRecord>, OutboxError>;

    /// The broker confirmed these rows: mark them sent (whoever holds their lease now).
    async fn mark_sent(&self, owner: &str, seqs: &[i64]) -> Result<(), OutboxError>;

    /// These rows were not published: free their lease (only where `owner` still holds
    /// it) and record `error` as their last error.
    async fn release(&self, owner: &str, seqs: &[i64], error: &str) -> Result<(), OutboxError>;

    /// Something that wakes an idle relay when rows may have been added (Postgres:
    /// `LISTEN`). Called once when the relay starts, before its first claim, so no
    /// notification is missed. The default only waits for the poll interval.
    async fn listen(&self) -> Result<Box<dyn OutboxWakeup>, OutboxError> {
        Ok(Box::new(PollOnly))
    }

    /// The unsent rows: how many and the oldest one's age, for the relay's gauges
    /// (`reliq_outbox_backlog_rows`, `reliq_outbox_oldest_age_seconds`). `None` where the
    /// store cannot tell cheaply (the default).
    async fn backlog(&self) -> Result<Option<OutboxBacklog>, OutboxError> {
        Ok(None)
    }

    /// The poll interval a relay uses unless told otherwise: short for stores that cannot
    /// notify, a fallback for those that can.
    fn default_poll_interval(&self) -> Duration {
        Duration::from_millis(200)
    }
}

/// Wakes an idle relay. See [`OutboxStore::listen`].
#[async_trait]
pub trait OutboxWakeup: Send {
    /// Return when rows may have been added, or after `timeout` at the latest. Spurious
    /// wake-ups are fine (the relay claims, finds nothing and waits again).
    async fn wait(&mut self, timeout: Duration);
}

/// A wake-up that only polls.
#[derive(Clone, Copy, Debug, Default)]
pub struct PollOnly;

#[async_trait]
impl OutboxWakeup for PollOnly {
    async fn wait(&mut self, timeout: Duration) {
        tokio::time::sleep(timeout).await;
    }
}

/// Encode headers for an outbox row: a JSON array of `[name, value]` pairs (order kept).
pub fn encode_headers(headers: &Headers) -> String {
    let pairs: Vec<(&str, &str)> = headers.iter().collect();
    // Serialising pairs of strings cannot fail.
    serde_json::to_string(&pairs).unwrap_or_else(|_| "[]".to_owned())
}

/// Decode headers written by [`encode_headers`].
pub fn decode_headers(text: &str) -> Result<Headers, serde_json::Error> {
    let pairs: Vec<(String, String)> = serde_json::from_str(text)?;
    Ok(pairs.into_iter().collect())
}
