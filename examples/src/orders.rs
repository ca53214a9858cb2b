//! The orders service: an order stream with injected faults, the producer side (orders
//! written with their `order.created` event through the **outbox**), and the inventory
//! consumer (inbox claim + stock reservation in **one transaction**, acknowledged after
//! COMMIT), on SQLite or PostgreSQL.
//!
//! Used by the `orders` example and by the crash harness of `integration/`, which kills
//! the consumer's process at random moments and between COMMIT and ack.
//!
//! Tables (created by [`Db::setup`] next to reliq's own `reliq_inbox` / `reliq_outbox`):
//! - `orders (message_id)` — the producer's record of a placed order;
//! - `reservations (message_id, sku, qty)` — one row per reservation, deliberately
//!   without a unique key, so a double reservation would show as two rows;
//! - `stock (sku, reserved)` — reserved quantity per SKU.

use std::collections::{HashMap, HashSet};
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use reliq::postgres::sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use reliq::postgres::sqlx::{self, PgPool, SqlitePool};
use reliq::postgres::{PgInbox, PgOutbox};
use reliq::secrets::redact_url;
use reliq::sqlite::{SqliteInbox, SqliteOutbox};
use reliq::{
    AsyncApi, BoxError, Broker, Classifier, Codec as _, Consumer, ConsumerBuilder,
    DeadLetterReason, Delivery, Destination, Envelope, JsonCodec, Message, MessageId,
    MessageSchema, Permanent, RelayHandle, Replay, RetryPolicy, Subscription, Transient,
};
use serde::{Deserialize, Serialize};

/// The inventory consumer's name (its inbox rows, queue / group and DLQ are named after it).
pub const CONSUMER: &str = "inventory";

/// Orders placed per producer transaction.
const PLACE_BATCH: usize = 200;

/// The `order.created` event's data.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
pub struct OrderCreated {
    /// The order.
    pub order_id: String,
    /// What to reserve; only `sku-…` exists.
    pub sku: String,
    /// How many.
    pub qty: u32,
}

/// What an order of the stream is meant to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Reserved once (some fail transiently on their first two deliveries first).
    Valid,
    /// Not JSON or not UTF-8: dead-lettered at once.
    Poison,
    /// A SKU that does not exist: a permanent error, dead-lettered at once.
    UnknownSku,
}

/// One order of the stream.
#[derive(Debug, Clone)]
pub struct Order {
    /// The message (its id is the order's identity).
    pub message: Message,
    /// How often it is published (2: a producer retry after a lost confirm).
    pub copies: u32,
    /// What it should end as.
    pub kind: Kind,
    /// The warehouse call fails transiently on the first two deliveries.
    pub transient: bool,
    /// SKU and quantity (empty / 0 for poison).
    pub sku: String,
    /// Quantity.
    pub qty: u32,
}

/// The deterministic stream of `n` distinct orders: every 25 orders two poison payloads
/// (plain text, invalid UTF-8) and one unknown SKU; every order whose id ends in 7
/// fails transiently twice; every 16th order is published twice.
pub fn orders(n: u32) -> anyhow::Result<Vec<Order>> {
    let mut out = Vec::new();
    for i in 0..n {
        let order_id = format!("o-{i:05}");
        let (message, kind, sku, qty) = match i % 25 {
            3 => (
                Message::new(format!("order {i} as plain text")),
                Kind::Poison,
                String::new(),
                0,
            ),
            13 => (
                Message::new(vec![0xff, 0xfe, b'{']),
                Kind::Poison,
                String::new(),
                0,
            ),
            r => {
                let (sku, qty, kind) = if r == 20 {
                    (format!("gone-{i}"), 1, Kind::UnknownSku)
                } else {
                    (format!("sku-{}", i % 5), 1 + i % 3, Kind::Valid)
                };
                let data = OrderCreated {
                    order_id: order_id.clone(),
                    sku: sku.clone(),
                    qty,
                };
                let message = Envelope::new("order.created", data).to_message()?;
                (message, kind, sku, qty)
            }
        };
        out.push(Order {
            message: message.with_key(format!("customer-{}", i % 11)),
            copies: if i % 16 == 5 { 2 } else { 1 },
            transient: kind == Kind::Valid && order_id.ends_with('7'),
            kind,
            sku,
            qty,
        });
    }
    Ok(out)
}

/// What a run of [`orders`] must end as.
#[derive(Debug, Default)]
pub struct Expected {
    /// Valid orders: id → (sku, qty). Each must be reserved exactly once.
    pub valid: HashMap<MessageId, (String, u32)>,
    /// Poison and unknown-SKU orders, exactly the DLQ's content, with the reason each is
    /// parked for (poison: it does not decode; an unknown SKU: permanent).
    pub dead: HashMap<MessageId, DeadLetterReason>,
    /// Valid orders that fail transiently first.
    pub transient: usize,
    /// Extra copies of valid orders (each must come back as an inbox duplicate).
    pub valid_copies: HashSet<MessageId>,
    /// Poison and unknown-SKU orders published twice: each copy is a message of its own
    /// and is parked (the inbox is not asked for a message that cannot be handled), so
    /// the DLQ holds two entries for each — unless the broker dropped the second copy at
    /// publish.
    pub dead_copies: HashSet<MessageId>,
    /// Every order's id in the order it was placed: where in a run an order came.
    pub placed: Vec<MessageId>,
}

impl Expected {
    /// The expectations of a stream.
    pub fn of(orders: &[Order]) -> Self {
        let mut e = Self::default();
        for o in orders {
            let id = o.message.id().clone();
            e.placed.push(id.clone());
            if o.kind == Kind::Valid {
                if o.copies > 1 {
                    e.valid_copies.insert(id.clone());
                }
                e.transient += usize::from(o.transient);
                e.valid.insert(id, (o.sku.clone(), o.qty));
            } else {
                if o.copies > 1 {
                    e.dead_copies.insert(id.clone());
                }
                let reason = match o.kind {
                    Kind::Poison => DeadLetterReason::Poison,
                    _ => DeadLetterReason::Permanent,
                };
                e.dead.insert(id, reason);
            }
        }
        e
    }

    /// Reserved quantity per SKU when every valid order was reserved once.
    pub fn stock(&self) -> HashMap<String, i64> {
        let mut stock = HashMap::new();
        for (sku, qty) in self.valid.values() {
            *stock.entry(sku.clone()).or_insert(0) += i64::from(*qty);
        }
        stock
    }
}

/// Where the orders go: the topic with route `order.created`.
pub fn destination(topic: &str) -> Destination {
    Destination::new(topic).with_route("order.created")
}

/// The inventory consumer's retry policy: two short tiers, four attempts.
pub fn retry_policy() -> RetryPolicy {
    RetryPolicy::tiers([Duration::from_millis(200), Duration::from_millis(500)])
        .max_attempts(4)
        .max_age(Duration::from_secs(600))
        .jitter(0.2)
}

/// The error the handler fails with while the database is down (`--db-outage`).
pub const OUTAGE_ERROR: &str = "database unavailable";

/// The breaker in front of the inventory database: it counts the database's failures
/// only ([`is_database_failure`]) — the warehouse's timeouts (two per order ending in 7,
/// a tenth of the orders) are another downstream's and neutral; opens when 80 % of at
/// least 40 outcomes over 10 s are such failures — an outage, not SQLite's lock
/// contention at 64 in flight on a loaded machine — and probes after 2 s; two successes
/// close it.
pub fn breaker() -> reliq::CircuitBreaker {
    reliq::CircuitBreaker::new("inventory-db")
        .counting(is_database_failure)
        .failure_ratio(0.8)
        .minimum_calls(40)
        .window(Duration::from_secs(10))
        .cool_down(Duration::from_secs(2))
        .probes(2)
}

/// Whether a handler error is the inventory database's: a sqlx error anywhere in its
/// chain, or the simulated outage ([`OUTAGE_ERROR`]).
pub fn is_database_failure(e: &(dyn std::error::Error + 'static)) -> bool {
    std::iter::successors(Some(e), |e| e.source())
        .any(|e| e.is::<sqlx::Error>() || e.to_string().contains(OUTAGE_ERROR))
}

/// The inventory consumer on `topic`, before its handler: [`retry_policy`], 64 in flight,
/// `db`'s rules for database errors (a serialization failure, a deadlock or a busy SQLite
/// file is transient), and the [`breaker`].
pub fn consumer(broker: Arc<dyn Broker>, topic: &str, db: &Db) -> ConsumerBuilder {
    subscribed(broker, topic)
        .classifier(db.error_rules(Classifier::default()))
        .circuit_breaker(breaker())
}

/// What the inventory consumer asks the broker for: `topic`, [`retry_policy`]'s tiers,
/// 64 in flight.
fn subscribed(broker: Arc<dyn Broker>, topic: &str) -> ConsumerBuilder {
    Consumer::builder(broker, CONSUMER)
        .subscribe(topic)
        .retry(retry_policy())
        .max_in_flight(64)
}

/// The orders service's AsyncAPI document on `broker`: the inventory consumer of `topic`
/// with `order.created`'s JSON Schema (derived from [`OrderCreated`] in its
/// [`Envelope`]), its retry and dead-letter channels (`docs/asyncapi/` holds it for each
/// backend).
pub async fn asyncapi(broker: Arc<dyn Broker>, topic: &str) -> anyhow::Result<AsyncApi> {
    // guide:asyncapi
    // The message is named for its event, not for the envelope's generic type.
    let payload = JsonCodec::<Envelope<OrderCreated>>::with_schema()
        .schema()
        .map(|schema| MessageSchema {
            name: "OrderCreated".into(),
            ..schema
        });
    let doc = AsyncApi::new("orders", "1.0.0").description(
        "The orders service of reliq's example: the inventory consumer reserves stock for \
         each `order.created` event, retries transient failures twice (200 ms, 500 ms) and \
         parks the rest in its dead-letter queue.",
    );
    // The consumer's own settings (source, retry tiers): its plan names every channel.
    let doc = subscribed(broker, topic).asyncapi(doc, payload).await?;
    // guide:end
    Ok(doc)
}

/// The inventory consumer's subscription on `topic` (for its DLQ).
pub fn subscription(topic: &str) -> Subscription {
    Subscription::new(CONSUMER, topic)
}

/// How long [`Db::open`] waits for an unreachable PostgreSQL.
pub const DATABASE_WAIT: Duration = Duration::from_secs(120);

/// The database could not be reached (a refused or timed-out connection), as opposed to
/// refusing what was asked of it.
fn unreachable(e: &anyhow::Error) -> bool {
    e.chain().any(|cause| {
        matches!(
            cause.downcast_ref::<sqlx::Error>(),
            Some(sqlx::Error::PoolTimedOut | sqlx::Error::Io(_))
        )
    })
}

/// The store of stock, inbox, orders and outbox. Cheap to clone.
#[derive(Clone, Debug)]
pub enum Db {
    /// The embedded default.
    Sqlite {
        /// The pool.
        pool: SqlitePool,
        /// The transactional inbox.
        inbox: SqliteInbox,
        /// The outbox.
        outbox: SqliteOutbox,
    },
    /// Production.
    Postgres {
        /// The pool (its connections use the schema given to [`Db::open`]).
        pool: PgPool,
        /// The transactional inbox.
        inbox: PgInbox,
        /// The outbox.
        outbox: PgOutbox,
    },
}

/// Run `$body` in a transaction of `$db` (begun `IMMEDIATE` on SQLite, so it takes the
/// write lock up front), binding the transaction, inbox and outbox; commit when the body
/// did not return early. The body is written once and compiled per store.
macro_rules! in_tx {
    ($db:expr, |$tx:ident, $inbox:pat_param, $outbox:pat_param| $body:block) => {
        match $db {
            Db::Sqlite {
                pool,
                inbox: $inbox,
                outbox: $outbox,
            } => {
                let mut $tx = pool.begin_with("BEGIN IMMEDIATE").await?;
                let value = $body;
                $tx.commit().await?;
                value
            }
            Db::Postgres {
                pool,
                inbox: $inbox,
                outbox: $outbox,
            } => {
                let mut $tx = pool.begin().await?;
                let value = $body;
                $tx.commit().await?;
                value
            }
        }
    };
}

/// Evaluate `$e` with `$pool` bound to the store's pool (compiled per store).
macro_rules! on_pool {
    ($db:expr, |$pool:ident| $e:expr) => {
        match $db {
            Db::Sqlite { pool: $pool, .. } => $e,
            Db::Postgres { pool: $pool, .. } => $e,
        }
    };
}

/// The application's tables (the same SQL on both stores).
const SCHEMA: [&str; 3] = [
    "CREATE TABLE IF NOT EXISTS orders (message_id TEXT PRIMARY KEY, created_at BIGINT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS reservations (message_id TEXT NOT NULL, sku TEXT NOT NULL, \
     qty BIGINT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS stock (sku TEXT PRIMARY KEY, reserved BIGINT NOT NULL)",
];

impl Db {
    /// `classifier` with this store's rules for `sqlx::Error`
    /// ([`reliq::postgres::error_class`], [`reliq::sqlite::error_class`]).
    pub fn error_rules(&self, classifier: Classifier) -> Classifier {
        match self {
            Db::Sqlite { .. } => reliq::sqlite::with_error_rules(classifier),
            Db::Postgres { .. } => reliq::postgres::with_error_rules(classifier),
        }
    }

    /// Open `url`: `sqlite://file.db` (created if missing) or `postgres://…`, where
    /// `schema` (created if missing) holds the tables. An unreachable PostgreSQL is
    /// waited for, up to [`DATABASE_WAIT`], with a warning per attempt: a service
    /// (re)started during a database outage waits it out instead of exiting.
    pub async fn open(url: &str, schema: Option<&str>) -> anyhow::Result<Self> {
        if url.starts_with("sqlite:") {
            let pool = reliq::sqlite::connect(url).await?;
            return Ok(Self::Sqlite {
                inbox: SqliteInbox::new(pool.clone()),
                outbox: SqliteOutbox::new(pool.clone()),
                pool,
            });
        }
        reliq::through_outage(
            "opening the PostgreSQL store",
            reliq::OutageWait {
                first: Duration::from_millis(500),
                ..reliq::OutageWait::up_to(DATABASE_WAIT)
            },
            unreachable,
            || Self::open_postgres(url, schema),
        )
        .await
    }

    async fn open_postgres(url: &str, schema: Option<&str>) -> anyhow::Result<Self> {
        let mut options = PgConnectOptions::from_str(url)
            .with_context(|| format!("not a sqlite:// or postgres:// URL: {}", redact_url(url)))?;
        if let Some(schema) = schema {
            let admin = PgPool::connect_with(options.clone())
                .await
                .with_context(|| format!("connecting to {}", redact_url(url)))?;
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "CREATE SCHEMA IF NOT EXISTS {}",
                quote_ident(schema)
            )))
            .execute(&admin)
            .await?;
            admin.close().await;
            options = options.options([("search_path", schema)]);
        }
        let pool = PgPoolOptions::new()
            .max_connections(16)
            .connect_with(options)
            .await
            .with_context(|| format!("connecting to {}", redact_url(url)))?;
        Ok(Self::Postgres {
            inbox: PgInbox::new(pool.clone()),
            outbox: PgOutbox::new(pool.clone()),
            pool,
        })
    }

    /// Drop a PostgreSQL schema made by [`Db::open`], with everything in it.
    pub async fn drop_schema(url: &str, schema: &str) -> anyhow::Result<()> {
        let admin = PgPool::connect(url).await?;
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP SCHEMA IF EXISTS {} CASCADE",
            quote_ident(schema)
        )))
        .execute(&admin)
        .await?;
        admin.close().await;
        Ok(())
    }

    /// Create reliq's tables (migrations) and the application's (idempotent).
    pub async fn setup(&self) -> anyhow::Result<()> {
        match self {
            Self::Sqlite { pool, .. } => reliq::sqlite::migrate(pool).await?,
            Self::Postgres { pool, .. } => reliq::postgres::migrate(pool).await?,
        }
        for sql in SCHEMA {
            on_pool!(self, |pool| sqlx::query(sql).execute(pool).await.map(drop))?;
        }
        Ok(())
    }

    /// The producer: record each order and enqueue it for `destination` in the same
    /// transaction (200 per transaction). Returns how many were new.
    pub async fn place(
        &self,
        destination: &Destination,
        messages: &[Message],
    ) -> anyhow::Result<usize> {
        let mut placed = 0;
        for chunk in messages.chunks(PLACE_BATCH) {
            placed += in_tx!(self, |tx, _, outbox| {
                let mut new = 0;
                for m in chunk {
                    sqlx::query(
                        "INSERT INTO orders (message_id, created_at) VALUES ($1, $2) \
                         ON CONFLICT DO NOTHING",
                    )
                    .bind(m.id().as_str())
                    .bind(now_ms())
                    .execute(&mut *tx)
                    .await?;
                    new += usize::from(outbox.enqueue(&mut tx, destination, m).await?);
                }
                new
            });
        }
        Ok(placed)
    }

    /// A relay publishing this store's outbox through `broker`.
    pub fn relay(&self, broker: Arc<dyn Broker>) -> anyhow::Result<RelayHandle> {
        let builder = match self {
            Self::Sqlite { outbox, .. } => outbox.relay(broker),
            Self::Postgres { outbox, .. } => outbox.relay(broker),
        };
        Ok(builder.name("orders").build()?.start())
    }

    /// Outbox rows not published yet.
    pub async fn unsent(&self) -> anyhow::Result<u64> {
        Ok(match self {
            Self::Sqlite { outbox, .. } => outbox.unsent().await?,
            Self::Postgres { outbox, .. } => outbox.unsent().await?,
        })
    }

    /// The inventory handler: decode (poison → DLQ), then in one transaction claim the id
    /// in the inbox (a duplicate returns [`reliq::Duplicate`]: acked, skipped, counted),
    /// check the SKU (unknown → permanent), call the flaky warehouse (transient on the
    /// first two deliveries of its orders), record the reservation and add to the stock.
    /// Returns after COMMIT; the runtime acknowledges after that.
    pub async fn reserve(&self, consumer: &str, d: &Delivery) -> Result<(), BoxError> {
        let order: Envelope<OrderCreated> = d.envelope(1)?;
        let order = order.data;
        in_tx!(self, |tx, inbox, _| {
            inbox
                .claim(&mut tx, consumer, d.id())
                .await?
                .first_or_skip()?;
            if !order.sku.starts_with("sku-") {
                return Err(Permanent::msg(format!("unknown sku `{}`", order.sku)).into());
            }
            if order.order_id.ends_with('7') && d.attempt() <= 2 {
                return Err(Transient::msg("warehouse service timed out").into());
            }
            sqlx::query("INSERT INTO reservations (message_id, sku, qty) VALUES ($1, $2, $3)")
                .bind(d.id().as_str())
                .bind(&order.sku)
                .bind(i64::from(order.qty))
                .execute(&mut *tx)
                .await?;
            sqlx::query(
                "INSERT INTO stock (sku, reserved) VALUES ($1, $2) \
                 ON CONFLICT (sku) DO UPDATE SET reserved = stock.reserved + excluded.reserved",
            )
            .bind(&order.sku)
            .bind(i64::from(order.qty))
            .execute(&mut *tx)
            .await?;
        });
        Ok(())
    }

    /// Reservation rows per message id.
    pub async fn reservations(&self) -> anyhow::Result<HashMap<String, i64>> {
        self.counts("SELECT message_id, count(*) FROM reservations GROUP BY message_id")
            .await
    }

    /// Distinct reserved orders (cheap enough to poll).
    pub async fn reserved_orders(&self) -> anyhow::Result<u64> {
        let sql = "SELECT count(DISTINCT message_id) FROM reservations";
        let (n,): (i64,) = on_pool!(self, |pool| sqlx::query_as(sql).fetch_one(pool).await)?;
        Ok(u64::try_from(n)?)
    }

    /// Inbox rows of `consumer` per message id.
    pub async fn inbox_rows(&self, consumer: &str) -> anyhow::Result<HashMap<String, i64>> {
        let sql = "SELECT message_id, count(*) FROM reliq_inbox WHERE consumer = $1 \
                   GROUP BY message_id";
        let rows: Vec<(String, i64)> = on_pool!(self, |pool| sqlx::query_as(sql)
            .bind(consumer)
            .fetch_all(pool)
            .await)?;
        Ok(rows.into_iter().collect())
    }

    /// Reserved quantity per SKU.
    pub async fn stock(&self) -> anyhow::Result<HashMap<String, i64>> {
        self.counts("SELECT sku, reserved FROM stock").await
    }

    async fn counts(&self, sql: &'static str) -> anyhow::Result<HashMap<String, i64>> {
        let rows: Vec<(String, i64)> =
            on_pool!(self, |pool| sqlx::query_as(sql).fetch_all(pool).await)?;
        Ok(rows.into_iter().collect())
    }

    /// Close the pool.
    pub async fn close(&self) {
        on_pool!(self, |pool| pool.close().await);
    }
}

/// What a run of the orders service did: the example's summary line, and the consumer's
/// own counters (what its metrics say).
#[derive(Clone, Debug)]
pub struct Summary {
    /// Distinct orders published.
    pub published: usize,
    /// Orders reserved (each once), read back from the database.
    pub processed: usize,
    /// Distinct orders in the DLQ.
    pub dead_lettered: usize,
    /// Orders neither reserved nor dead-lettered (must be 0).
    pub lost: usize,
    /// The consumer's counters at its shutdown.
    pub stats: reliq::StatsSnapshot,
    /// The outbox relay's counters at its shutdown.
    pub relay: reliq::RelayStats,
    /// Handler calls that met the database outage (`--db-outage`; 0 without one).
    pub outage_failures: u64,
    /// Distinct orders in the DLQ whose last error is the outage's (must be 0: the
    /// breaker keeps them in the broker).
    pub outage_dead_lettered: usize,
}

impl std::fmt::Display for Summary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "summary published={} processed={} retried={} dead_lettered={} duplicates={} lost={}",
            self.published,
            self.processed,
            self.stats.retried,
            self.dead_lettered,
            self.stats.duplicates,
            self.lost
        )?;
        if self.outage_failures > 0 {
            write!(
                f,
                " outage_failures={} outage_dead_lettered={}",
                self.outage_failures, self.outage_dead_lettered
            )?;
        }
        Ok(())
    }
}

/// Run the orders service once on `broker`: `orders` orders through the outbox, the
/// inventory consumer until every order is reserved or dead-lettered (or `timeout`), and
/// the checks (no order reserved twice, none both reserved and dead-lettered).
pub async fn run(
    broker: Arc<dyn Broker>,
    db: &Db,
    topic: &str,
    orders: u32,
    timeout: Duration,
) -> anyhow::Result<Summary> {
    run_with_outage(broker, db, topic, orders, timeout, Duration::ZERO).await
}

/// [`run`], with the database down for the first `outage` of the run: every handler call
/// meanwhile fails with [`OUTAGE_ERROR`] (transient), as a refused connection would.
pub async fn run_with_outage(
    broker: Arc<dyn Broker>,
    db: &Db,
    topic: &str,
    orders: u32,
    timeout: Duration,
    outage: Duration,
) -> anyhow::Result<Summary> {
    db.setup().await?;
    let handler_db = db.clone();
    let back_at = tokio::time::Instant::now() + outage;
    let outage_failures = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let failures = outage_failures.clone();
    let consumer = consumer(broker.clone(), topic, db)
        .start(move |d: Delivery| {
            let db = handler_db.clone();
            let failures = failures.clone();
            async move {
                if tokio::time::Instant::now() < back_at {
                    failures.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    return Err(Transient::msg(OUTAGE_ERROR).into());
                }
                db.reserve(CONSUMER, &d).await
            }
        })
        .await?;
    let relay = db.relay(broker.clone())?;

    // The orders service: every order and its event in one transaction; the relay
    // publishes. An order published twice stands for a relay that died between the
    // broker's confirm and marking the row sent: its second copy goes out directly.
    let stream = self::orders(orders)?;
    let expected = Expected::of(&stream);
    let published: HashSet<MessageId> = stream.iter().map(|o| o.message.id().clone()).collect();
    let messages: Vec<_> = stream.iter().map(|o| o.message.clone()).collect();
    let destination = destination(topic);
    db.place(&destination, &messages).await?;
    for order in stream.iter().filter(|o| o.copies > 1) {
        for _ in 1..order.copies {
            broker.publish(&destination, order.message.clone()).await?;
        }
    }

    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let s = consumer.stats();
        let reserved = db.reserved_orders().await?;
        if reserved >= expected.valid.len() as u64
            && s.dead_lettered >= expected.dead.len() as u64
            && s.in_flight == 0
            && db.unsent().await? == 0
        {
            break;
        }
        if tokio::time::Instant::now() > deadline {
            tracing::warn!(reserved, stats = ?s, "timed out waiting for the orders");
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Let the duplicate copies drain too.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let relay = relay.shutdown().await;
    let report = consumer.shutdown().await;

    let listing = Replay::new(broker.clone(), subscription(topic))
        .dry_run()
        .await?;
    let outage_dead_lettered = listing
        .matched
        .iter()
        .filter(|e| {
            e.record
                .error
                .as_deref()
                .is_some_and(|t| t.contains(OUTAGE_ERROR))
        })
        .map(|e| e.id.clone())
        .collect::<HashSet<_>>()
        .len();
    let dead: HashSet<MessageId> = listing.matched.into_iter().map(|e| e.id).collect();
    let rows = db.reservations().await?;
    let reserved: HashSet<MessageId> = published
        .iter()
        .filter(|id| rows.contains_key(id.as_str()))
        .cloned()
        .collect();
    let twice = rows.values().filter(|n| **n > 1).count();
    anyhow::ensure!(twice == 0, "{twice} orders were reserved more than once");
    let both = reserved.intersection(&dead).count();
    anyhow::ensure!(
        both == 0,
        "{both} orders were both reserved and dead-lettered"
    );
    let lost = published
        .iter()
        .filter(|id| !reserved.contains(*id) && !dead.contains(*id))
        .count();
    Ok(Summary {
        published: published.len(),
        processed: reserved.len(),
        dead_lettered: dead.len(),
        lost,
        stats: report.stats,
        relay,
        outage_failures: outage_failures.load(std::sync::atomic::Ordering::Relaxed),
        outage_dead_lettered,
    })
}

/// The DLQ of `sub`, read with the operator tooling's dry run (nothing is removed):
/// copies per message id.
pub async fn dead_letters(
    broker: &Arc<dyn Broker>,
    sub: &Subscription,
) -> anyhow::Result<HashMap<MessageId, usize>> {
    Ok(dead_letter_reasons(broker, sub)
        .await?
        .into_iter()
        .map(|(id, reasons)| (id, reasons.len()))
        .collect())
}

/// The DLQ of `sub` as [`dead_letters`] reads it: the reason of each copy, per message id.
pub async fn dead_letter_reasons(
    broker: &Arc<dyn Broker>,
    sub: &Subscription,
) -> anyhow::Result<HashMap<MessageId, Vec<DeadLetterReason>>> {
    let listing = Replay::new(broker.clone(), sub.clone()).dry_run().await?;
    let mut copies: HashMap<MessageId, Vec<DeadLetterReason>> = HashMap::new();
    for entry in listing.matched {
        tracing::info!(id = %entry.id, reason = %entry.record.reason, error = ?entry.record.error, "parked");
        copies
            .entry(entry.id)
            .or_default()
            .push(entry.record.reason);
    }
    Ok(copies)
}

fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

fn now_ms() -> i64 {
    let since = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    i64::try_from(since.as_millis()).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_breaker_counts_the_database_s_failures_not_the_warehouse_s() {
        let warehouse: BoxError = Transient::msg("warehouse service timed out").into();
        assert!(!is_database_failure(warehouse.as_ref()));
        let outage: BoxError = Transient::msg(OUTAGE_ERROR).into();
        assert!(is_database_failure(outage.as_ref()));
        let pool: BoxError = sqlx::Error::PoolTimedOut.into();
        assert!(is_database_failure(pool.as_ref()));
    }
}
